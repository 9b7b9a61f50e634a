//! The [`Tape`]: records op applications while model code runs, holds exactly the tensors backward needs,
//! drops what a checkpoint policy does not keep when a region closes, and runs backward (in `backward.rs`).
//! One tape per rank and step, owned by whoever runs the step; never global. An inference tape runs the
//! same model code and records nothing.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};

use crate::checkpoint::Region;
use crate::memory::{storage_bytes, MemoryTracker};
use crate::node::Node;
use crate::ops::shard_param::ShardedParam;
use crate::shard::{ParamShard, ShardLevel};
use crate::value::ValueRef;
use crate::{CheckpointPolicy, Error, Gradients, MemoryStats, NodeKind, Op, Param, ParamId, Result, Value};

static NEXT_TAPE: AtomicU64 = AtomicU64::new(1);

/// What kind of entry a value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// Output of a node.
    Node(usize),
    /// A parameter leaf (held for the tape's life, not counted as activation memory).
    Param(ParamId),
    /// A leaf from `Tape::leaf`.
    Leaf,
    /// A constant: takes no gradient.
    Constant,
}

#[derive(Debug)]
pub(crate) struct ValueInfo {
    pub(crate) origin: Origin,
    pub(crate) region: Option<usize>,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    pub(crate) requires_grad: bool,
    /// The tensor, while the tape holds it.
    pub(crate) tensor: Option<Tensor>,
    /// Nodes not yet differentiated whose backward reads this value.
    pub(crate) save_count: usize,
    /// Regions, not yet differentiated, that need this value to replay: they read it without producing it,
    /// or it is the output of a node they may not replay.
    pub(crate) region_uses: usize,
    /// Dropped by a closing region: backward regenerates it by replay.
    pub(crate) dropped: bool,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) recording: bool,
    pub(crate) policy: CheckpointPolicy,
    pub(crate) values: Vec<ValueInfo>,
    pub(crate) nodes: Vec<Node>,
    pub(crate) regions: Vec<Region>,
    pub(crate) region_inputs: Vec<Vec<usize>>,
    pub(crate) open: Option<usize>,
    pub(crate) params: HashMap<ParamId, usize>,
    pub(crate) leaf_grads: HashMap<usize, Tensor>,
    pub(crate) memory: MemoryTracker,
    pub(crate) released: bool,
    pub(crate) replays: usize,
    /// The region whose dropped values backward regenerated, and those values.
    pub(crate) replay_region: Option<usize>,
    pub(crate) replayed: HashMap<usize, Tensor>,
    /// The caller checked the token ids and targets on the host ([`Tape::inputs_checked`]).
    pub(crate) inputs_checked: bool,
    /// The length of the whole sequence this forward is part of ([`Tape::sequence_length`]).
    pub(crate) sequence_length: Option<usize>,
    /// The documents of the packed window this forward runs ([`Tape::documents`]).
    pub(crate) documents: Option<std::sync::Arc<crate::ops::attention::Documents>>,
    /// Where the next forward's tokens sit in the step's global batch ([`Tape::token_coordinates`]).
    pub(crate) coordinates: Option<std::sync::Arc<crate::TokenCoordinates>>,
}

/// A reverse-mode autodiff tape over candle tensors, with checkpoint regions.
#[derive(Debug)]
pub struct Tape {
    pub(crate) id: u64,
    pub(crate) inner: RefCell<Inner>,
}

impl Drop for Tape {
    /// A recording tape's forward is over when it goes: this thread's forward mark with it.
    fn drop(&mut self) {
        if self.inner.get_mut().recording {
            crate::progress::set_forward_mark(None);
        }
    }
}

/// One tensor the tape holds, for inspecting what a policy kept.
#[derive(Clone, Debug)]
pub struct HeldValue {
    /// The value's index on the tape.
    pub id: usize,
    /// The op that produced it (`None` for leaves and constants).
    pub op: Option<&'static str>,
    /// The kind of that op.
    pub kind: Option<NodeKind>,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The bytes of its storage.
    pub bytes: usize,
    /// The region that produced it.
    pub region: Option<usize>,
}

