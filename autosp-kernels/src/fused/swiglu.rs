//! Fused SwiGLU, `y = silu(gate) * up` with `silu(a) = a / (1 + e^-a)`: one pass forward, one pass backward
//! (which recomputes the sigmoid rather than saving it).

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use autosp_core::simd::{simd_path, SimdPath};
use autosp_core::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

use crate::dispatch::use_fast_cpu;
use crate::generic;

use super::{compute_dtype, mismatch, tensor_from, with_contiguous, Real};

pub(crate) const OP: &str = "fused_swiglu";

/// Elements per rayon task.
const TASK: usize = 16384;

/// The fused SwiGLU tape op: inputs `gate, up: [.., f]`, output `[.., f]`. Kind [`NodeKind::Elementwise`].
#[derive(Debug)]
pub struct FusedSwiGlu;

/// Checks that `gate` and `up` have one shape.
pub(crate) fn check(gate: &Tensor, up: &Tensor) -> Result<()> {
    if gate.dims() != up.dims() {
        return Err(mismatch(
            OP,
            "gate",
            gate.dims(),
            "up",
            up.dims(),
            "gate and up must have one shape [.., f]".into(),
        ));
    }
    Ok(())
}

/// Checks the backward's inputs: [`check`], and `g` of gate's shape.
pub(crate) fn check_backward(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<()> {
    check(gate, up)?;
    if g.dims() != gate.dims() {
        return Err(mismatch(
            OP,
            "grad",
            g.dims(),
            "gate",
            gate.dims(),
            "the output gradient must have gate's shape".into(),
        ));
    }
    Ok(())
}

fn forward_slices<T: Real>(a: &[T], u: &[T], path: SimdPath) -> Vec<T> {
    let mut y = vec![T::ZERO; a.len()];
    y.par_chunks_mut(TASK).zip(a.par_chunks(TASK).zip(u.par_chunks(TASK))).for_each(|(yb, (ab, ub))| {
        T::silu_mul_on(path, yb, ab, ub);
    });
    y
}

fn backward_slices<T: Real>(a: &[T], u: &[T], g: &[T], path: SimdPath) -> (Vec<T>, Vec<T>) {
    let mut da = vec![T::ZERO; a.len()];
    let mut du = vec![T::ZERO; a.len()];
    da.par_chunks_mut(TASK).zip(du.par_chunks_mut(TASK)).enumerate().for_each(|(c, (dab, dub))| {
        let r = c * TASK..(c * TASK + dab.len());
        T::swiglu_grad_on(path, dab, dub, &a[r.clone()], &u[r.clone()], &g[r]);
    });
    (da, du)
}

fn forward_typed<T: Real>(a: &Tensor, u: &Tensor) -> Result<Tensor> {
    with_contiguous(a, OP, "gate", |av: &[T]| {
        with_contiguous(u, OP, "up", |uv: &[T]| tensor_from(forward_slices(av, uv, simd_path()), a.dims()))
    })
}

fn backward_typed<T: Real>(a: &Tensor, u: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    with_contiguous(a, OP, "gate", |av: &[T]| {
        with_contiguous(u, OP, "up", |uv: &[T]| {
            with_contiguous(g, OP, "grad", |gv: &[T]| {
                let (da, du) = backward_slices(av, uv, gv, simd_path());
                Ok((tensor_from(da, a.dims())?, tensor_from(du, a.dims())?))
            })
        })
    })
}

/// SwiGLU without a tape: `gate, up: [.., f]` -> `silu(gate) * up`, `[.., f]` in gate's dtype.
pub fn swiglu_forward(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if !use_fast_cpu(gate) {
        return generic::swiglu::swiglu_forward(gate, up);
    }
    check(gate, up)?;
    let cd = compute_dtype(OP, gate.dtype())?;
    let (a, u) = (gate.to_dtype(cd)?, up.to_dtype(cd)?);
    let y = match cd {
        DType::F64 => forward_typed::<f64>(&a, &u)?,
        DType::F32 => forward_typed::<f32>(&a, &u)?,
        other => return Err(Error::Internal(format!("{OP}: compute dtype {other:?}"))),
    };
    Ok(y.to_dtype(gate.dtype())?)
}

/// SwiGLU's backward without a tape: `gate, up, g: [.., f]` (g the output's gradient) -> `(d_gate, d_up)`.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    if !use_fast_cpu(gate) {
        return generic::swiglu::swiglu_backward(gate, up, g);
    }
    check_backward(gate, up, g)?;
    let cd = compute_dtype(OP, gate.dtype())?;
    let (a, u, gc) = (gate.to_dtype(cd)?, up.to_dtype(cd)?, g.to_dtype(cd)?);
    let (da, du) = match cd {
        DType::F64 => backward_typed::<f64>(&a, &u, &gc)?,
        DType::F32 => backward_typed::<f32>(&a, &u, &gc)?,
        other => return Err(Error::Internal(format!("{OP}: compute dtype {other:?}"))),
    };
    Ok((da.to_dtype(gate.dtype())?, du.to_dtype(up.dtype())?))
}

impl Op for FusedSwiGlu {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![swiglu_forward(i[0], i[1])?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let (da, du) = swiglu_backward(s.input(0)?, s.input(1)?, g)?;
        Ok(vec![Some(da), Some(du)])
    }
}

/// Fused SwiGLU on the tape: `gate, up: [.., f]` -> `silu(gate) * up`, the same maths as
/// `ops::mul(ops::silu(gate), up)` from autosp-core in one pass.
pub fn swiglu(tape: &Tape, gate: &Value, up: &Value) -> Result<Value> {
    check(gate.tensor(), up.tensor())?;
    Ok(tape.apply(FusedSwiGlu, &[gate, up])?.remove(0))
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
