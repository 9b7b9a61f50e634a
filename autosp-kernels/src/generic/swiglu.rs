//! SwiGLU, `y = silu(gate) * up` with `silu(a) = a / (1 + e^-a)`, forward and backward in candle tensor ops:
//! the device-generic twin of [`crate::fused::swiglu`] (the backward recomputes the sigmoid).

use candle_core::Tensor;

use autosp_core::Result;

use crate::fused::compute_dtype;
use crate::fused::swiglu::{check, check_backward, OP};

/// SwiGLU: `gate, up: [.., f]` -> `silu(gate) * up`, `[.., f]` in gate's dtype, as
/// [`crate::fused::swiglu_forward`].
pub fn swiglu_forward(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check(gate, up)?;
    let cd = compute_dtype(OP, gate.dtype())?;
    let (a, u) = (gate.to_dtype(cd)?, up.to_dtype(cd)?);
    Ok((a.silu()? * u)?.to_dtype(gate.dtype())?)
}

/// SwiGLU's backward: `gate, up, g: [.., f]` (g the output's gradient) -> `(d_gate, d_up)` in the dtypes of
/// gate and up, as [`crate::fused::swiglu_backward`]:
/// `d_gate = g·up·s·(a·(1 - s) + 1)` with `s = sigmoid(a)`, `d_up = g·silu(a)`.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    check_backward(gate, up, g)?;
    let cd = compute_dtype(OP, gate.dtype())?;
    let (a, u, gc) = (gate.to_dtype(cd)?, up.to_dtype(cd)?, g.to_dtype(cd)?);
    let s = (a.neg()?.exp()? + 1.0)?.recip()?;
    let da = ((&gc * &u)? * (&s * ((&a * s.affine(-1.0, 1.0)?)? + 1.0)?)?)?;
    let du = (gc * a.silu()?)?;
    Ok((da.to_dtype(gate.dtype())?, du.to_dtype(up.dtype())?))
}