impl Tape {
    /// A recording tape with the given checkpoint policy.
    pub fn new(policy: CheckpointPolicy) -> Self {
        Self::make(true, policy)
    }

    /// A tape that records nothing: the same model code runs forward only.
    pub fn inference() -> Self {
        Self::make(false, CheckpointPolicy::None)
    }

    fn make(recording: bool, policy: CheckpointPolicy) -> Self {
        Self {
            id: NEXT_TAPE.fetch_add(1, Ordering::Relaxed),
            inner: RefCell::new(Inner {
                recording,
                policy,
                values: Vec::new(),
                nodes: Vec::new(),
                regions: Vec::new(),
                region_inputs: Vec::new(),
                open: None,
                params: HashMap::new(),
                leaf_grads: HashMap::new(),
                memory: MemoryTracker::default(),
                released: false,
                replays: 0,
                replay_region: None,
                replayed: HashMap::new(),
                inputs_checked: false,
                sequence_length: None,
                documents: None,
                coordinates: None,
            }),
        }
    }

    /// Declares that the token ids and targets this tape is fed were checked on the host by the caller (every
    /// id inside the vocabulary; the compiled step checks each batch before it shards it): the ops then skip
    /// their own range checks, each of which reads a device tensor back to the host
    /// ([`crate::host_read`]). Only for callers that did check: an id out of range on a GPU is not caught
    /// there.
    pub fn set_inputs_checked(&self) {
        self.inner.borrow_mut().inputs_checked = true;
    }

    /// Whether the caller checked the ids and targets ([`set_inputs_checked`](Self::set_inputs_checked)).
    pub fn inputs_checked(&self) -> bool {
        self.inner.borrow().inputs_checked
    }

    /// Declares the length of the whole sequence the forward on this tape is part of: its real tokens
    /// (largest position + 1, without the padding a step adds), over every rank of the sequence-parallel
    /// group. A rank sees only its shard's positions; a model whose positions depend on the length (RoPE's
    /// `dynamic` and `longrope` scalings) reads it here. The compiled step sets it for every forward.
    pub fn set_sequence_length(&self, len: usize) {
        self.inner.borrow_mut().sequence_length = Some(len);
    }

    /// The length [`set_sequence_length`](Self::set_sequence_length) declared, if any (a model then falls
    /// back to its own positions: largest + 1).
    pub fn sequence_length(&self) -> Option<usize> {
        self.inner.borrow().sequence_length
    }

    /// Declares the documents of the packed window the next forward on this tape runs (`None`: one sequence,
    /// the default): a model that supports packed sequences ([`crate::CausalLm::supports_documents`]) restarts
    /// its positions at each document and masks attention to each token's own document. Its positions are
    /// then window positions (`0..n`, padding past them), attention offsets are 0 (the window's start), and a
    /// model reads the documents when it builds its forward, so a caller may set other documents before the
    /// next forward on the same tape (the compiled step does, one group of rows at a time).
    pub fn set_documents(&self, documents: Option<std::sync::Arc<crate::ops::attention::Documents>>) {
        self.inner.borrow_mut().documents = documents;
    }

    /// The documents [`set_documents`](Self::set_documents) declared, if any.
    pub fn documents(&self) -> Option<std::sync::Arc<crate::ops::attention::Documents>> {
        self.inner.borrow().documents.clone()
    }

    /// Declares where the rows and columns of the next forward's `[rows, columns]` tokens sit in the step's
    /// global batch (`None`: the forward's own rows and columns, from 0). Per-token random draws (LoRA's
    /// dropout masks) read it, so they depend on the token, not on the rank that computes it; the compiled
    /// step sets it for each group of rows it runs.
    pub fn set_token_coordinates(&self, coordinates: Option<std::sync::Arc<crate::TokenCoordinates>>) {
        self.inner.borrow_mut().coordinates = coordinates;
    }

