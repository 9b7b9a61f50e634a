//! Parameters and their gradients. A [`Param`] is a named, shared, replaceable tensor owned by a model; the
//! optimiser swaps in updated tensors. [`Gradients`] maps parameters to their gradients after backward. A
//! parameter may be sharded over ranks ([`Param::shard_over`], [`crate::shard`]): then the tape, the
//! optimisers and the compile step work on this rank's slice of its state.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use candle_core::Tensor;

use crate::comm::ProcessGroup;
use crate::shard::{ParamShard, ShardLevel};
use crate::{Error, Result};

/// A parameter's identity (unique in the process).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(u64);

static NEXT_PARAM: AtomicU64 = AtomicU64::new(0);

#[derive(Debug)]
struct ParamInner {
    id: ParamId,
    name: String,
    tensor: RwLock<Tensor>,
    shard: RwLock<Option<Arc<ParamShard>>>,
    frozen: AtomicBool,
}

/// A trainable tensor. Clones share it: a model and its optimiser see the same parameter.
#[derive(Clone, Debug)]
pub struct Param(Arc<ParamInner>);

impl Param {
    /// A new parameter named `name` (use the checkpoint's tensor name, e.g. `model.layers.0.mlp.up_proj.weight`).
    pub fn new(name: impl Into<String>, tensor: Tensor) -> Self {
        let id = ParamId(NEXT_PARAM.fetch_add(1, Ordering::Relaxed));
        Self(Arc::new(ParamInner {
            id,
            name: name.into(),
            tensor: RwLock::new(tensor),
            shard: RwLock::new(None),
            frozen: AtomicBool::new(false),
        }))
    }

