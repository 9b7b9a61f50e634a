//! Ulysses attention as one tape op ([`UlyssesAttentionOp`], kind attention), for checkpoint regions that
//! recompute: it keeps only the local `q, k, v` (which the region regenerates) and the local `o, lse` (which
//! an attention op keeps), never the exchanged head-layout tensors. Its backward exchanges q, k, v, o, lse
//! and dO to the head layout again, runs the inner attention op's backward there, and sends dq, dk, dv back,
//! one chunk of heads at a time ([`UlyssesPlans::head_chunks`]: a kv head and its query heads, or one query
//! head when a rank has one kv head), so only one chunk's head-layout tensors and inner buffers are alive.
//!
//! Results: the forward gives the composed path's bits (`ulysses.rs`). The backward runs the inner op on
//! fewer heads per call; heads are independent, but the CPU attention kernel's key-tile split depends on the number
//! of kv heads in a call, so dq, dk, dv may differ from the composed path's in the last bits; with shared kv
//! heads their gradients are also summed over the chunks. The tests hold both paths to the single-rank
//! kernel's results at Ulysses's tolerance.
//!
//! Communication per layer: 5 `all_to_all` forward. Backward, C chunks, with dLSE: `10·C` when each chunk
//! has its own kv heads, `6·C + 4` when they share the rank's kv heads (k, v out and dk, dv back once); the
//! bytes are twice the forward's either way (the same tensors, cut by heads).

use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::ops::attention::AttentionSpec;
use autosp_core::{NodeKind, Op, SavedTensors, Saves};
use candle_core::Tensor;

use super::all_to_all::{exchange, exchange_back, return_pieces};
use super::ulysses_plan::{HeadChunks, UlyssesPlans};
use crate::running_sum::add_to;

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
    /// Differentiate in head chunks (see [`super::UlyssesAttention::chunk_heads`]).
    pub chunk_heads: bool,
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
        let how = if self.chunk_heads { plans.head_chunks() } else { HeadChunks::WHOLE };
        let g = &self.group;
        // Kv heads every chunk shares are exchanged once; their gradients sum over the chunks in order.
        let shared = if how.split_kv {
            None
        } else {
            Some((
                exchange(g, k, &plans.kv, "ulysses k (backward)")?,
                exchange(g, v, &plans.kv, "ulysses v (backward)")?,
            ))
        };
        let (mut dk_sum, mut dv_sum) = (None, None);
        // Per chunk, the gradient pieces back from each rank: `[b, n, heads of the chunk on rank j, d]`.
        let (mut dq_parts, mut dk_parts, mut dv_parts) = (Vec::new(), Vec::new(), Vec::new());
        for c in 0..how.chunks {
            let pc = plans.chunk(c, how);
            // Everything the inner backward reads, in the head layout; every rank makes the same calls in order.
            autosp_core::alloc::phase("backward", "ulysses_attention: exchanges to heads");
            let (k2, v2) = match &shared {
                Some((k2, v2)) => (k2.clone(), v2.clone()),
                None => {
                    (exchange(g, k, &pc.kv, "ulysses k (backward)")?, exchange(g, v, &pc.kv, "ulysses v (backward)")?)
                }
            };
            let heads = [exchange(g, q, &pc.q, "ulysses q (backward)")?, k2, v2];
            let outs = [
                exchange(g, o, &pc.q, "ulysses o (backward)")?,
                exchange(g, lse, &pc.lse_gather, "ulysses lse (backward)")?,
            ];
            let d_o = grads[0].as_ref().map(|d| exchange(g, d, &pc.q, "ulysses dO")).transpose()?;
            let d_lse = grads[1].as_ref().map(|d| exchange(g, d, &pc.lse_gather, "ulysses dLSE")).transpose()?;
            autosp_core::alloc::phase("backward", "ulysses_attention: inner backward");
            let mut d = {
                let inner_saved = SavedTensors::all(self.inner.name(), &heads, &outs);
                self.inner.backward(&inner_saved, &[d_o, d_lse])?
            };
            drop(outs);
            let mut take = |i: usize| -> autosp_core::Result<Tensor> {
                Ok(match d[i].take() {
                    Some(d) => d,
                    None => heads[i].zeros_like()?,
                })
            };
            let (dq2, dk2, dv2) = (take(0)?, take(1)?, take(2)?);
            drop(heads);
            autosp_core::alloc::phase("backward", "ulysses_attention: exchanges back");
            // This rank's own piece comes back as a view of the chunk's gradient: copy it, so the chunk's
            // head-layout gradient is freed now and not held until the end.
            let back = |d2: Tensor, plan| -> autosp_core::Result<Vec<Tensor>> {
                let mut pieces = return_pieces(g, &d2, plan)?;
                pieces[g.rank()] = pieces[g.rank()].force_contiguous()?;
                Ok(pieces)
            };
            dq_parts.push(back(dq2, &pc.q)?);
            if how.split_kv {
                dk_parts.push(back(dk2, &pc.kv)?);
                dv_parts.push(back(dv2, &pc.kv)?);
            } else {
                add_to(&mut dk_sum, dk2)?;
                add_to(&mut dv_sum, dv2)?;
            }
        }
        drop(shared);
        let p = g.size();
        // Rank j's heads come first, chunk by chunk within them: the local head order.
        let assemble = |parts: Vec<Vec<Tensor>>| -> candle_core::Result<Tensor> {
            let ordered: Vec<Tensor> = (0..p).flat_map(|j| parts.iter().map(move |chunk| chunk[j].clone())).collect();
            Tensor::cat(&ordered, 2)
        };
        let dq = assemble(dq_parts)?;
        let (dk, dv) = if how.split_kv {
            (assemble(dk_parts)?, assemble(dv_parts)?)
        } else {
            let sum =
                |s: Option<Tensor>| s.ok_or_else(|| autosp_core::Error::Internal("ulysses: no head chunk".into()));
            (
                exchange_back(g, &sum(dk_sum)?, &plans.kv, k.shape(), "ulysses dk")?,
                exchange_back(g, &sum(dv_sum)?, &plans.kv, v.shape(), "ulysses dv")?,
            )
        };
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    }
}