    /// The coordinates [`set_token_coordinates`](Self::set_token_coordinates) declared, if any.
    pub fn token_coordinates(&self) -> Option<std::sync::Arc<crate::TokenCoordinates>> {
        self.inner.borrow().coordinates.clone()
    }

    /// Whether a gradient flows to `v` on this tape: it records, tracks `v`, and `v` is not a frozen leaf
    /// (or a constant).
    pub fn requires_grad(&self, v: &Value) -> bool {
        let inner = self.inner.borrow();
        inner.recording && v.id.is_some_and(|r| r.tape == self.id && inner.values[r.index].requires_grad)
    }

    /// Whether this tape records (false for an inference tape).
    pub fn is_recording(&self) -> bool {
        self.inner.borrow().recording
    }

    /// The checkpoint policy.
    pub fn policy(&self) -> CheckpointPolicy {
        self.inner.borrow().policy
    }

    /// The policy of the checkpoint region open now (`None` outside a region or on an inference tape). Modules
    /// read it to pick an implementation whose saved state suits the policy: a region that recomputes can use
    /// ops that recompute internally in sequence chunks.
    pub fn region_policy(&self) -> Option<CheckpointPolicy> {
        let inner = self.inner.borrow();
        if !inner.recording {
            return None;
        }
        inner.open.map(|r| inner.regions[r].policy)
    }

    /// Whether the checkpoint region open now recomputes (Full or SequenceAware): then a module may record
    /// one op that keeps only its inputs and outputs and redoes its inner work in backward.
    pub fn region_recomputes(&self) -> bool {
        matches!(self.region_policy(), Some(p) if p != CheckpointPolicy::None)
    }

    /// A parameter as a value for one use. An unsharded parameter (or one sharded at `Optimizer`) is a leaf;
    /// the same parameter always maps to the same leaf, so a parameter used twice (tied embeddings) gets the
    /// sum of both gradients. A parameter sharded at `Gradients` or `Parameters` ([`crate::shard`]) is this
    /// rank's slice as the leaf and, per use, a [`ShardedParam`](crate::ops::shard_param::ShardedParam) node
    /// that makes it whole (gathering it at `Parameters`: collective) and reduce-scatters its gradient in
    /// backward; the leaf's gradient is then this rank's reduced slice. An inference tape gets the whole
    /// weight (gathered at `Parameters`).
    ///
    /// A frozen parameter ([`Param::set_frozen`]) is a leaf that takes no gradient: the ops that use it skip
    /// the products that would only feed its gradient. Whole, it is the weight itself; sharded (frozen weights
    /// are sliced at `Parameters` only), its slice is the leaf and each use records a gather node that takes no
    /// gradient (no reduce-scatter in backward): regions drop its output when they close and backward replays
    /// it where it needs the weight, so a frozen base lives whole one block at a time, like a trainable one.
    pub fn param(&self, p: &Param) -> Result<Value> {
        if p.is_frozen() {
            if let Some((leaf, shard)) = self.param_slice(p)? {
                let op: Arc<dyn Op> = Arc::new(ShardedParam { param: p.clone(), shard });
                return Ok(self.apply_node(op, &[&leaf], true)?.remove(0));
            }
            // One leaf per frozen parameter that takes no gradient; like every parameter's, its bytes are the
            // model's, not the tape's.
            return self.param_leaf(p, false, || p.whole());
        }
        if p.shard().is_some_and(|s| s.level >= ShardLevel::Gradients) && !self.is_recording() {
            return Ok(Value::constant(p.whole()?));
        }
        let Some((leaf, shard)) = self.param_slice(p)? else { return self.param_leaf(p, true, || Ok(p.tensor())) };
        Ok(self.apply(ShardedParam { param: p.clone(), shard }, &[&leaf])?.remove(0))
    }

