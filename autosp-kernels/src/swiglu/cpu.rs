//! SwiGLU on the CPU, `y = silu(gate) * up`: one pass forward, one pass backward (which recomputes the
//! sigmoid rather than saving it), straight on candle's CPU slices, split across threads, on the vector path
//! in force. Inputs are checked by the door (`mod.rs`).

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use autosp_core::simd::{simd_path, SimdPath};
use autosp_core::{Precision, Result};

use crate::host::{tensor_from, Host};
use crate::vector::Real;

const OP: &str = "swiglu (CPU)";

/// Elements per rayon task.
const TASK: usize = 16384;

fn forward_slices<T: Real>(a: &[T], u: &[T], path: SimdPath) -> Vec<T> {
    let mut y = vec![T::ZERO; a.len()];
    y.par_chunks_mut(TASK).zip(a.par_chunks(TASK).zip(u.par_chunks(TASK))).for_each(|(yb, (ab, ub))| {
        T::silu_mul(path, yb, ab, ub);
    });
    y
}

fn backward_slices<T: Real>(a: &[T], u: &[T], g: &[T], path: SimdPath) -> (Vec<T>, Vec<T>) {
    let mut da = vec![T::ZERO; a.len()];
    let mut du = vec![T::ZERO; a.len()];
    da.par_chunks_mut(TASK).zip(du.par_chunks_mut(TASK)).enumerate().for_each(|(c, (dab, dub))| {
        let r = c * TASK..(c * TASK + dab.len());
        T::swiglu_grad(path, dab, dub, &a[r.clone()], &u[r.clone()], &g[r]);
    });
    (da, du)
}

/// SwiGLU of checked inputs: `gate, up: [.., f]` -> `silu(gate) * up` in gate's dtype.
pub(crate) fn forward(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let cd = Precision::float(gate.dtype()).compute();
    let (a, u) = (gate.to_dtype(cd)?.contiguous()?, up.to_dtype(cd)?.contiguous()?);
    let y = match cd {
        DType::F64 => forward_typed::<f64>(&a, &u)?,
        _ => forward_typed::<f32>(&a, &u)?,
    };
    Ok(y.to_dtype(gate.dtype())?)
}

fn forward_typed<T: Real>(a: &Tensor, u: &Tensor) -> Result<Tensor> {
    let (ha, hu) = (Host::new(OP, "gate", a)?, Host::new(OP, "up", u)?);
    Ok(tensor_from(forward_slices::<T>(ha.slice()?, hu.slice()?, simd_path()), a.dims())?)
}

/// SwiGLU's backward of checked inputs: `(d_gate, d_up)` in the dtypes of gate and up.
pub(crate) fn backward(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let cd = Precision::float(gate.dtype()).compute();
    let c = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(cd)?.contiguous()?) };
    let (a, u, gc) = (c(gate)?, c(up)?, c(g)?);
    let (da, du) = match cd {
        DType::F64 => backward_typed::<f64>(&a, &u, &gc)?,
        _ => backward_typed::<f32>(&a, &u, &gc)?,
    };
    Ok((da.to_dtype(gate.dtype())?, du.to_dtype(up.dtype())?))
}

fn backward_typed<T: Real>(a: &Tensor, u: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    let (ha, hu, hg) = (Host::new(OP, "gate", a)?, Host::new(OP, "up", u)?, Host::new(OP, "grad", g)?);
    let (da, du) = backward_slices::<T>(ha.slice()?, hu.slice()?, hg.slice()?, simd_path());
    Ok((tensor_from(da, a.dims())?, tensor_from(du, a.dims())?))
}

#[cfg(test)]
mod tests {
    use autosp_core::simd::{supported_paths, SimdPath};

    use super::{backward_slices, forward_slices};

    /// Every vector path against the scalar path on f32: the vector `e^x` is within ~2 ulp of libm's and
    /// the rest is the same arithmetic, so 1e-6 relative to the largest value (max relative error, over
    /// inputs in [-12, 12] and a tail shorter than a vector) bounds it with margin; a wrong formula would be
    /// off by ~1e-1.
    #[test]
    fn vector_paths_match_scalar() {
        let n = 1000 + 5;
        let f = |k: usize, i: usize| ((i * 37 + k * 11) % 97) as f32 / 4.0 - 12.0;
        let (a, u, g): (Vec<f32>, Vec<f32>, Vec<f32>) = (
            (0..n).map(|i| f(0, i)).collect(),
            (0..n).map(|i| f(1, i) / 6.0).collect(),
            (0..n).map(|i| f(2, i) / 6.0).collect(),
        );
        let rel = |x: &[f32], y: &[f32]| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
            x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
        };
        let y0 = forward_slices(&a, &u, SimdPath::Scalar);
        let (da0, du0) = backward_slices(&a, &u, &g, SimdPath::Scalar);
        for p in supported_paths() {
            let y = forward_slices(&a, &u, p);
            let (da, du) = backward_slices(&a, &u, &g, p);
            for (what, x, y) in [("y", &y, &y0), ("da", &da, &da0), ("du", &du, &du0)] {
                let e = rel(x, y);
                assert!(e <= 1e-6, "{p}: {what} max relative error {e:e}");
            }
        }
    }
}
