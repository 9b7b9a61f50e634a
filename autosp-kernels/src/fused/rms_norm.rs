//! Fused RMSNorm, `y = x / sqrt(mean(x^2) + eps) * w` over the last dim, forward and backward in one pass over
//! each row. The backward recomputes the reciprocal RMS of a row while the row is in cache (measured as cheap as
//! reading a saved one, see docs/BENCHMARKS.md), so the op saves only its inputs; a caller that kept the
//! reciprocals can pass them to [`rms_norm_backward`]. The weight gradient is summed over fixed row blocks in
//! block order, so it is the same bits whatever the thread count.

use candle_core::{DType, Tensor, D};
use rayon::prelude::*;

use autosp_core::simd::{simd_path, SimdPath};
use autosp_core::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

use crate::dispatch::use_fast_cpu;
use crate::generic;

use super::{compute_dtype, mismatch, rows_per_task, tensor_from, with_contiguous, Real};

pub(crate) const OP: &str = "fused_rms_norm";

/// The fused RMSNorm tape op: inputs `x: [.., d]` and `w: [d]`, output `[.., d]`. Kind [`NodeKind::Norm`].
#[derive(Debug)]
pub struct FusedRmsNorm {
    /// Added to the mean square before the square root.
    pub eps: f64,
}

/// `d` after checking `x: [.., d]`, `w: [d]` and `eps`.
pub(crate) fn check(x: &Tensor, w: &Tensor, eps: f64) -> Result<usize> {
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidArgument { op: OP, msg: format!("eps must be finite and >= 0, got {eps}") });
    }
    if x.rank() == 0 {
        return Err(mismatch(OP, "x", x.dims(), "weight", w.dims(), "x must be [.., d] with rank >= 1".into()));
    }
    let d = x.dim(D::Minus1)?;
    if w.dims() != [d] {
        return Err(mismatch(
            OP,
            "x",
            x.dims(),
            "weight",
            w.dims(),
            format!("the weight must be [{d}], the last dim of x"),
        ));
    }
    Ok(d)
}

/// `d` after checking the backward's inputs: [`check`], `g` of x's shape, `recip` of x's shape without the
/// last dim.
pub(crate) fn check_backward(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64, recip: Option<&Tensor>) -> Result<usize> {
    let d = check(x, w, eps)?;
    if g.dims() != x.dims() {
        return Err(mismatch(OP, "grad", g.dims(), "x", x.dims(), "the output gradient must have x's shape".into()));
    }
    if let Some(r) = recip {
        if r.dims() != &x.dims()[..x.rank() - 1] {
            return Err(mismatch(
                OP,
                "recip",
                r.dims(),
                "x",
                x.dims(),
                "recip must be x's shape without the last dim".into(),
            ));
        }
    }
    Ok(d)
}

/// `1 / sqrt(mean(row^2) + eps)`.
#[inline]
fn recip_rms<T: Real>(row: &[T], eps: T, path: SimdPath) -> T {
    T::ONE / (T::dot_on(path, row, row) / T::from_f64(row.len() as f64) + eps).sqrt()
}

