//! Parameters and their gradients. A [`Param`] is a named, shared, replaceable tensor owned by a model; the
//! optimiser swaps in updated tensors. [`Gradients`] maps parameters to their gradients after backward.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use candle_core::Tensor;

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
}

/// A trainable tensor. Clones share it: a model and its optimiser see the same parameter.
#[derive(Clone, Debug)]
pub struct Param(Arc<ParamInner>);

impl Param {
    /// A new parameter named `name` (use the checkpoint's tensor name, e.g. `model.layers.0.mlp.up_proj.weight`).
    pub fn new(name: impl Into<String>, tensor: Tensor) -> Self {
        let id = ParamId(NEXT_PARAM.fetch_add(1, Ordering::Relaxed));
        Self(Arc::new(ParamInner { id, name: name.into(), tensor: RwLock::new(tensor) }))
    }

    /// Its identity.
    pub fn id(&self) -> ParamId {
        self.0.id
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The current tensor (a cheap handle clone).
    pub fn tensor(&self) -> Tensor {
        self.0.tensor.read().expect("param lock poisoned").clone()
    }

    /// Replaces the tensor; shape and dtype must stay the same.
    pub fn set(&self, t: Tensor) -> Result<()> {
        let mut cur = self.0.tensor.write().expect("param lock poisoned");
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
