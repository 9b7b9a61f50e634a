//! The plans of one Ulysses call, pure functions of the shapes: which heads each rank receives
//! ([`head_ranges`]), the all-to-all of each tensor ([`UlyssesPlans`]), and how the fused backward splits a
//! rank's heads into chunks ([`HeadChunks`]). `ulysses.rs` (the composed path) and `ulysses_op.rs` (the fused
//! op) both run them.

use std::ops::Range;

use super::all_to_all::{even_ranges, AllToAllPlan};
use super::error::SpError;

/// Per rank j: `(query heads, kv heads)` it receives.
pub type HeadRanges = (Vec<Range<usize>>, Vec<Range<usize>>);

/// The query-head and kv-head ranges each of `p` ranks receives, or [`SpError::UlyssesHeads`]: query heads
/// must divide by P; kv heads divide by P (split) or divide P (replicated: rank j gets kv head ⌊j·H_kv/P⌋).
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
        let (qr, kvr) = head_ranges(p, heads, kv_heads)?;
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
