//! Sequence layouts: which global token positions each of P ranks holds, and moving tensors between the whole
//! sequence and the shards (`shard`, `unshard`, `gather_unshard`). The tests and the compile step use these;
//! padding is the compile step's job, so lengths that do not divide are a typed error here.
//!
//! - `Contiguous`: rank r holds tokens `[r·N/P, (r+1)·N/P)`. Ulysses, non-causal Ring, and hybrid without
//!   zigzag (rank `g·u + i` of a `u × r` grid holds sub-chunk i of chunk g: the same thing).
//! - `Zigzag`: the sequence in 2P chunks `c_0 … c_{2P-1}`; rank r holds `[c_r ; c_{2P-1-r}]` (causal Ring).
//! - `HybridZigzag { u }`: P = u·r ranks, rank `(g, i) = g·u + i`; the sequence in 2r chunks, each in u
//!   sub-chunks; rank (g, i) holds `[sub_i(c_g) ; sub_i(c_{2r-1-g})]`, so the Ulysses group g gathers (with the
//!   two-halves all-to-all) exactly `[c_g ; c_{2r-1-g}]`, the zigzag shard of ring rank g.

use std::ops::Range;

use autosp_core::comm::ProcessGroup;
use candle_core::Tensor;

use super::error::SpError;

/// How a sequence is split over the ranks (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqLayout {
    /// Rank r holds tokens `[r·N/P, (r+1)·N/P)`.
    Contiguous,
    /// Rank r holds chunks r and 2P-1-r of 2P.
    Zigzag,
    /// Hybrid grid of P = u·r ranks: rank g·u+i holds sub-chunk i of chunks g and 2r-1-g of 2r.
    HybridZigzag {
        /// Ranks per Ulysses group.
        u: usize,
    },
}

impl SeqLayout {
    /// The sequence length must be a multiple of this for `p` ranks: P, or 2P for the zigzag layouts.
    pub fn multiple(&self, p: usize) -> usize {
        match self {
            SeqLayout::Contiguous => p,
            SeqLayout::Zigzag | SeqLayout::HybridZigzag { .. } => 2 * p,
        }
    }

    /// The global token ranges rank `rank` of `p` holds, in local order, for a sequence of `n` tokens.
    /// Errors when `n` is not a multiple of [`multiple`](Self::multiple), `rank >= p`, or u does not divide p.
    pub fn segments(&self, n: usize, p: usize, rank: usize) -> Result<Vec<Range<usize>>, SpError> {
        if p == 0 || rank >= p {
            return Err(SpError::Config { what: "SeqLayout", msg: format!("rank {rank} is not in 0..{p}") });
        }
        let m = self.multiple(p);
        if !n.is_multiple_of(m) {
            return Err(SpError::UnevenShards { what: "SeqLayout::segments", len: n, parts: m });
        }
        Ok(match *self {
            SeqLayout::Contiguous => {
                let s = n / p;
                vec![Range { start: rank * s, end: (rank + 1) * s }]
            }
            SeqLayout::Zigzag => {
                let c = n / (2 * p);
                let late = 2 * p - 1 - rank;
                vec![rank * c..(rank + 1) * c, late * c..(late + 1) * c]
            }
            SeqLayout::HybridZigzag { u } => {
                if u == 0 || !p.is_multiple_of(u) {
                    return Err(SpError::Config {
                        what: "SeqLayout::HybridZigzag",
                        msg: format!("the Ulysses group size u = {u} must divide the {p} ranks"),
                    });
                }
                let r = p / u;
                let (g, i) = (rank / u, rank % u);
                let (c, sub) = (n / (2 * r), n / (2 * p));
                let late = 2 * r - 1 - g;
                vec![g * c + i * sub..g * c + (i + 1) * sub, late * c + i * sub..late * c + (i + 1) * sub]
            }
        })
    }

    /// The global token positions rank `rank` holds, in local order (see [`segments`](Self::segments)).
    pub fn positions(&self, n: usize, p: usize, rank: usize) -> Result<Vec<usize>, SpError> {
        Ok(self.segments(n, p, rank)?.into_iter().flatten().collect())
    }
}

