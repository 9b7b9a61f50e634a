//! Ulysses attention: an all-to-all turns each rank's `[N/P tokens, H heads]` into `[N tokens, H/P heads]`,
//! the inner attention (flash by default) runs over the whole sequence, and the inverse all-to-all restores
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
//!   ([`Attention::as_op`]: flash, Ring, naive): one [`UlyssesAttentionOp`] of kind attention that keeps only
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

use std::ops::Range;
use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::ops::attention::{apply_attention, AttentionSpec};
use autosp_core::{Attention, Op, Tape, Value};

use super::all_to_all::{all_to_all, even_ranges, AllToAllPlan};
use super::error::SpError;
use super::ulysses_op::UlyssesAttentionOp;

/// Per rank j: `(query heads, kv heads)` it receives.
pub type HeadRanges = (Vec<Range<usize>>, Vec<Range<usize>>);

/// Ulysses attention over `group` as an [`Attention`]: `q: [b, n, h, d]`, `k, v: [b, n, h_kv, d]`, this rank's
/// n = N/P tokens -> `(o: [b, n, h, d], lse: [b, h, n])`, the same tokens.
#[derive(Debug, Clone)]
pub struct UlyssesAttention {
    /// The ranks that split the heads.
    pub group: Arc<dyn ProcessGroup>,
    /// The attention run on `[N tokens, H/P heads]` (flash by default; Ring in hybrid).
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

    /// The query-head and kv-head ranges each of `p` ranks receives, or [`SpError::UlyssesHeads`].
    pub fn head_ranges(p: usize, heads: usize, kv_heads: usize) -> Result<HeadRanges, SpError> {
        let err = SpError::UlyssesHeads { p, heads, kv_heads };
        if p == 0 || !heads.is_multiple_of(p) || kv_heads == 0 {
            return Err(err);
        }
        let q = even_ranges("ulysses query heads", heads, p)?;
        let kv = if kv_heads.is_multiple_of(p) {
            even_ranges("ulysses kv heads", kv_heads, p)?
        } else if p.is_multiple_of(kv_heads) {
            (0..p).map(|j| j * kv_heads / p..j * kv_heads / p + 1).collect()
        } else {
            return Err(err);
        };
        Ok((q, kv))
    }
}

/// The exchanges of one Ulysses call over P ranks, for the local shapes `q: [b, n, h, d]`,
/// `k, v: [b, n, h_kv, d]` (N = n·P tokens in all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UlyssesPlans {
    /// Sequence to heads for q (and for o and dO): `[b, n, h, d]` -> `[b, N, h/P, d]`.
    pub q: AllToAllPlan,
    /// Sequence to heads for k and v: `[b, n, h_kv, d]` -> `[b, N, kvp, d]`.
    pub kv: AllToAllPlan,
    /// Heads to sequence for o: `[b, N, h/P, d]` -> `[b, n, h, d]`.
    pub o: AllToAllPlan,
    /// Heads to sequence for lse: `[b, h/P, N]` -> `[b, h, n]`.
    pub lse: AllToAllPlan,
    /// Sequence to heads for lse (and dLSE), the inverse of `lse`: `[b, h, n]` -> `[b, h/P, N]`.
    pub lse_gather: AllToAllPlan,
}

impl UlyssesPlans {
    /// The plans for `p` ranks, `heads`/`kv_heads` heads and `n` local tokens; `two_halves` for the hybrid
    /// zigzag layout. [`SpError::UlyssesHeads`] when the heads do not split.
    pub fn new(p: usize, heads: usize, kv_heads: usize, n: usize, two_halves: bool) -> Result<Self, SpError> {
        let (qr, kvr) = UlyssesAttention::head_ranges(p, heads, kv_heads)?;
        let span = if two_halves { n * p / 2 } else { n * p };
        let seq = even_ranges("ulysses output sequence", span, p)?;
        let gather = |split_dim, ranges: Vec<Range<usize>>, cat_dim| AllToAllPlan {
            split_dim,
            ranges,
            split_halves: false,
            cat_dim,
            cat_halves: two_halves,
        };
        let scatter = |split_dim, cat_dim| AllToAllPlan {
            split_dim,
            ranges: seq.clone(),
            split_halves: two_halves,
            cat_dim,
            cat_halves: false,
        };
        Ok(Self {
            q: gather(2, qr.clone(), 1),
            kv: gather(2, kvr, 1),
            o: scatter(1, 2),
            lse: scatter(2, 1),
            lse_gather: gather(1, qr, 2),
        })
    }
}

