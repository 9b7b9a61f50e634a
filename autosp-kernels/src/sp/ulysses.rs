//! Ulysses attention: an all-to-all turns each rank's `[N/P tokens, H heads]` into `[N tokens, H/P heads]`,
//! the inner attention (local by default) runs over the whole sequence, and the inverse all-to-all restores
//! `[N/P tokens, H heads]` (for o) and `[H heads, N/P tokens]` (for lse). Backward is the inverse exchange
//! of each all-to-all ([`AllToAllOp`](super::all_to_all::AllToAllOp)).
//!
//! Heads: query heads must divide by P. Kv heads either divide by P (rank j gets kv heads
//! `[j·H_kv/P, (j+1)·H_kv/P)`) or divide P (replicated: rank j gets kv head ⌊j·H_kv/P⌋, exactly the kv head of
//! its query heads `[j·H/P, (j+1)·H/P)`; the gradients of the copies sum back in rank order). Anything else is
//! [`SpError::UlyssesHeads`]: use Ring or hybrid.
//!
//! The spec's offsets describe the start of the whole (unsharded) sequence and go to the inner attention
//! unchanged: after the all-to-all each rank holds the whole sequence (or, in hybrid, its group's part, which
//! the inner Ring attention places itself).
//!
//! Two ways to record it on the tape:
//! - Composed (no checkpoint region, or policy None): five all-to-all ops around the inner attention. The tape
//!   keeps the exchanged q, k, v and o (collective outputs are never replayed), and backward is each
//!   exchange's inverse.
//! - Fused, inside a region that recomputes (Full, SequenceAware), when the inner attention is one op
//!   ([`Attention::as_op`]: local, Ring, naive): one [`UlyssesAttentionOp`] of kind attention that keeps only
//!   its local inputs and outputs and redoes the q, k, v and o exchanges in its backward (`ulysses_op.rs`).
//!   Per local token it holds what Ring holds, at the price of 5 more all-to-alls per layer backward, and it
//!   differentiates one chunk of heads at a time (see that file).
//!
//! Communication per layer, rank r, composed: 3 `all_to_all` before the attention (q, k, v) and 2 after
//! (o, lse); backward the same 5 (each all-to-all's inverse; the lse one only when lse has a gradient). Fused:
//! the same 5 forward; backward q, k, v, o, lse, dO and dLSE to heads and dq, dk, dv back, per head chunk
//! (`ulysses_op.rs` gives the call count), twice the forward's bytes (less one lse exchange without dLSE). With n = N/P
//! local tokens, `kvp = H_kv/P` when P divides H_kv and 1 when replicating, `s` bytes per element of q
//! (lse is f32: 4 bytes), each rank sends per forward (and per composed backward):
//!
//! ```text
//! (P-1) · b · n · ( (2·H/P + 2·kvp) · d · s  +  (H/P) · 4 )
//! ```
//! (q and o: `(P-1)·b·n·(H/P)·d·s` each; k and v: `(P-1)·b·n·kvp·d·s` each; lse: `(P-1)·b·(H/P)·n·4`).

use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::ops::attention::{apply_attention, AttentionSpec};
use autosp_core::{Attention, Op, Tape, Value};

use super::all_to_all::all_to_all;
use super::ulysses_op::UlyssesAttentionOp;
use super::ulysses_plan::UlyssesPlans;

/// Ulysses attention over `group` as an [`Attention`]: `q: [b, n, h, d]`, `k, v: [b, n, h_kv, d]`, this rank's
/// n = N/P tokens -> `(o: [b, n, h, d], lse: [b, h, n])`, the same tokens.
#[derive(Debug, Clone)]
pub struct UlyssesAttention {
    /// The ranks that split the heads.
    pub group: Arc<dyn ProcessGroup>,
    /// The attention run on `[N tokens, H/P heads]` (local by default; Ring in hybrid).
    pub inner: Arc<dyn Attention>,
    /// Gather and scatter the sequence as two halves (the hybrid zigzag layout: each rank's tokens are two
    /// sub-chunks, and the group's gathered sequence is `[all first halves ; all second halves]`).
    pub two_halves: bool,
    /// Run the fused backward in head chunks ([`UlyssesPlans::head_chunks`]; default true), so that only one
    /// chunk's head-layout tensors are alive at a time. Hybrid turns it off: its inner Ring would pass the
    /// shared k/v blocks around once per chunk.
    pub chunk_heads: bool,
}

impl UlyssesAttention {
    /// Ulysses over `group` with `inner` attention on the gathered sequence (contiguous layout).
    pub fn new(group: Arc<dyn ProcessGroup>, inner: Arc<dyn Attention>) -> Self {
        Self { group, inner, two_halves: false, chunk_heads: true }
    }
}

impl Attention for UlyssesAttention {
    fn describe(&self) -> String {
        format!("ulysses(p={}) > {}", self.group.size(), self.inner.describe())
    }

    /// Inside a checkpoint region that recomputes, and when the inner attention is one op
    /// ([`Attention::as_op`]), one [`UlyssesAttentionOp`] (kind attention: keeps only the local q, k, v, o,
    /// lse and redoes the exchanges in backward); otherwise five recorded all-to-alls around the inner
    /// attention, whose outputs the tape keeps (see the module doc for the communication of each).
    fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        if tape.region_recomputes() {
            if let Some(op) = self.as_op(spec) {
                return apply_attention(tape, op, q, k, v);
            }
        }
        let dims = spec.dims("ulysses_attention", q.tensor(), k.tensor(), v.tensor())?;
        let plans = UlyssesPlans::new(self.group.size(), dims.heads, dims.kv_heads, dims.q_len, self.two_halves)?;
        let g = &self.group;
        let q2 = all_to_all(tape, g, q, plans.q, "ulysses q")?;
        let k2 = all_to_all(tape, g, k, plans.kv.clone(), "ulysses k")?;
        let v2 = all_to_all(tape, g, v, plans.kv, "ulysses v")?;
        let (o2, lse2) = self.inner.forward(tape, &q2, &k2, &v2, spec)?;
        let o = all_to_all(tape, g, &o2, plans.o, "ulysses o")?;
        let lse = all_to_all(tape, g, &lse2, plans.lse, "ulysses lse")?;
        Ok((o, lse))
    }

    /// The whole of Ulysses as one [`UlyssesAttentionOp`], when the inner attention is one op.
    fn as_op(&self, spec: &AttentionSpec) -> Option<Arc<dyn Op>> {
        let inner = self.inner.as_op(spec)?;
        Some(Arc::new(UlyssesAttentionOp {
            group: self.group.clone(),
            inner,
            two_halves: self.two_halves,
            chunk_heads: self.chunk_heads,
        }))
    }
}
