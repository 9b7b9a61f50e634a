//! RMSNorm on the CPU: forward and backward in one pass over each row, straight on candle's CPU slices, rows
//! split across threads with rayon, on the vector path in force. Inputs are checked by the door (`mod.rs`).

use candle_core::{DType, Tensor, D};
use rayon::prelude::*;

use autosp_core::simd::{simd_path, SimdPath};
use autosp_core::{Precision, Result};

use crate::host::{rows_per_task, tensor_from, Host};
use crate::vector::Real;

const OP: &str = "rms_norm (CPU)";

/// `1 / sqrt(mean(row^2) + eps)`.
#[inline]
fn recip_rms<T: Real>(row: &[T], eps: T, path: SimdPath) -> T {
    T::ONE / (T::dot(path, row, row) / T::from_f64(row.len() as f64) + eps).sqrt()
}

fn forward_slices<T: Real>(x: &[T], w: &[T], d: usize, eps: f64, path: SimdPath) -> Vec<T> {
    let eps = T::from_f64(eps);
    let mut y = vec![T::ZERO; x.len()];
    let step = rows_per_task(d) * d;
    y.par_chunks_mut(step).zip(x.par_chunks(step)).for_each(|(yb, xb)| {
        for (yr, xr) in yb.chunks_exact_mut(d).zip(xb.chunks_exact(d)) {
            T::scale_mul(path, yr, xr, w, recip_rms(xr, eps, path));
        }
    });
    y
}

fn recip_slices<T: Real>(x: &[T], d: usize, eps: f64, path: SimdPath) -> Vec<T> {
    let eps = T::from_f64(eps);
    x.par_chunks(d).map(|row| recip_rms(row, eps, path)).collect()
}

/// Row blocks for the weight gradient: a count that depends only on the number of rows.
fn row_blocks(rows: usize) -> usize {
    rows.div_ceil(16).clamp(1, 256)
}

/// `(dx, dw)`; `recip` (one per row) when the caller kept it, else recomputed.
#[allow(clippy::too_many_arguments)]
fn backward_slices<T: Real>(
    x: &[T],
    w: &[T],
    g: &[T],
    recip: Option<&[T]>,
    d: usize,
    eps: f64,
    path: SimdPath,
) -> (Vec<T>, Vec<T>) {
    let eps = T::from_f64(eps);
    let inv_d = T::from_f64(1.0 / d as f64);
    let rows = x.len() / d;
    let block = rows.div_ceil(row_blocks(rows)).max(1);
    let nblocks = rows.div_ceil(block);
    let mut dx = vec![T::ZERO; x.len()];
    let mut partial = vec![T::ZERO; nblocks * d];
    dx.par_chunks_mut(block * d).zip(partial.par_chunks_mut(d)).enumerate().for_each(|(b, (dxb, pw))| {
        let mut gw = vec![T::ZERO; d];
        for (i, dxr) in dxb.chunks_exact_mut(d).enumerate() {
            let row = b * block + i;
            let (xr, gr) = (&x[row * d..(row + 1) * d], &g[row * d..(row + 1) * d]);
            let r = match recip {
                Some(rs) => rs[row],
                None => recip_rms(xr, eps, path),
            };
            for ((gwv, &gv), &wv) in gw.iter_mut().zip(gr).zip(w) {
                *gwv = gv * wv;
            }
            let proj = T::dot(path, &gw, xr) * r * inv_d;
            for (((dxv, &gwv), &xv), (pv, &gv)) in dxr.iter_mut().zip(&gw).zip(xr).zip(pw.iter_mut().zip(gr)) {
                let xhat = xv * r;
                *dxv = (gwv - xhat * proj) * r;
                *pv += gv * xhat;
            }
        }
    });
    let mut dw = vec![T::ZERO; d];
    dw.par_chunks_mut(256).enumerate().for_each(|(c, out)| {
        for p in partial.chunks_exact(d) {
            for (o, &v) in out.iter_mut().zip(&p[c * 256..]) {
                *o += v;
            }
        }
    });
    (dx, dw)
}

/// The elements of `t` in the compute dtype `cd`, contiguous.
fn host_values(t: &Tensor, cd: DType) -> Result<Tensor> {
    Ok(t.to_dtype(cd)?.contiguous()?)
}

