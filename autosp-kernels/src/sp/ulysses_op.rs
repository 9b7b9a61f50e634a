//! Ulysses attention as one tape op ([`UlyssesAttentionOp`], kind attention), for checkpoint regions that
//! recompute: it keeps only the local `q, k, v` (which the region regenerates) and the local `o, lse` (which
//! an attention op keeps), never the exchanged head-layout tensors. Its backward exchanges q, k, v, o and lse
//! to the head layout again, runs the inner attention op's backward there, and sends dq, dk, dv back.
//!
//! Same bits as the composed path (`ulysses.rs`): the exchanges move data without arithmetic, the inner op
//! sees the same head-layout tensors, and the gradients of replicated kv heads sum in the same rank order.
//! Communication per layer: 5 `all_to_all` forward, 10 backward (9 without dLSE); see `ulysses.rs`.

use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::ops::attention::AttentionSpec;
use autosp_core::{NodeKind, Op, SavedTensors, Saves};
use candle_core::Tensor;

use super::all_to_all::{exchange, exchange_back};
use super::ulysses::UlyssesPlans;

/// Ulysses around an inner attention op: inputs `q: [b, n, h, d]`, `k, v: [b, n, h_kv, d]` (this rank's n =
/// N/P tokens), outputs `o: [b, n, h, d]`, `lse: [b, h, n]`; saves all five.
#[derive(Debug)]
pub struct UlyssesAttentionOp {
    /// The ranks that split the heads.
    pub group: Arc<dyn ProcessGroup>,
    /// The attention on `[N tokens, H/P heads]`, one op of kind attention whose backward reads exactly its
    /// inputs `q, k, v` and outputs `o, lse` ([`autosp_core::Attention::as_op`]).
    pub inner: Arc<dyn Op>,
    /// The hybrid zigzag layout's two-halves gather (see [`super::UlyssesAttention::two_halves`]).
    pub two_halves: bool,
}

impl UlyssesAttentionOp {
    fn plans(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> autosp_core::Result<UlyssesPlans> {
        // The spec does not matter for the shape checks; the inner op holds the real one.
        let dims = AttentionSpec::full().dims("ulysses_attention", q, k, v)?;
        Ok(UlyssesPlans::new(self.group.size(), dims.heads, dims.kv_heads, dims.q_len, self.two_halves)?)
    }
}

impl Op for UlyssesAttentionOp {
    fn name(&self) -> &'static str {
        "ulysses_attention"
    }

    fn kind(&self) -> NodeKind {
        NodeKind::Attention
    }

    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1, 2]).and_outputs(&[0, 1])
    }

    fn forward(&self, inputs: &[&Tensor]) -> autosp_core::Result<Vec<Tensor>> {
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        let plans = self.plans(q, k, v)?;
        let g = &self.group;
        let heads = [
            exchange(g, q, &plans.q, "ulysses q")?,
            exchange(g, k, &plans.kv, "ulysses k")?,
            exchange(g, v, &plans.kv, "ulysses v")?,
        ];
        let out = self.inner.forward(&[&heads[0], &heads[1], &heads[2]])?;
        drop(heads);
        Ok(vec![exchange(g, &out[0], &plans.o, "ulysses o")?, exchange(g, &out[1], &plans.lse, "ulysses lse")?])
    }

    fn backward(&self, saved: &SavedTensors<'_>, grads: &[Option<Tensor>]) -> autosp_core::Result<Vec<Option<Tensor>>> {
        let (q, k, v, o, lse) = (saved.input(0)?, saved.input(1)?, saved.input(2)?, saved.output(0)?, saved.output(1)?);
        let plans = self.plans(q, k, v)?;
        let g = &self.group;
        // Everything the inner backward reads, in the head layout; every rank makes the same calls in order.
        let heads = [
            exchange(g, q, &plans.q, "ulysses q (backward)")?,
            exchange(g, k, &plans.kv, "ulysses k (backward)")?,
            exchange(g, v, &plans.kv, "ulysses v (backward)")?,
        ];
        let outs = [
            exchange(g, o, &plans.q, "ulysses o (backward)")?,
            exchange(g, lse, &plans.lse_gather, "ulysses lse (backward)")?,
        ];
        let d_o = grads[0].as_ref().map(|d| exchange(g, d, &plans.q, "ulysses dO")).transpose()?;
        let d_lse = grads[1].as_ref().map(|d| exchange(g, d, &plans.lse_gather, "ulysses dLSE")).transpose()?;
        let mut d_heads = {
            let inner_saved = SavedTensors::all(self.inner.name(), &heads, &outs);
            self.inner.backward(&inner_saved, &[d_o, d_lse])?
        };
        drop(outs);
        let head_shapes: Vec<_> = heads.iter().map(|h| (h.shape().clone(), h.dtype())).collect();
        drop(heads);
        let mut out = Vec::with_capacity(3);
        let parts = [(q, &plans.q, "ulysses dq"), (k, &plans.kv, "ulysses dk"), (v, &plans.kv, "ulysses dv")];
        for (i, (x, plan, what)) in parts.into_iter().enumerate() {
            let d = match d_heads[i].take() {
                Some(d) => d,
                None => Tensor::zeros(&head_shapes[i].0, head_shapes[i].1, x.device())?,
            };
            out.push(Some(exchange_back(g, &d, plan, x.shape(), what)?));
        }
        Ok(out)
    }
}
