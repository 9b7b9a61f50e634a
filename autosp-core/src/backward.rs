//! Backward: walks the recorded nodes in reverse, calls each op's hand-written backward, accumulates
//! gradients into leaves, and regenerates values a checkpoint policy dropped by replaying, lazily per
//! backward node, only the nodes of their region they depend on, from the values that were kept. Saved
//! tensors are released as soon as no remaining node needs them, unless the graph is retained.

use std::collections::{HashMap, HashSet};

use candle_core::Tensor;

use crate::tape::{Inner, Origin};
use crate::{Error, Result, SavedTensors, Tape, Value};

impl Tape {
    /// Backward from a scalar value (seed 1), releasing saved tensors as it goes. A second backward on the
    /// same tape is an error; use [`backward_retained`](Self::backward_retained) for all but the last.
    pub fn backward(&self, v: &Value) -> Result<()> {
        self.backward_from(v, None, false)
    }

    /// Backward from a scalar value keeping the graph, so backward can run again (gradients accumulate).
    pub fn backward_retained(&self, v: &Value) -> Result<()> {
        self.backward_from(v, None, true)
    }

    /// Backward from any value with the seed gradient `seed` (same shape as `v`).
    pub fn backward_with_grad(&self, v: &Value, seed: &Tensor, retain: bool) -> Result<()> {
        self.backward_from(v, Some(seed), retain)
    }

    /// [`backward`](Self::backward), handing each parameter's gradient to `ready` as soon as it is final: right
    /// after backward differentiated the last node that uses the parameter (its first use in the forward
    /// pass), so a parameter used several times (tied, or in several forwards on one tape) is handed over
    /// once, with every use's contribution summed. The gradient is moved out: [`param_grads`](Self::param_grads)
    /// no longer has it. A parameter no gradient reached is not handed over. While backward runs, this
    /// thread's [`BackwardMark`](crate::progress::BackwardMark) says how far it got
    /// ([`current_mark`](crate::progress::current_mark)); `ready` is called with node `n` already counted done.
    pub fn backward_with_ready(
        &self,
        v: &Value,
        ready: &mut dyn FnMut(crate::ParamId, Tensor) -> Result<()>,
    ) -> Result<()> {
        self.backward_from_with(v, None, false, Some(ready))
    }

    fn backward_from(&self, v: &Value, seed: Option<&Tensor>, retain: bool) -> Result<()> {
        self.backward_from_with(v, seed, retain, None)
    }