/// Rank `rank`'s shard of `x` along `dim` (the sequence dim: 1 for `[b, n, h, d]`, 2 for lse `[b, h, n]`):
/// the segments of [`SeqLayout::segments`] concatenated in local order. `x.dim(dim)` = N, the result has N/P.
pub fn shard(x: &Tensor, dim: usize, layout: SeqLayout, p: usize, rank: usize) -> autosp_core::Result<Tensor> {
    let n = x.dim(dim)?;
    let pieces = layout
        .segments(n, p, rank)?
        .into_iter()
        .map(|s| x.narrow(dim, s.start, s.len()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&pieces, dim)?)
}

/// The whole sequence back from every rank's shard: `parts[r]` is rank r's shard (all of equal length along
/// `dim`); returns the tensor with the tokens in global order, `P · parts[0].dim(dim)` long along `dim`.
pub fn unshard(parts: &[Tensor], dim: usize, layout: SeqLayout) -> autosp_core::Result<Tensor> {
    let p = parts.len();
    if p == 0 {
        return Err(SpError::Config { what: "unshard", msg: "no shards given".into() }.into());
    }
    let local = parts[0].dim(dim)?;
    let mut pieces: Vec<(usize, Tensor)> = Vec::new();
    for (rank, part) in parts.iter().enumerate() {
        if part.dim(dim)? != local {
            return Err(SpError::UnequalPieces {
                what: "unshard",
                rank,
                got: part.dims().to_vec(),
                want: parts[0].dims().to_vec(),
            }
            .into());
        }
        let mut at = 0;
        for s in layout.segments(local * p, p, rank)? {
            pieces.push((s.start, part.narrow(dim, at, s.len())?));
            at += s.len();
        }
    }
    pieces.sort_by_key(|(start, _)| *start);
    let pieces: Vec<Tensor> = pieces.into_iter().map(|(_, t)| t).collect();
    Ok(Tensor::cat(&pieces, dim)?)
}

/// [`unshard`] as a collective: all-gathers this rank's shard `x` over `group` (one `all_gather`) and returns
/// the whole sequence in global order on every rank.
pub fn gather_unshard(
    group: &dyn ProcessGroup,
    x: &Tensor,
    dim: usize,
    layout: SeqLayout,
) -> autosp_core::Result<Tensor> {
    let local = x.dim(dim)?;
    let all = group.all_gather(x, dim)?;
    let parts =
        (0..group.size()).map(|r| all.narrow(dim, r * local, local)).collect::<candle_core::Result<Vec<_>>>()?;
    unshard(&parts, dim, layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_partition_the_sequence() {
        for (layout, p) in [
            (SeqLayout::Contiguous, 3),
            (SeqLayout::Zigzag, 3),
            (SeqLayout::HybridZigzag { u: 2 }, 4),
            (SeqLayout::HybridZigzag { u: 1 }, 3),
        ] {
            let n = layout.multiple(p) * 5;
            let mut all: Vec<usize> = (0..p).flat_map(|r| layout.positions(n, p, r).unwrap()).collect();
            all.sort();
            assert_eq!(all, (0..n).collect::<Vec<_>>(), "{layout:?}");
        }
        assert_eq!(SeqLayout::Zigzag.positions(8, 2, 0).unwrap(), vec![0, 1, 6, 7]);
        // u = 2, r = 2: chunks of 4, sub-chunks of 2; rank (g=1, i=0) = 2 holds sub 0 of c1 and of c2.
        assert_eq!(SeqLayout::HybridZigzag { u: 2 }.positions(16, 4, 2).unwrap(), vec![4, 5, 8, 9]);
        assert!(matches!(SeqLayout::Zigzag.segments(10, 3, 0), Err(SpError::UnevenShards { parts: 6, .. })));
    }

    #[test]
    fn shard_then_unshard_is_the_identity() -> autosp_core::Result<()> {
        let x = Tensor::arange(0u32, 48, &candle_core::Device::Cpu)?.reshape((2, 24))?;
        for layout in [SeqLayout::Contiguous, SeqLayout::Zigzag, SeqLayout::HybridZigzag { u: 2 }] {
            let parts = (0..4).map(|r| shard(&x, 1, layout, 4, r)).collect::<autosp_core::Result<Vec<_>>>()?;
            let back = unshard(&parts, 1, layout)?;
            assert_eq!(back.to_vec2::<u32>()?, x.to_vec2::<u32>()?);
        }
        Ok(())
    }
}