/// RMSNorm of checked inputs: `x: [.., d]`, `w: [d]` -> `[.., d]` in x's dtype.
pub(crate) fn forward(x: &Tensor, w: &Tensor, d: usize, eps: f64) -> Result<Tensor> {
    let cd = Precision::float(x.dtype()).compute();
    let (xc, wc) = (host_values(x, cd)?, host_values(w, cd)?);
    let y = match cd {
        DType::F64 => forward_typed::<f64>(&xc, &wc, d, eps)?,
        _ => forward_typed::<f32>(&xc, &wc, d, eps)?,
    };
    Ok(y.to_dtype(x.dtype())?)
}

fn forward_typed<T: Real>(x: &Tensor, w: &Tensor, d: usize, eps: f64) -> Result<Tensor> {
    let (hx, hw) = (Host::new(OP, "x", x)?, Host::new(OP, "weight", w)?);
    Ok(tensor_from(forward_slices::<T>(hx.slice()?, hw.slice()?, d, eps, simd_path()), x.shape())?)
}

/// The reciprocal RMS of each row of a checked `x: [.., d]`, `[..]` in the compute dtype.
pub(crate) fn recip(x: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let rows_shape = &x.dims()[..x.rank() - 1];
    let xc = host_values(x, Precision::float(x.dtype()).compute())?;
    let hx = Host::new(OP, "x", &xc)?;
    Ok(match xc.dtype() {
        DType::F64 => tensor_from(recip_slices::<f64>(hx.slice()?, d, eps, simd_path()), rows_shape)?,
        _ => tensor_from(recip_slices::<f32>(hx.slice()?, d, eps, simd_path()), rows_shape)?,
    })
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
    let (xc, wc, gc) = (host_values(x, cd)?, host_values(w, cd)?, host_values(g, cd)?);
    let rc = recip.map(|r| host_values(r, cd)).transpose()?;
    let (dx, dw) = match cd {
        DType::F64 => backward_typed::<f64>(&xc, &wc, &gc, rc.as_ref(), d, eps)?,
        _ => backward_typed::<f32>(&xc, &wc, &gc, rc.as_ref(), d, eps)?,
    };
    Ok((dx.to_dtype(x.dtype())?, dw.to_dtype(w.dtype())?))
}

fn backward_typed<T: Real>(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    recip: Option<&Tensor>,
    d: usize,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (hx, hw, hg) = (Host::new(OP, "x", x)?, Host::new(OP, "weight", w)?, Host::new(OP, "grad", g)?);
    let hr = recip.map(|r| Host::new(OP, "recip", r)).transpose()?;
    let rs = hr.as_ref().map(|h| h.slice::<T>()).transpose()?;
    let (dx, dw) = backward_slices::<T>(hx.slice()?, hw.slice()?, hg.slice()?, rs, d, eps, simd_path());
    Ok((tensor_from(dx, x.shape())?, tensor_from(dw, d)?))
}

#[cfg(test)]
mod tests {
    use autosp_core::simd::{supported_paths, SimdPath};

    use super::{backward_slices, forward_slices, recip_slices};

    /// Every vector path against the scalar path on f32, rows of 100 (a tail shorter than a vector): the
    /// paths differ only in the order the sums of squares and `gw · x` are added (8 lanes against 8
    /// accumulators, FMA), about 1e-7 relative per sum; 1e-5 relative to the largest value (max relative
    /// error) bounds it with margin and a wrong term would be ~1e-2.
    #[test]
    fn vector_paths_match_scalar() {
        let (rows, d) = (7, 100);
        let f = |k: usize, i: usize| ((i * 37 + k * 11) % 101) as f32 / 50.0 - 1.0;
        let x: Vec<f32> = (0..rows * d).map(|i| f(0, i)).collect();
        let w: Vec<f32> = (0..d).map(|i| 1.0 + f(1, i) / 4.0).collect();
        let g: Vec<f32> = (0..rows * d).map(|i| f(2, i)).collect();
        let rel = |x: &[f32], y: &[f32]| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
            x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
        };
        let y0 = forward_slices(&x, &w, d, 1e-6, SimdPath::Scalar);
        let r0 = recip_slices(&x, d, 1e-6, SimdPath::Scalar);
        let (dx0, dw0) = backward_slices(&x, &w, &g, None, d, 1e-6, SimdPath::Scalar);
        for p in supported_paths() {
            let y = forward_slices(&x, &w, d, 1e-6, p);
            let r = recip_slices(&x, d, 1e-6, p);
            let (dx, dw) = backward_slices(&x, &w, &g, Some(&r), d, 1e-6, p);
            for (what, a, b) in [("y", &y, &y0), ("recip", &r, &r0), ("dx", &dx, &dx0), ("dw", &dw, &dw0)] {
                let e = rel(a, b);
                assert!(e <= 1e-5, "{p}: {what} max relative error {e:e}");
            }
        }
    }
}
