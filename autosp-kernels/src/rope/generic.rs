//! Rotary position embedding (rotate-half, as Llama in HF transformers) in candle tensor ops, on any device:
//! the device-generic twin of the CPU kernel (`cpu.rs`). x is read through its strides (candle's binary ops
//! follow any layout); the output is a contiguous `[b, n, h, d]`. The backward is the inverse rotation.
//! Inputs are checked by the door (`mod.rs`).

use candle_core::Tensor;

use autosp_core::{Precision, Result};

/// Rotates every `[d]` row of a checked `x: [b, n, h, d]` (`dims` from the door: `(b, n, h, d, table
/// batch)`) by the angles of `cos, sin` (`[n, d/2]` or `[b, n, d/2]`); `inverse` rotates by the negative
/// angle.
pub(crate) fn rotate(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    dims: (usize, usize, usize, usize, usize),
    inverse: bool,
) -> Result<Tensor> {
    let (_, n, _, d, tb) = dims;
    let cd = Precision::float(x.dtype()).compute();
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
