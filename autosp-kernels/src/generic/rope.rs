//! Rotary position embedding (rotate-half, as Llama in HF transformers) in candle tensor ops: the
//! device-generic twin of [`crate::fused::rope`]. x is read through its strides (candle's binary ops follow
//! any layout); the output is a contiguous `[b, n, h, d]`. The backward is the inverse rotation.

use candle_core::Tensor;

use autosp_core::Result;

use crate::fused::compute_dtype;
use crate::fused::rope::{check, OP};

/// Rotates every `[d]` row of `x: [b, n, h, d]` by the angles of `cos, sin` (`[n, d/2]` or `[b, n, d/2]`);
/// `inverse` rotates by the negative angle.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    let (_, n, _, d, tb) = check(x, cos, sin)?;
    if x.elem_count() == 0 {
        return Ok(x.zeros_like()?);
    }
    let cd = compute_dtype(OP, x.dtype())?;
    let half = d / 2;
    let xc = x.to_dtype(cd)?;
    // The tables as [tb, n, 1, d/2]: broadcast over the heads (and the batch when tb = 1).
    let table = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(cd)?.reshape((tb, n, 1, half))?) };
    let (c, s) = (table(cos)?, table(sin)?);
    let (x1, x2) = (xc.narrow(3, 0, half)?, xc.narrow(3, half, half)?);
    let (x1c, x2s) = (x1.broadcast_mul(&c)?, x2.broadcast_mul(&s)?);
    let (x2c, x1s) = (x2.broadcast_mul(&c)?, x1.broadcast_mul(&s)?);
    let (y1, y2) = if inverse { ((x1c + x2s)?, (x2c - x1s)?) } else { ((x1c - x2s)?, (x2c + x1s)?) };
    Ok(Tensor::cat(&[y1, y2], 3)?.to_dtype(x.dtype())?)
}

/// RoPE: `x: [b, n, h, d]` (any strides), `cos, sin: [n, d/2]` or `[b, n, d/2]` -> contiguous `[b, n, h, d]`
/// in x's dtype, as [`crate::fused::rope_forward`].
pub fn rope_forward(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotate(x, cos, sin, false)
}

/// RoPE's backward: the output's gradient `g: [b, n, h, d]` rotated back, `[b, n, h, d]`, as
/// [`crate::fused::rope_backward`].
pub fn rope_backward(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotate(g, cos, sin, true)
}
