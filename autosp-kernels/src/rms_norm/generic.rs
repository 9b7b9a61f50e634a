//! RMSNorm forward and backward in candle tensor ops, on any device: the device-generic twin of the CPU
//! kernel (`cpu.rs`), with the same contracts and the same maths (the backward recomputes the reciprocal RMS
//! unless given it). Inputs are checked by the door (`mod.rs`).

use candle_core::{Tensor, D};

use autosp_core::{Precision, Result};

/// `1 / sqrt(mean(x^2) + eps)` of each row of `x: [.., d]` (in its compute dtype) as `[.., 1]`.
fn recip_keepdim(xc: &Tensor, eps: f64) -> Result<Tensor> {
    Ok((xc.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?)
}

/// RMSNorm of checked inputs: `x: [.., d]`, `w: [d]` -> `[.., d]` in x's dtype.
pub(crate) fn forward(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let cd = Precision::float(x.dtype()).compute();
    let (xc, wc) = (x.to_dtype(cd)?, w.to_dtype(cd)?);
    let r = recip_keepdim(&xc, eps)?;
    Ok(xc.broadcast_mul(&r)?.broadcast_mul(&wc)?.to_dtype(x.dtype())?)
}

/// The reciprocal RMS of each row of a checked `x: [.., d]`, `[..]` in the compute dtype.
pub(crate) fn recip(x: &Tensor, eps: f64) -> Result<Tensor> {
    let xc = x.to_dtype(Precision::float(x.dtype()).compute())?;
    Ok(recip_keepdim(&xc, eps)?.squeeze(D::Minus1)?)
}

/// RMSNorm's backward of checked inputs: `(dx: [.., d], dw: [d])` in the dtypes of x and w.
pub(crate) fn backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    recip: Option<&Tensor>,
    d: usize,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let cd = Precision::float(x.dtype()).compute();
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