    /// The leaf of a parameter sharded at `Gradients` or `Parameters` on a recording tape, `[chunk]` (its
    /// slice: the gradient the tape gives it is the slice's), with its sharding; `None` otherwise. For ops that
    /// use the slice themselves instead of the gathered whole weight ([`crate::ops::sharded_embedding`]).
    pub fn param_slice(&self, p: &Param) -> Result<Option<(Value, Arc<ParamShard>)>> {
        let Some(shard) = p.shard().filter(|s| s.level >= ShardLevel::Gradients) else { return Ok(None) };
        if !self.is_recording() {
            return Ok(None);
        }
        let leaf = self.param_leaf(p, !p.is_frozen(), || match shard.level {
            ShardLevel::Parameters => Ok(p.tensor()),
            _ => shard.slice(&p.tensor()),
        })?;
        Ok(Some((leaf, shard)))
    }

    /// The leaf of parameter `p` on this tape, registered with `tensor()` the first time (a constant on an
    /// inference tape); `requires_grad: false` for a frozen one.
    fn param_leaf(&self, p: &Param, requires_grad: bool, tensor: impl FnOnce() -> Result<Tensor>) -> Result<Value> {
        if !self.is_recording() {
            return Ok(Value::constant(tensor()?));
        }
        if let Some(&index) = self.inner.borrow().params.get(&p.id()) {
            let inner = self.inner.borrow();
            let tensor = inner.values[index].tensor.clone().expect("a parameter's leaf is held for the tape's life");
            return Ok(Value { tensor, id: Some(ValueRef { tape: self.id, index }) });
        }
        let tensor = tensor()?;
        let mut inner = self.inner.borrow_mut();
        let index = inner.push_value(Origin::Param(p.id()), &tensor, requires_grad);
        inner.values[index].tensor = Some(tensor.clone());
        inner.params.insert(p.id(), index);
        Ok(Value { tensor, id: Some(ValueRef { tape: self.id, index }) })
    }

    /// A leaf that takes a gradient (for inputs you differentiate with respect to).
    pub fn leaf(&self, tensor: Tensor) -> Value {
        let mut inner = self.inner.borrow_mut();
        if !inner.recording {
            return Value::constant(tensor);
        }
        let index = inner.push_value(Origin::Leaf, &tensor, true);
        inner.hold(index, &tensor);
        Value { tensor, id: Some(ValueRef { tape: self.id, index }) }
    }

    /// A constant (ids, masks, rotary tables): registered once so that every use shares one entry.
    pub fn constant(&self, tensor: Tensor) -> Value {
        let mut inner = self.inner.borrow_mut();
        if !inner.recording {
            return Value::constant(tensor);
        }
        let index = inner.push_value(Origin::Constant, &tensor, false);
        Value { tensor, id: Some(ValueRef { tape: self.id, index }) }
    }

    /// Runs `op` on `inputs` and records it when a recording tape has an input that takes a gradient.
    pub fn apply(&self, op: impl Op + 'static, inputs: &[&Value]) -> Result<Vec<Value>> {
        self.apply_arc(Arc::new(op), inputs)
    }

    /// [`apply`](Self::apply) for an op already behind an `Arc`.
    pub fn apply_arc(&self, op: Arc<dyn Op>, inputs: &[&Value]) -> Result<Vec<Value>> {
        self.apply_node(op, inputs, false)
    }

