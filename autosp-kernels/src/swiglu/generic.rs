//! SwiGLU, `y = silu(gate) * up` with `silu(a) = a / (1 + e^-a)`, forward and backward in candle tensor ops,
//! on any device: the device-generic twin of the CPU kernel (`cpu.rs`; the backward recomputes the
//! sigmoid). Inputs are checked by the door (`mod.rs`).

use candle_core::Tensor;

use autosp_core::{Precision, Result};

/// SwiGLU of checked inputs: `gate, up: [.., f]` -> `silu(gate) * up`, `[.., f]` in gate's dtype.
pub(crate) fn forward(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let cd = Precision::float(gate.dtype()).compute();
    let (a, u) = (gate.to_dtype(cd)?, up.to_dtype(cd)?);
    Ok((a.silu()? * u)?.to_dtype(gate.dtype())?)
}

/// SwiGLU's backward of checked inputs: `gate, up, g: [.., f]` (g the output's gradient) -> `(d_gate, d_up)`
/// in the dtypes of gate and up: `d_gate = g·up·s·(a·(1 - s) + 1)` with `s = sigmoid(a)`, `d_up = g·silu(a)`.
pub(crate) fn backward(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let cd = Precision::float(gate.dtype()).compute();
    let (a, u, gc) = (gate.to_dtype(cd)?, up.to_dtype(cd)?, g.to_dtype(cd)?);
    let s = (a.neg()?.exp()? + 1.0)?.recip()?;
    let da = ((&gc * &u)? * (&s * ((&a * s.affine(-1.0, 1.0)?)? + 1.0)?)?)?;
    let du = (gc * a.silu()?)?;
    Ok((da.to_dtype(gate.dtype())?, du.to_dtype(up.dtype())?))
}
