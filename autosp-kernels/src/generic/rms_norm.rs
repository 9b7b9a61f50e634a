//! RMSNorm, `y = x / sqrt(mean(x^2) + eps) * w` over the last dim, forward and backward in candle tensor ops:
//! the device-generic twin of [`crate::fused::rms_norm`], with the same contracts and the same maths (the
//! backward recomputes the reciprocal RMS unless given it).

use candle_core::{Tensor, D};

use autosp_core::{Error, Result};

use crate::fused::compute_dtype;
use crate::fused::rms_norm::{check, check_backward, OP};

/// `1 / sqrt(mean(x^2) + eps)` of each row of `x: [.., d]` (in its compute dtype) as `[.., 1]`.
fn recip_keepdim(xc: &Tensor, eps: f64) -> Result<Tensor> {
    Ok((xc.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?)
}

/// RMSNorm: `x: [.., d]`, `w: [d]` -> `[.., d]` in x's dtype (bf16/f16 computed in f32), as
/// [`crate::fused::rms_norm_forward`].
pub fn rms_norm_forward(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    check(x, w, eps)?;
    if x.elem_count() == 0 {
        return Ok(x.zeros_like()?);
    }
    let cd = compute_dtype(OP, x.dtype())?;
    let (xc, wc) = (x.to_dtype(cd)?, w.to_dtype(cd)?);
    let r = recip_keepdim(&xc, eps)?;
    Ok(xc.broadcast_mul(&r)?.broadcast_mul(&wc)?.to_dtype(x.dtype())?)
}

/// The reciprocal RMS of each row: `x: [.., d]` -> `[..]` in the compute dtype (f64 for f64, else f32), as
/// [`crate::fused::rms_norm_recip`].
pub fn rms_norm_recip(x: &Tensor, eps: f64) -> Result<Tensor> {
    if x.rank() == 0 || x.dim(D::Minus1)? == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!("x has shape {:?}; it must be [.., d] with d > 0", x.dims()),
        });
    }
    let xc = x.to_dtype(compute_dtype(OP, x.dtype())?)?;
    Ok(recip_keepdim(&xc, eps)?.squeeze(D::Minus1)?)
}

/// RMSNorm's backward: `x: [.., d]`, `w: [d]`, `g: [.., d]` (the output's gradient), optionally `recip: [..]`
/// from [`rms_norm_recip`] -> `(dx: [.., d], dw: [d])` in the dtypes of x and w, as
/// [`crate::fused::rms_norm_backward`].
pub fn rms_norm_backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    eps: f64,
    recip: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let d = check_backward(x, w, g, eps, recip)?;
    if x.elem_count() == 0 {
        return Ok((x.zeros_like()?, w.zeros_like()?));
    }
    let cd = compute_dtype(OP, x.dtype())?;
    let (xc, wc, gc) = (x.to_dtype(cd)?, w.to_dtype(cd)?, g.to_dtype(cd)?);
    let r = match recip {
        Some(r) => r.to_dtype(cd)?.unsqueeze(D::Minus1)?,
        None => recip_keepdim(&xc, eps)?,
    };
    let gw = gc.broadcast_mul(&wc)?;
    // proj = (g·w · x) r / d per row; dx = (g·w - x̂ proj) r with x̂ = x r.
    let proj = ((&gw * &xc)?.sum_keepdim(D::Minus1)? * &r)?.affine(1.0 / d as f64, 0.0)?;
    let xhat = xc.broadcast_mul(&r)?;
    let dx = (gw - xhat.broadcast_mul(&proj)?)?.broadcast_mul(&r)?;
    let dw = (gc * xhat)?.reshape(((), d))?.sum(0)?;
    Ok((dx.to_dtype(x.dtype())?, dw.to_dtype(w.dtype())?))
}
