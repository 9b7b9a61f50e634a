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
//! Communication per layer, rank r: 3 `all_to_all` before the attention (q, k, v) and 2 after (o, lse);
//! backward the same 5 (each all-to-all's inverse; the lse one only when lse has a gradient). With n = N/P
//! local tokens, `kvp = H_kv/P` when P divides H_kv and 1 when replicating, `s` bytes per element of q
//! (lse is f32: 4 bytes), each rank sends, forward and again backward:
//!
//! ```text
//! (P-1) · b · n · ( (2·H/P + 2·kvp) · d · s  +  (H/P) · 4 )
//! ```
//! (q and o: `(P-1)·b·n·(H/P)·d·s` each; k and v: `(P-1)·b·n·kvp·d·s` each; lse: `(P-1)·b·(H/P)·n·4`).

use std::ops::Range;
use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::ops::attention::AttentionSpec;
use autosp_core::{Attention, Tape, Value};

use super::all_to_all::{all_to_all, even_ranges, AllToAllPlan};
use super::error::SpError;

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
}

impl UlyssesAttention {
    /// Ulysses over `group` with `inner` attention on the gathered sequence (contiguous layout).
    pub fn new(group: Arc<dyn ProcessGroup>, inner: Arc<dyn Attention>) -> Self {
        Self { group, inner, two_halves: false }
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

impl Attention for UlyssesAttention {
    fn describe(&self) -> String {
        format!("ulysses(p={}) > {}", self.group.size(), self.inner.describe())
    }

    fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        let dims = spec.dims("ulysses_attention", q.tensor(), k.tensor(), v.tensor())?;
        let p = self.group.size();
        let (qr, kvr) = Self::head_ranges(p, dims.heads, dims.kv_heads)?;
        let gather = |ranges: Vec<Range<usize>>| AllToAllPlan {
            split_dim: 2,
            ranges,
            split_halves: false,
            cat_dim: 1,
            cat_halves: self.two_halves,
        };
        let g = &self.group;
        let q2 = all_to_all(tape, g, q, gather(qr), "ulysses q")?;
        let k2 = all_to_all(tape, g, k, gather(kvr.clone()), "ulysses k")?;
        let v2 = all_to_all(tape, g, v, gather(kvr), "ulysses v")?;
        let (o2, lse2) = self.inner.forward(tape, &q2, &k2, &v2, spec)?;
        let n_all = o2.dims()[1];
        let span = if self.two_halves { n_all / 2 } else { n_all };
        let seq = even_ranges("ulysses output sequence", span, p)?;
        let scatter = |split_dim, cat_dim| AllToAllPlan {
            split_dim,
            ranges: seq.clone(),
            split_halves: self.two_halves,
            cat_dim,
            cat_halves: false,
        };
        let o = all_to_all(tape, g, &o2, scatter(1, 2), "ulysses o")?;
        let lse = all_to_all(tape, g, &lse2, scatter(2, 1), "ulysses lse")?;
        Ok((o, lse))
    }
}