    /// Runs `op` on `inputs` and records it when a recording tape has an input that takes a gradient, or
    /// whenever it records if `always` (a frozen weight's gather, which a region drops and backward replays):
    /// the outputs take a gradient only when an input does.
    fn apply_node(&self, op: Arc<dyn Op>, inputs: &[&Value], always: bool) -> Result<Vec<Value>> {
        for v in inputs {
            if let Some(r) = v.id {
                if r.tape != self.id {
                    return Err(Error::ForeignValue { value_tape: r.tape, tape: self.id });
                }
            }
        }
        let tensors: Vec<&Tensor> = inputs.iter().map(|v| &v.tensor).collect();
        crate::alloc::phase("forward", op.name());
        let outputs = {
            let _span = crate::profile::span("forward", op.name(), || role(&tensors));
            op.forward(&tensors)?
        };
        let mut inner = self.inner.borrow_mut();
        let grad_in = inputs.iter().any(|v| v.id.is_some_and(|r| inner.values[r.index].requires_grad));
        let tracked = inner.recording && (grad_in || always);
        if !tracked {
            return Ok(outputs.into_iter().map(Value::constant).collect());
        }
        if inner.released {
            return Err(Error::BackwardTwice);
        }
        let node = inner.nodes.len();
        let region = inner.open;
        let saves = op.saves();
        let mut input_ids = Vec::with_capacity(inputs.len());
        for (i, v) in inputs.iter().enumerate() {
            let index = match v.id {
                Some(r) => r.index,
                None => inner.push_value(Origin::Constant, &v.tensor, false),
            };
            input_ids.push(index);
            inner.note_use(index, &v.tensor, saves.input(i), region);
        }
        let mut output_ids = Vec::with_capacity(outputs.len());
        let mut values = Vec::with_capacity(outputs.len());
        for (j, t) in outputs.into_iter().enumerate() {
            let index = inner.push_value(Origin::Node(node), &t, grad_in);
            inner.values[index].region = region;
            if saves.output(j) {
                inner.values[index].save_count += 1;
                inner.hold(index, &t);
            }
            // A region that may not replay this kind of node (SequenceAware: attention, collectives) must keep
            // its outputs whether or not a backward reads them: regenerating anything downstream starts here.
            if let Some(r) = region {
                if !inner.regions[r].policy.may_replay(op.kind()) {
                    inner.region_inputs[r].push(index);
                    inner.values[index].region_uses += 1;
                    inner.hold(index, &t);
                }
            }
            output_ids.push(index);
            values.push(Value { tensor: t, id: Some(ValueRef { tape: self.id, index }) });
        }
        inner.nodes.push(Node { op, inputs: input_ids, outputs: output_ids, region });
        Ok(values)
    }

    /// Opens a checkpoint region (a transformer block) under the tape's policy. Regions do not nest.
    pub fn begin_region(&self, name: &str) -> Result<()> {
        let policy = self.policy();
        self.begin_region_with(name, policy)
    }

    /// Opens a checkpoint region with its own policy (the budget planner mixes policies across layers).
    pub fn begin_region_with(&self, name: &str, policy: CheckpointPolicy) -> Result<()> {
        let mut inner = self.inner.borrow_mut();
        if let Some(open) = inner.open {
            return Err(Error::UnbalancedRegion {
                msg: format!(
                    "`{name}` opened while `{}` is still open; regions do not nest: call end_region first",
                    inner.regions[open].name
                ),
            });
        }
        let start = inner.nodes.len();
        inner.regions.push(Region { name: name.to_string(), policy, start, end: start, closed: false });
        inner.region_inputs.push(Vec::new());
        inner.open = Some(inner.regions.len() - 1);
        if inner.recording {
            // Where the forward is, for what this thread posts from now on (crate::progress).
            crate::progress::set_forward_mark(Some(crate::progress::ForwardMark { begun: inner.regions.len() }));
        }
        Ok(())
    }

    /// Closes the open region: the policy drops the values it does not keep.
    pub fn end_region(&self) -> Result<()> {
        let mut inner = self.inner.borrow_mut();
        let Some(r) = inner.open.take() else {
            return Err(Error::UnbalancedRegion {
                msg: "end_region called with no region open: pair every end_region with a begin_region".into(),
            });
        };
        let end = inner.nodes.len();
        inner.regions[r].end = end;
        inner.regions[r].closed = true;
        let policy = inner.regions[r].policy;
        for n in inner.regions[r].start..end {
            let kind = inner.nodes[n].op.kind();
            if policy.keeps(kind) {
                continue;
            }
            for k in 0..inner.nodes[n].outputs.len() {
                let index = inner.nodes[n].outputs[k];
                if let Some(t) = inner.values[index].tensor.take() {
                    inner.memory.untrack(&t);
                    inner.values[index].dropped = true;
                }
            }
        }
        if crate::gather_prefetch::running() {
            let read = inner.gathered_params_read(inner.regions[r].start, end);
            drop(inner);
            crate::gather_prefetch::region_ended(&read);
        }
        Ok(())
    }