fn forward_slices<T: Real>(x: &[T], w: &[T], d: usize, eps: f64, path: SimdPath) -> Vec<T> {
    let eps = T::from_f64(eps);
    let mut y = vec![T::ZERO; x.len()];
    let step = rows_per_task(d) * d;
    y.par_chunks_mut(step).zip(x.par_chunks(step)).for_each(|(yb, xb)| {
        for (yr, xr) in yb.chunks_exact_mut(d).zip(xb.chunks_exact(d)) {
            T::scale_mul_on(path, yr, xr, w, recip_rms(xr, eps, path));
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
            let proj = T::dot_on(path, &gw, xr) * r * inv_d;
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

fn forward_typed<T: Real>(x: &Tensor, w: &Tensor, d: usize, eps: f64) -> Result<Tensor> {
    with_contiguous(x, OP, "x", |xs: &[T]| {
        with_contiguous(w, OP, "weight", |ws: &[T]| tensor_from(forward_slices(xs, ws, d, eps, simd_path()), x.shape()))
    })
}

fn backward_typed<T: Real>(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    recip: Option<&Tensor>,
    d: usize,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    with_contiguous(x, OP, "x", |xs: &[T]| {
        with_contiguous(w, OP, "weight", |ws: &[T]| {
            with_contiguous(g, OP, "grad", |gs: &[T]| {
                let (dx, dw) = match recip {
                    Some(r) => with_contiguous(r, OP, "recip", |rs: &[T]| {
                        Ok(backward_slices(xs, ws, gs, Some(rs), d, eps, simd_path()))
                    })?,
                    None => backward_slices(xs, ws, gs, None, d, eps, simd_path()),
                };
                Ok((tensor_from(dx, x.shape())?, tensor_from(dw, d)?))
            })
        })
    })
}

/// RMSNorm without a tape: `x: [.., d]`, `w: [d]` -> `[.., d]` in x's dtype (bf16/f16 computed in f32).
pub fn rms_norm_forward(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if !use_fast_cpu(x) {
        return generic::rms_norm::rms_norm_forward(x, w, eps);
    }
    let d = check(x, w, eps)?;
    if x.elem_count() == 0 {
        return Ok(x.zeros_like()?);
    }
    let cd = compute_dtype(OP, x.dtype())?;
    let (xc, wc) = (x.to_dtype(cd)?, w.to_dtype(cd)?);
    let y = match cd {
        DType::F64 => forward_typed::<f64>(&xc, &wc, d, eps)?,
        _ => forward_typed::<f32>(&xc, &wc, d, eps)?,
    };
    Ok(y.to_dtype(x.dtype())?)
}

/// The reciprocal RMS of each row, `1 / sqrt(mean(x^2) + eps)`: `x: [.., d]` -> `[..]` in the compute dtype
/// (f64 for f64, else f32). Pass it to [`rms_norm_backward`] to skip recomputing it.
pub fn rms_norm_recip(x: &Tensor, eps: f64) -> Result<Tensor> {
    if !use_fast_cpu(x) {
        return generic::rms_norm::rms_norm_recip(x, eps);
    }
    if x.rank() == 0 || x.dim(D::Minus1)? == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!("x has shape {:?}; it must be [.., d] with d > 0", x.dims()),
        });
    }
    let d = x.dim(D::Minus1)?;
    let rows_shape = &x.dims()[..x.rank() - 1];
    let xc = x.to_dtype(compute_dtype(OP, x.dtype())?)?;
    match xc.dtype() {
        DType::F64 => {
            with_contiguous(&xc, OP, "x", |xs: &[f64]| tensor_from(recip_slices(xs, d, eps, simd_path()), rows_shape))
        }
        _ => with_contiguous(&xc, OP, "x", |xs: &[f32]| tensor_from(recip_slices(xs, d, eps, simd_path()), rows_shape)),
    }
}

/// RMSNorm's backward without a tape: `x: [.., d]`, `w: [d]`, `g: [.., d]` (the output's gradient), and
/// optionally `recip: [..]` from [`rms_norm_recip`]. Returns `(dx: [.., d], dw: [d])` in the dtypes of x and w.
pub fn rms_norm_backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    eps: f64,
    recip: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    if !use_fast_cpu(x) {
        return generic::rms_norm::rms_norm_backward(x, w, g, eps, recip);
    }
    let d = check_backward(x, w, g, eps, recip)?;
    if x.elem_count() == 0 {
        return Ok((x.zeros_like()?, w.zeros_like()?));
    }
    let cd = compute_dtype(OP, x.dtype())?;
    let (xc, wc, gc) = (x.to_dtype(cd)?, w.to_dtype(cd)?, g.to_dtype(cd)?);
    let rc = recip.map(|r| r.to_dtype(cd)).transpose()?;
    let (dx, dw) = match cd {
        DType::F64 => backward_typed::<f64>(&xc, &wc, &gc, rc.as_ref(), d, eps)?,
        _ => backward_typed::<f32>(&xc, &wc, &gc, rc.as_ref(), d, eps)?,
    };
    Ok((dx.to_dtype(x.dtype())?, dw.to_dtype(w.dtype())?))
}

impl Op for FusedRmsNorm {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Norm
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![rms_norm_forward(i[0], i[1], self.eps)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let (dx, dw) = rms_norm_backward(s.input(0)?, s.input(1)?, g, self.eps, None)?;
        Ok(vec![Some(dx), Some(dw)])
    }
}

/// Fused RMSNorm on the tape: `x: [.., d]`, `w: [d]` -> `[.., d]`; the same maths as
/// [`autosp_core::ops::rms_norm`], one pass over memory.
pub fn rms_norm(tape: &Tape, x: &Value, w: &Value, eps: f64) -> Result<Value> {
    check(x.tensor(), w.tensor(), eps)?;
    Ok(tape.apply(FusedRmsNorm { eps }, &[x, w])?.remove(0))
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