    fn backward_from_with(
        &self,
        v: &Value,
        seed: Option<&Tensor>,
        retain: bool,
        mut ready: Option<&mut dyn FnMut(crate::ParamId, Tensor) -> Result<()>>,
    ) -> Result<()> {
        let mut guard = self.inner.borrow_mut();
        let inner = &mut *guard;
        if !inner.recording {
            return Err(Error::InferenceMode);
        }
        if let Some(open) = inner.open {
            return Err(Error::UnbalancedRegion {
                msg: format!(
                    "backward called while region `{}` is open: call end_region first",
                    inner.regions[open].name
                ),
            });
        }
        if inner.released {
            return Err(Error::BackwardTwice);
        }
        let Some(r) = v.id else {
            return Err(Error::InvalidArgument {
                op: "backward",
                msg: "this value does not depend on any leaf or parameter, so there is nothing to differentiate".into(),
            });
        };
        if r.tape != self.id {
            return Err(Error::ForeignValue { value_tape: r.tape, tape: self.id });
        }
        let root = r.index;
        let seed = match seed {
            Some(s) => {
                if s.shape() != &inner.values[root].shape {
                    return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                        op: "backward",
                        lhs_name: "seed gradient",
                        lhs: s.dims().to_vec(),
                        rhs_name: "value",
                        rhs: inner.values[root].shape.dims().to_vec(),
                        hint: "the seed must have the shape of the value backward starts from".into(),
                    })));
                }
                s.to_dtype(inner.values[root].dtype)?
            }
            None => {
                if inner.values[root].shape.elem_count() != 1 {
                    return Err(Error::NotScalar { shape: inner.values[root].shape.dims().to_vec() });
                }
                v.tensor.ones_like()?
            }
        };
        let mut grads: HashMap<usize, Tensor> = HashMap::new();
        inner.memory.track(&seed);
        grads.insert(root, seed);
        if let Origin::Node(last) = inner.values[root].origin {
            // For `ready`: the parameters (that take a gradient) whose first use is node n, by n.
            let mut ready_at: HashMap<usize, Vec<usize>> = HashMap::new();
            if ready.is_some() {
                let mut seen = HashSet::new();
                for n in 0..=last {
                    for &i in &inner.nodes[n].inputs {
                        let info = &inner.values[i];
                        if matches!(info.origin, Origin::Param(_)) && info.requires_grad && seen.insert(i) {
                            ready_at.entry(n).or_default().push(i);
                        }
                    }
                }
            }
            let _mark = MarkGuard::start(last + 1);
            let mut current: Option<usize> = None;
            for n in (0..=last).rev() {
                let region = inner.nodes[n].region;
                if region != current {
                    if let Some(pr) = current {
                        inner.leave_region(pr, retain);
                    }
                    current = region;
                }
                inner.backward_node(n, &mut grads, retain)?;
                crate::progress::set_mark(Some(crate::progress::BackwardMark { done: last + 1 - n, total: last + 1 }));
                // Without `ready`, nothing to look up per node.
                if let Some(ready) = ready.as_mut() {
                    for index in ready_at.remove(&n).unwrap_or_default() {
                        let Some(g) = grads.remove(&index) else { continue };
                        let g = inner.with_leaf_grad(index, g)?;
                        let Origin::Param(id) = inner.values[index].origin else { unreachable!("a parameter") };
                        ready(id, g)?;
                    }
                }
            }
            if let Some(pr) = current {
                inner.leave_region(pr, retain);
            }
        }
        for (index, g) in grads {
            if matches!(inner.values[index].origin, Origin::Param(_) | Origin::Leaf) {
                let g = inner.with_leaf_grad(index, g)?;
                inner.leaf_grads.insert(index, g);
            } else {
                inner.memory.untrack(&g);
            }
        }
        inner.clear_replayed();
        if !retain {
            inner.released = true;
            for index in 0..inner.values.len() {
                if matches!(inner.values[index].origin, Origin::Param(_)) {
                    continue;
                }
                if let Some(t) = inner.values[index].tensor.take() {
                    inner.memory.untrack(&t);
                }
            }
        }
        Ok(())
    }
}

/// Sets this thread's backward mark for the nodes of one backward pass (clearing its forward mark), and
/// clears it when the pass ends (or fails).
struct MarkGuard;

impl MarkGuard {
    fn start(total: usize) -> Self {
        // The forward is over once backward starts.
        crate::progress::set_forward_mark(None);
        crate::progress::set_mark(Some(crate::progress::BackwardMark { done: 0, total }));
        MarkGuard
    }
}

impl Drop for MarkGuard {
    fn drop(&mut self) {
        crate::progress::set_mark(None);
    }
}

impl Inner {
    /// `g`, a gradient of leaf `index` that backward computed (no longer tracked as its working memory), plus
    /// what earlier backward passes left for the leaf in `leaf_grads` (taken out).
    fn with_leaf_grad(&mut self, index: usize, g: Tensor) -> Result<Tensor> {
        self.memory.untrack(&g);
        match self.leaf_grads.remove(&index) {
            Some(cur) => Ok((cur + g)?),
            None => Ok(g),
        }
    }