    /// Runs `f` inside a checkpoint region named `name`; the region closes even when `f` fails.
    pub fn checkpoint<T>(&self, name: &str, f: impl FnOnce(&Tape) -> Result<T>) -> Result<T> {
        self.checkpoint_with(name, self.policy(), f)
    }

    /// [`checkpoint`](Self::checkpoint) with a policy of its own for this region.
    pub fn checkpoint_with<T>(
        &self,
        name: &str,
        policy: CheckpointPolicy,
        f: impl FnOnce(&Tape) -> Result<T>,
    ) -> Result<T> {
        self.begin_region_with(name, policy)?;
        let out = f(self);
        let closed = self.end_region();
        let out = out?;
        closed?;
        Ok(out)
    }

    /// Bytes held now and their peak (parameters excluded: they belong to the model).
    pub fn memory(&self) -> MemoryStats {
        self.inner.borrow().memory.stats()
    }

    /// Starts a new peak measurement.
    pub fn reset_peak(&self) {
        self.inner.borrow_mut().memory.reset_peak()
    }

    /// Starts recording the held bytes after every increase (see [`memory_trace`](Self::memory_trace)).
    pub fn trace_memory(&self) {
        self.inner.borrow_mut().memory.start_trace()
    }

    /// The held bytes after every increase since [`trace_memory`](Self::trace_memory), in order (empty if not
    /// tracing): every moment the peak can be reached. The same program on inputs of another length gives a
    /// trace of the same length whose entries are each affine in that length, so a planner can predict the
    /// peak at any length from two short steps.
    pub fn memory_trace(&self) -> Vec<usize> {
        self.inner.borrow().memory.trace()
    }

    /// Every non-parameter tensor the tape holds now.
    pub fn held(&self) -> Vec<HeldValue> {
        let inner = self.inner.borrow();
        inner
            .values
            .iter()
            .enumerate()
            .filter(|(_, v)| !matches!(v.origin, Origin::Param(_)))
            .filter_map(|(id, v)| {
                let t = v.tensor.as_ref()?;
                let node = match v.origin {
                    Origin::Node(n) => Some(&inner.nodes[n]),
                    _ => None,
                };
                Some(HeldValue {
                    id,
                    op: node.map(|n| n.op.name()),
                    kind: node.map(|n| n.op.kind()),
                    shape: t.dims().to_vec(),
                    bytes: storage_bytes(t),
                    region: v.region,
                })
            })
            .collect()
    }

    /// Whether the tape holds `v`'s tensor now.
    pub fn is_held(&self, v: &Value) -> bool {
        v.id.is_some_and(|r| r.tape == self.id && self.inner.borrow().values[r.index].tensor.is_some())
    }

    /// The number of recorded nodes.
    pub fn node_count(&self) -> usize {
        self.inner.borrow().nodes.len()
    }

    /// How many nodes backward replayed so far (recompute work done by checkpointing).
    pub fn replay_count(&self) -> usize {
        self.inner.borrow().replays
    }

    /// The accumulated gradient of a leaf (`None` if no gradient reached it). Constants have none.
    pub fn grad(&self, v: &Value) -> Result<Option<Tensor>> {
        let Some(r) = v.id else { return Ok(None) };
        if r.tape != self.id {
            return Err(Error::ForeignValue { value_tape: r.tape, tape: self.id });
        }
        let inner = self.inner.borrow();
        match inner.values[r.index].origin {
            Origin::Node(n) => Err(Error::NotALeaf { value: r.index, op: inner.nodes[n].op.name() }),
            _ => Ok(inner.leaf_grads.get(&r.index).cloned()),
        }
    }

