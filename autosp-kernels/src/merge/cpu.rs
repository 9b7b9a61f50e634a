//! The LSE merge on the CPU: a loop over the rows on host copies, in the accumulation dtype.

use candle_core::Tensor;

use crate::vector::Float;

/// `(lse, weight of a, weight of b)` for two finite LSEs, in the stable form of ALGORITHMS.md.
#[inline]
fn weights<T: Float>(a: T, b: T) -> (T, T, T) {
    let (hi, d) = if a > b { (a, a - b) } else { (b, b - a) };
    let lse = hi + (-d).exp().ln_1p();
    (lse, (a - lse).exp(), (b - lse).exp())
}

/// Merges `(o_b, lse_b)` into `(o_a, lse_a)` (`o: [b, n, h, d]`, `lse: [b, h, n]`, all in `T`): the merged
/// `(o, lse)` on `o_a`'s device.
pub(crate) fn merge<T: Float>(
    o_a: &Tensor,
    lse_a: &Tensor,
    o_b: &Tensor,
    lse_b: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (b, n, h, d) = o_a.dims4()?;
    let mut o = o_a.flatten_all()?.to_vec1::<T>()?;
    let mut lse = lse_a.flatten_all()?.to_vec1::<T>()?;
    let ob = o_b.flatten_all()?.to_vec1::<T>()?;
    let lb = lse_b.flatten_all()?.to_vec1::<T>()?;
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..n {
                let li = (bi * h + hi) * n + i;
                let (a, c) = (lse[li], lb[li]);
                let oi = ((bi * n + i) * h + hi) * d;
                if c == T::NEG_INF {
                    continue;
                }
                if a == T::NEG_INF {
                    lse[li] = c;
                    o[oi..oi + d].copy_from_slice(&ob[oi..oi + d]);
                    continue;
                }
                let (l, wa, wb) = weights(a, c);
                lse[li] = l;
                for k in oi..oi + d {
                    o[k] = wa * o[k] + wb * ob[k];
                }
            }
        }
    }
    let dev = o_a.device();
    Ok((Tensor::from_vec(o, (b, n, h, d), dev)?, Tensor::from_vec(lse, (b, h, n), dev)?))
}
