//! AdamW's update in candle tensor ops, on any device (CUDA, Metal, or the CPU when the generic kernels are
//! forced): the same arithmetic as the CPU kernel in `cpu.rs`, bit for bit, with several weight-sized
//! temporaries where the CPU kernel updates in place.

use candle_core::Tensor;

use super::coefficients::Coefficients;
use crate::Result;

/// The update: `(new weights, m, v)` from the weights `wf` (f32, f64 for f64), the gradient `gf` in their
/// dtype and the moments `m`, `v`.
pub(crate) fn update(
    wf: &Tensor,
    gf: &Tensor,
    m: Tensor,
    v: Tensor,
    k: &Coefficients,
) -> Result<(Tensor, Tensor, Tensor)> {
    let m = ((m * k.beta1)? + (gf * (1.0 - k.beta1))?)?;
    let v = ((v * k.beta2)? + (gf.sqr()? * (1.0 - k.beta2))?)?;
    let update = ((&m / k.bc1)? / ((&v / k.bc2)?.sqrt()? + k.eps)?)?;
    let new = ((wf * k.decay)? - (update * k.lr)?)?;
    Ok((new, m, v))
}