    /// The gradients of every parameter this tape saw that got one.
    pub fn param_grads(&self) -> Gradients {
        let inner = self.inner.borrow();
        let mut grads = Gradients::new();
        for (&id, index) in &inner.params {
            if let Some(g) = inner.leaf_grads.get(index) {
                grads.insert_id(id, g.clone());
            }
        }
        grads
    }
}

impl Inner {
    pub(crate) fn push_value(&mut self, origin: Origin, t: &Tensor, requires_grad: bool) -> usize {
        self.values.push(ValueInfo {
            origin,
            region: None,
            shape: t.shape().clone(),
            dtype: t.dtype(),
            requires_grad,
            tensor: None,
            save_count: 0,
            region_uses: 0,
            dropped: false,
        });
        self.values.len() - 1
    }

    /// Holds `t` as value `index`'s tensor (if not held already).
    pub(crate) fn hold(&mut self, index: usize, t: &Tensor) {
        let v = &mut self.values[index];
        if v.tensor.is_none() {
            v.tensor = Some(t.clone());
            v.dropped = false;
            if !matches!(v.origin, Origin::Param(_)) {
                self.memory.track(t);
            }
        }
    }

    /// Releases value `index`'s tensor if nothing needs it any more.
    pub(crate) fn release_if_unused(&mut self, index: usize) {
        let v = &mut self.values[index];
        if v.save_count == 0 && v.region_uses == 0 && !matches!(v.origin, Origin::Param(_)) {
            if let Some(t) = v.tensor.take() {
                self.memory.untrack(&t);
            }
            if let Some(t) = self.replayed.remove(&index) {
                self.memory.untrack(&t);
            }
        }
    }

    /// The parameters whose gathered weights ([`crate::NodeKind::Gather`] outputs) recorded nodes
    /// `start..end` read: the weights backward may replay their gathers for.
    fn gathered_params_read(&self, start: usize, end: usize) -> Vec<ParamId> {
        let mut read = Vec::new();
        for node in &self.nodes[start..end] {
            for &i in &node.inputs {
                let Origin::Node(g) = self.values[i].origin else { continue };
                if self.nodes[g].op.kind() != NodeKind::Gather {
                    continue;
                }
                if let Some(Origin::Param(id)) = self.nodes[g].inputs.first().map(|&leaf| self.values[leaf].origin) {
                    read.push(id);
                }
            }
        }
        read
    }

    /// A node in `region` reads value `index` (tensor `t`); `saved` if its backward reads it.
    fn note_use(&mut self, index: usize, t: &Tensor, saved: bool, region: Option<usize>) {
        if saved {
            self.values[index].save_count += 1;
        }
        if let Some(r) = region {
            let v = &self.values[index];
            let from_outside = !matches!(v.origin, Origin::Node(_)) || v.region != Some(r);
            if from_outside && !self.region_inputs[r].contains(&index) {
                self.region_inputs[r].push(index);
                self.values[index].region_uses += 1;
            }
        }
        let v = &self.values[index];
        if v.save_count > 0 || v.region_uses > 0 {
            self.hold(index, t);
        }
    }
}

/// The profile's detail of an op with `inputs` ([`crate::profile`]): the second input's shape (a linear
/// layer's weight `[out, in]`, which tells its role) when it has two dimensions, else nothing.
pub(crate) fn role(inputs: &[&Tensor]) -> String {
    role_of(inputs.get(1).map(|t| t.dims()))
}

/// [`role`] from the second input's dimensions.
pub(crate) fn role_of(dims: Option<&[usize]>) -> String {
    match dims {
        Some(d) if d.len() == 2 => format!("{d:?}"),
        _ => String::new(),
    }
}