    /// Its identity.
    pub fn id(&self) -> ParamId {
        self.0.id
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Freezes the parameter (`true`) or makes it trainable again: a frozen parameter is a constant on the
    /// tape (no gradient, no `dW` product), has no optimizer state and is never sharded
    /// ([`crate::module::trainable_params`] leaves it out). LoRA freezes a model's base weights.
    pub fn set_frozen(&self, frozen: bool) {
        self.0.frozen.store(frozen, Ordering::Relaxed);
    }

    /// Whether the parameter is frozen ([`set_frozen`](Self::set_frozen)).
    pub fn is_frozen(&self) -> bool {
        self.0.frozen.load(Ordering::Relaxed)
    }

    /// The stored tensor (a cheap handle clone): the whole parameter, or this rank's slice `[chunk]` when it is
    /// sharded at [`ShardLevel::Parameters`] (use [`whole`](Self::whole) for the whole one).
    pub fn tensor(&self) -> Tensor {
        self.0.tensor.read().expect("param lock poisoned").clone()
    }

    /// Its sharding, when it is sharded.
    pub fn shard(&self) -> Option<Arc<ParamShard>> {
        self.0.shard.read().expect("param lock poisoned").clone()
    }

    /// The whole parameter's shape (the stored tensor's, unless it is sharded at `Parameters`).
    pub fn shape(&self) -> candle_core::Shape {
        match self.shard() {
            Some(s) => s.shape.clone(),
            None => self.tensor().shape().clone(),
        }
    }

    /// Shards this parameter's state over `group` at `level` (see [`crate::shard`]); `ShardLevel::None` leaves
    /// it whole. At `Parameters` the stored tensor becomes this rank's slice. At `Optimizer` and `Gradients`
    /// on ranks that share memory (threads), every rank then holds rank 0's tensor: one copy in the process,
    /// as after every update ([`set_update`](Self::set_update)). Every rank of `group` calls it with the same
    /// whole parameter (collective). Fails when the parameter is sharded already. A frozen parameter
    /// ([`set_frozen`](Self::set_frozen)) has no gradient or optimizer state to shard: it stays whole below
    /// `Parameters` and is stored as a slice at `Parameters` (LoRA's base: 1/W of it per rank), gathered for
    /// each use by a gather that records no gradient ([`crate::Tape::param`]).
    pub fn shard_over(&self, level: ShardLevel, group: Arc<dyn ProcessGroup>) -> Result<()> {
        if level == ShardLevel::None || (self.is_frozen() && level != ShardLevel::Parameters) {
            return Ok(());
        }
        let whole = self.tensor();
        let s = Arc::new(ParamShard::new(level, group, whole.shape().clone()));
        self.claim_shard(&s, "Param::shard_over")?;
        if level == ShardLevel::Parameters {
            *self.0.tensor.write().expect("param lock poisoned") = s.slice(&whole)?;
        } else if s.group.shares_memory() && s.group.size() > 1 {
            let shared = crate::comm::broadcast(s.group.as_ref(), &whole, 0)?;
            *self.0.tensor.write().expect("param lock poisoned") = shared;
        }
        Ok(())
    }

    /// Shards this parameter at [`ShardLevel::Parameters`] over `group` with this rank's slice given, so that the
    /// whole weight never exists here: `slice: [chunk]` is what [`shard_over`](Self::shard_over) would have
    /// cut from the whole (elements `rank·chunk ..` of the flattened parameter, zero-padded past its end; see
    /// [`crate::shard::ShardLayout`]), read from a file by the caller. The stored tensor gives only the whole
    /// shape, dtype and device (a placeholder such as a stride-0 broadcast of one element does) and is
    /// replaced. Fails when the slice's length, dtype or device is not the stored tensor's slice's, or the
    /// parameter is sharded already. No collective.
    pub fn shard_from_slice(&self, group: Arc<dyn ProcessGroup>, slice: Tensor) -> Result<()> {
        let cur = self.tensor();
        // The whole shape (a parameter sharded already keeps it, and is refused below, naming that).
        let s = Arc::new(ParamShard::new(ShardLevel::Parameters, group, self.shape()));
        if slice.dims() != [s.layout.chunk] || slice.dtype() != cur.dtype() || !slice.device().same_device(cur.device())
        {
            return Err(Error::InvalidArgument {
                op: "Param::shard_from_slice",
                msg: format!(
                    "the slice of `{}` is {:?} {:?} on {:?}, but this rank's slice of {:?} {:?} is [{}] on {:?}: read \
                     the elements ShardLayout::owned gives, padded to its chunk, in the parameter's dtype",
                    self.name(),
                    slice.dims(),
                    slice.dtype(),
                    slice.device().location(),
                    s.shape.dims(),
                    cur.dtype(),
                    s.layout.chunk,
                    cur.device().location()
                ),
            });
        }
        self.claim_shard(&s, "Param::shard_from_slice")?;
        *self.0.tensor.write().expect("param lock poisoned") = slice;
        Ok(())
    }

    /// Records `s` as this parameter's sharding, under the lock, which no collective holds: a parameter two
    /// ranks share (a model cloned across thread ranks) fails on the second rank instead of stalling the first.
    fn claim_shard(&self, s: &Arc<ParamShard>, op: &'static str) -> Result<()> {
        let mut shard = self.0.shard.write().expect("param lock poisoned");
        if shard.is_some() {
            return Err(Error::InvalidArgument {
                op,
                msg: format!(
                    "parameter `{}` is sharded already; shard a model once (a model cloned for each thread rank \
                     shares its parameters: give each rank its own model)",
                    self.name()
                ),
            });
        }
        *shard = Some(s.clone());
        Ok(())
    }

    /// The whole parameter: the stored tensor, or, sharded at `Parameters`, the slices of every rank gathered
    /// (collective: every rank of the shard's group must call it, in the same order).
    pub fn whole(&self) -> Result<Tensor> {
        match self.shard() {
            Some(s) if s.level == ShardLevel::Parameters => s.gather(&self.tensor()),
            _ => Ok(self.tensor()),
        }
    }

    /// What an optimiser updates: the whole parameter when it is not sharded, else this rank's slice `[chunk]`
    /// (a copy at `Optimizer` and `Gradients`, the stored slice at `Parameters`).
    pub fn update_view(&self) -> Result<Tensor> {
        match self.shard() {
            Some(s) if s.level != ShardLevel::Parameters => s.slice(&self.tensor()),
            _ => Ok(self.tensor()),
        }
    }

    /// Stores an update of [`update_view`](Self::update_view): the whole parameter, or this rank's slice, which
    /// at `Optimizer` and `Gradients` is all-gathered into the whole parameter (collective; thread ranks then
    /// hold one tensor between them) and at `Parameters` stored as it is.
    pub fn set_update(&self, t: Tensor) -> Result<()> {
        match self.shard() {
            Some(s) if s.level != ShardLevel::Parameters => self.set(s.gather(&t)?),
            _ => self.set(t),
        }
    }

    /// Replaces the tensor; shape, dtype and device must stay the same (a tensor on another device is refused,
    /// not moved: a CPU tensor written into a CUDA parameter would make the next step mix devices).
    pub fn set(&self, t: Tensor) -> Result<()> {
        let mut cur = self.0.tensor.write().expect("param lock poisoned");
        if !cur.device().same_device(t.device()) {
            return Err(Error::InvalidArgument {
                op: "Param::set",
                msg: format!(
                    "parameter `{}` is on {:?} but the new tensor is on {:?}; move it with `to_device` first",
                    self.name(),
                    cur.device().location(),
                    t.device().location()
                ),
            });
        }
        if cur.shape() != t.shape() || cur.dtype() != t.dtype() {
            return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                op: "Param::set",
                lhs_name: "parameter",
                lhs: cur.dims().to_vec(),
                rhs_name: "new tensor",
                rhs: t.dims().to_vec(),
                hint: format!(
                    "parameter `{}` keeps its shape and dtype ({:?} vs {:?})",
                    self.name(),
                    cur.dtype(),
                    t.dtype()
                ),
            })));
        }
        *cur = t;
        Ok(())
    }
}