/// How the fused backward splits each rank's heads ([`UlyssesPlans::head_chunks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadChunks {
    /// Chunks of every rank's query heads, exchanged and differentiated one after the other.
    pub chunks: usize,
    /// Each chunk takes its own kv heads (a whole GQA group each); otherwise every chunk shares the rank's
    /// kv heads, which are exchanged once and whose gradients sum over the chunks in chunk order.
    pub split_kv: bool,
}

impl HeadChunks {
    /// No chunking: all of a rank's heads at once.
    pub const WHOLE: HeadChunks = HeadChunks { chunks: 1, split_kv: false };
}

impl UlyssesPlans {
    /// The head chunks of the fused backward: one kv head (with its query heads) per chunk when the kv heads
    /// split evenly over the ranks and a rank has several; one query head per chunk when a rank has one kv
    /// head; otherwise one chunk. The backward's head-layout tensors are then a chunk's, not the rank's.
    pub fn head_chunks(&self) -> HeadChunks {
        let (hq, kvp) = (self.q.ranges[0].len(), self.kv.ranges[0].len());
        let kv_split_evenly = self.kv.ranges.windows(2).all(|w| w[0].end == w[1].start);
        if kvp > 1 && kv_split_evenly {
            HeadChunks { chunks: kvp, split_kv: true }
        } else if kvp == 1 {
            HeadChunks { chunks: hq, split_kv: false }
        } else {
            HeadChunks::WHOLE
        }
    }

    /// The plans restricted to chunk `c` of `how.chunks` of every rank's heads (the q, lse and, with
    /// `how.split_kv`, kv ranges; the output plans are unchanged).
    pub fn chunk(&self, c: usize, how: HeadChunks) -> UlyssesPlans {
        let sub = |ranges: &[Range<usize>]| -> Vec<Range<usize>> {
            ranges
                .iter()
                .map(|r| {
                    let w = r.len() / how.chunks;
                    r.start + c * w..r.start + (c + 1) * w
                })
                .collect()
        };
        let with = |plan: &AllToAllPlan, ranges| AllToAllPlan { ranges, ..plan.clone() };
        UlyssesPlans {
            q: with(&self.q, sub(&self.q.ranges)),
            kv: if how.split_kv { with(&self.kv, sub(&self.kv.ranges)) } else { self.kv.clone() },
            o: self.o.clone(),
            lse: self.lse.clone(),
            lse_gather: with(&self.lse_gather, sub(&self.lse_gather.ranges)),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_chunks_take_a_kv_group_or_a_query_head() {
        let how = |p, h, kv| UlyssesPlans::new(p, h, kv, 4, false).unwrap().head_chunks();
        // 4 query heads and 2 kv heads per rank: a kv head and its 2 query heads per chunk.
        assert_eq!(how(2, 8, 4), HeadChunks { chunks: 2, split_kv: true });
        // One kv head per rank (split or replicated): one query head per chunk, the kv head shared.
        assert_eq!(how(4, 8, 4), HeadChunks { chunks: 2, split_kv: false });
        assert_eq!(how(4, 8, 2), HeadChunks { chunks: 2, split_kv: false });
        assert_eq!(how(8, 8, 4), HeadChunks { chunks: 1, split_kv: false });
        // Chunk 1 of 2 at P = 2, 8 heads, 4 kv heads: query heads 2..4 and 6..8, kv heads 1 and 3.
        let plans = UlyssesPlans::new(2, 8, 4, 4, false).unwrap();
        let c = plans.chunk(1, how(2, 8, 4));
        assert_eq!(c.q.ranges, vec![2..4, 6..8]);
        assert_eq!(c.kv.ranges, vec![1..2, 3..4]);
        assert_eq!(c.lse_gather.ranges, vec![2..4, 6..8]);
    }
}