    /// Differentiates node `n`: output gradients in, input gradients accumulated.
    fn backward_node(&mut self, n: usize, grads: &mut HashMap<usize, Tensor>, retain: bool) -> Result<()> {
        let op = self.nodes[n].op.clone();
        let saves = op.saves();
        let inputs = self.nodes[n].inputs.clone();
        let outputs = self.nodes[n].outputs.clone();
        let mut gouts = Vec::with_capacity(outputs.len());
        for o in &outputs {
            let g = grads.remove(o);
            if let Some(g) = &g {
                self.memory.untrack(g);
            }
            gouts.push(g);
        }
        if gouts.iter().any(Option::is_some) {
            self.regenerate_saved(n)?;
            let mut saved_in = vec![None; inputs.len()];
            for (i, &index) in inputs.iter().enumerate() {
                if saves.input(i) {
                    saved_in[i] = Some(self.fetch(index)?);
                }
            }
            let mut saved_out = vec![None; outputs.len()];
            for (j, &index) in outputs.iter().enumerate() {
                if saves.output(j) {
                    saved_out[j] = Some(self.fetch(index)?);
                }
            }
            crate::alloc::phase("backward", op.name());
            let _span = crate::profile::span("backward", op.name(), || {
                crate::tape::role_of(inputs.get(1).map(|&i| self.values[i].shape.dims()))
            });
            let gins = {
                let saved = SavedTensors {
                    op: op.name(),
                    inputs: saved_in,
                    outputs: saved_out,
                    input_meta: inputs.iter().map(|&i| (&self.values[i].shape, self.values[i].dtype)).collect(),
                    needs_grad: Some(inputs.iter().map(|&i| self.values[i].requires_grad).collect()),
                };
                op.backward(&saved, &gouts)?
            };
            if gins.len() != inputs.len() {
                return Err(Error::Internal(format!(
                    "{}: backward returned {} gradients for {} inputs",
                    op.name(),
                    gins.len(),
                    inputs.len()
                )));
            }
            for (g, &index) in gins.into_iter().zip(&inputs) {
                let Some(g) = g else { continue };
                let info = &self.values[index];
                if !info.requires_grad {
                    continue;
                }
                if g.shape() != &info.shape {
                    return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                        op: op.name(),
                        lhs_name: "gradient",
                        lhs: g.dims().to_vec(),
                        rhs_name: "input",
                        rhs: info.shape.dims().to_vec(),
                        hint: "the op's backward returned a gradient of the wrong shape".into(),
                    })));
                }
                let g = match grads.remove(&index) {
                    Some(cur) => {
                        self.memory.untrack(&cur);
                        (cur + g)?
                    }
                    None => g,
                };
                self.memory.track(&g);
                grads.insert(index, g);
            }
        }
        if !retain {
            for (i, &index) in inputs.iter().enumerate() {
                if saves.input(i) {
                    self.values[index].save_count -= 1;
                    self.release_if_unused(index);
                }
            }
            for (j, &index) in outputs.iter().enumerate() {
                if saves.output(j) {
                    self.values[index].save_count -= 1;
                    self.release_if_unused(index);
                }
            }
        }
        Ok(())
    }

    /// Backward has finished region `r`: its inputs may go, and so may what was replayed for it.
    fn leave_region(&mut self, r: usize, retain: bool) {
        if self.replay_region == Some(r) {
            self.clear_replayed();
        }
        if !retain {
            for index in self.region_inputs[r].clone() {
                self.values[index].region_uses -= 1;
                self.release_if_unused(index);
            }
        }
    }

    fn clear_replayed(&mut self) {
        for (_, t) in self.replayed.drain() {
            self.memory.untrack(&t);
        }
        self.replay_region = None;
    }

    fn available(&self, index: usize) -> bool {
        self.values[index].tensor.is_some() || self.replayed.contains_key(&index)
    }

    /// Regenerates, in one replay per region, the values node `n`'s backward reads that a policy dropped.
    fn regenerate_saved(&mut self, n: usize) -> Result<()> {
        let saves = self.nodes[n].op.saves();
        let node = &self.nodes[n];
        let ins = node.inputs.iter().enumerate().filter(|(i, _)| saves.input(*i));
        let outs = node.outputs.iter().enumerate().filter(|(j, _)| saves.output(*j));
        let mut missing: Vec<(usize, usize)> = Vec::new();
        for (_, &index) in ins.chain(outs) {
            let info = &self.values[index];
            if let (false, true, Some(r)) = (self.available(index), info.dropped, info.region) {
                missing.push((r, index));
            }
        }
        missing.sort_unstable();
        missing.dedup();
        let mut regions: Vec<usize> = missing.iter().map(|&(r, _)| r).collect();
        regions.dedup();
        for r in regions {
            let targets: Vec<usize> = missing.iter().filter(|&&(mr, _)| mr == r).map(|&(_, i)| i).collect();
            self.replay(r, &targets)?;
        }
        Ok(())
    }

    /// The tensor of value `index`: held, or regenerated by [`Inner::regenerate_saved`] for this node.
    fn fetch(&self, index: usize) -> Result<Tensor> {
        if let Some(t) = &self.values[index].tensor {
            return Ok(t.clone());
        }
        self.replayed.get(&index).cloned().ok_or_else(|| {
            Error::Internal(format!("value #{index} is needed by backward but was neither held nor regenerated"))
        })
    }

    /// Replays the nodes of region `r` that `targets` (dropped values) depend on, and no others. Besides the
    /// targets it keeps every output of a replayed node that a later backward still reads, including outputs
    /// no target depends on (an attention's `lse` when its `o` was the target), so a node whose outputs
    /// backward reads is not replayed again for them; values only other replayed nodes read (scratch) go when
    /// it returns. Regenerating lazily, per
    /// backward node, means a block's MLP part and attention part are never regenerated at the same time.
    fn replay(&mut self, r: usize, targets: &[usize]) -> Result<()> {
        if self.replay_region != Some(r) {
            self.clear_replayed();
            self.replay_region = Some(r);
        }
        let (start, end) = (self.regions[r].start, self.regions[r].end);
        let mut needed: HashSet<usize> = targets.iter().copied().filter(|&i| !self.available(i)).collect();
        let mut run = vec![false; end - start];
        for n in (start..end).rev() {
            if self.nodes[n].outputs.iter().any(|o| needed.contains(o)) {
                run[n - start] = true;
                for &i in &self.nodes[n].inputs {
                    if !self.available(i) {
                        needed.insert(i);
                    }
                }
            }
        }
        // Values computed only as inputs of later replayed nodes; dropped when the replay ends.
        let mut scratch: HashMap<usize, Tensor> = HashMap::new();
        for n in start..end {
            if !run[n - start] {
                continue;
            }
            let op = self.nodes[n].op.clone();
            let policy = self.regions[r].policy;
            if !policy.may_replay(op.kind()) {
                return Err(Error::Internal(format!(
                    "policy {:?} must never replay `{}` ({:?}), but its output was not kept",
                    policy,
                    op.name(),
                    op.kind()
                )));
            }
            let mut tensors = Vec::with_capacity(self.nodes[n].inputs.len());
            for &i in &self.nodes[n].inputs {
                let t = self.values[i]
                    .tensor
                    .clone()
                    .or_else(|| self.replayed.get(&i).cloned())
                    .or_else(|| scratch.get(&i).cloned());
                tensors.push(t.ok_or_else(|| {
                    Error::Internal(format!("replaying `{}` in region {r}: input #{i} is not available", op.name()))
                })?);
            }
            let refs: Vec<&Tensor> = tensors.iter().collect();
            crate::alloc::phase("replay", op.name());
            let outs = {
                let _span = crate::profile::span("replay", op.name(), || crate::tape::role(&refs));
                op.forward(&refs)?
            };
            drop(tensors);
            self.replays += 1;
            for (t, &index) in outs.into_iter().zip(&self.nodes[n].outputs.clone()) {
                if self.available(index) {
                    continue;
                }
                // Every output a later backward reads is kept, needed now or not: an attention replayed for
                // its `o` keeps its `lse` too, so its own backward does not replay it (and its collectives)
                // a second time.
                let read_later = self.values[index].save_count > 0;
                if !needed.contains(&index) && !read_later {
                    continue;
                }
                self.memory.track(&t);
                if targets.contains(&index) || read_later {
                    self.replayed.insert(index, t);
                } else {
                    scratch.insert(index, t);
                }
            }
        }
        for (_, t) in scratch {
            self.memory.untrack(&t);
        }
        Ok(())
    }
}