/// Gradients of parameters, by parameter.
#[derive(Clone, Debug, Default)]
pub struct Gradients {
    grads: HashMap<ParamId, Tensor>,
}

impl Gradients {
    /// No gradients.
    pub fn new() -> Self {
        Self::default()
    }

    /// The gradient of `p`, if it got one.
    pub fn get(&self, p: &Param) -> Option<&Tensor> {
        self.grads.get(&p.id())
    }

    /// Sets the gradient of `p`.
    pub fn insert(&mut self, p: &Param, g: Tensor) {
        self.grads.insert(p.id(), g);
    }

    /// Sets the gradient of the parameter with id `id`.
    pub fn insert_id(&mut self, id: ParamId, g: Tensor) {
        self.grads.insert(id, g);
    }

    /// Takes the gradient of `p` out.
    pub fn remove(&mut self, p: &Param) -> Option<Tensor> {
        self.grads.remove(&p.id())
    }

    /// Adds `g` to the gradient of `p` (gradient accumulation over micro-batches).
    pub fn accumulate(&mut self, p: &Param, g: &Tensor) -> Result<()> {
        let sum = match self.grads.get(&p.id()) {
            Some(cur) => (cur + g)?,
            None => g.clone(),
        };
        self.grads.insert(p.id(), sum);
        Ok(())
    }

    /// The number of parameters with a gradient.
    pub fn len(&self) -> usize {
        self.grads.len()
    }

    /// Whether no parameter has a gradient.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    /// The gradients in parameter-id order (a fixed order, so reductions over them are deterministic).
    pub fn sorted(&self) -> Vec<(ParamId, &Tensor)> {
        let mut v: Vec<(ParamId, &Tensor)> = self.grads.iter().map(|(k, t)| (*k, t)).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// The gradient of the parameter with id `id`.
    pub fn get_id(&self, id: ParamId) -> Option<&Tensor> {
        self.grads.get(&id)
    }

    /// Multiplies every gradient by `s`.
    pub fn scale(&mut self, s: f64) -> Result<()> {
        for g in self.grads.values_mut() {
            *g = (&*g * s)?;
        }
        Ok(())
    }
}
