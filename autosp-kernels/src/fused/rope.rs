//! Fused rotary position embedding (rotate-half, as Llama in HF transformers): one pass that reads x through
//! its strides (a narrow or head-split view of a fused QKV projection needs no transpose copy) and writes a
//! contiguous `[b, n, h, d]` output. The backward is the inverse rotation of the gradient by the same kernel.

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use autosp_core::simd::{simd_path, SimdPath};
use autosp_core::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

use crate::dispatch::use_fast_cpu;
use crate::generic;

use super::{compute_dtype, mismatch, tensor_from, with_contiguous, with_cpu_slice, Real};

pub(crate) const OP: &str = "fused_rope";

/// The fused RoPE tape op: inputs `x: [b, n, h, d]` (any strides), `cos, sin: [n, d/2]` or `[b, n, d/2]`;
/// output `[b, n, h, d]`. Kind [`NodeKind::Elementwise`].
#[derive(Debug)]
pub struct FusedRope;

/// `(b, n, h, d, table batch)` after checking the shapes.
pub(crate) fn check(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
    let &[b, n, h, d] = x.dims() else {
        return Err(mismatch(
            OP,
            "x",
            x.dims(),
            "cos",
            cos.dims(),
            "rope takes x [batch, seq, heads, head_dim]".into(),
        ));
    };
    for (name, t) in [("cos", cos), ("sin", sin)] {
        let tb = match t.dims() {
            [tn, th] if *tn == n && *th * 2 == d => 1,
            [tb, tn, th] if *tb == b && *tn == n && *th * 2 == d => b,
            _ => 0,
        };
        if tb == 0 || d % 2 != 0 {
            return Err(mismatch(
                OP,
                "x",
                x.dims(),
                name,
                t.dims(),
                "rope takes x [b, n, h, d] (d even) and cos/sin [n, d/2] or [b, n, d/2]".into(),
            ));
        }
    }
    if cos.dims() != sin.dims() {
        return Err(mismatch(OP, "cos", cos.dims(), "sin", sin.dims(), "cos and sin must have one shape".into()));
    }
    Ok((b, n, h, d, if cos.rank() == 3 { b } else { 1 }))
}

/// Rotates every `[d]` row of `x` (read at `start + bi*s0 + ni*s1 + hi*s2`, last stride 1) into a contiguous
/// output; `inverse` rotates by the negative angle (the backward).
#[allow(clippy::too_many_arguments)]
fn rotate_slices<T: Real>(
    x: &[T],
    start: usize,
    stride: [usize; 3],
    dims: (usize, usize, usize, usize, usize),
    cos: &[T],
    sin: &[T],
    inverse: bool,
    path: SimdPath,
) -> Vec<T> {
    let (b, n, h, d, tb) = dims;
    let half = d / 2;
    let mut y = vec![T::ZERO; b * n * h * d];
    y.par_chunks_mut(h * d).enumerate().for_each(|(token, yt)| {
        let (bi, ni) = (token / n, token % n);
        let t = (if tb == 1 { 0 } else { bi }) * n + ni;
        let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
        for (hi, yr) in yt.chunks_exact_mut(d).enumerate() {
            let off = start + bi * stride[0] + ni * stride[1] + hi * stride[2];
            let (x1, x2) = (&x[off..off + half], &x[off + half..off + d]);
            let (y1, y2) = yr.split_at_mut(half);
            T::rotate_on(path, y1, y2, x1, x2, c, s, inverse);
        }
    });
    y
}

fn rotate_typed<T: Real>(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    dims: (usize, usize, usize, usize, usize),
    inverse: bool,
) -> Result<Tensor> {
    // Only the last dim must be dense; other strides are followed as they are.
    let x = if x.stride()[3] == 1 || dims.3 <= 1 { x.clone() } else { x.contiguous()? };
    let st = x.stride();
    let stride = [st[0], st[1], st[2]];
    with_cpu_slice(&x, OP, "x", |xs: &[T], layout| {
        with_contiguous(cos, OP, "cos", |cs: &[T]| {
            with_contiguous(sin, OP, "sin", |ss: &[T]| {
                let y = rotate_slices(xs, layout.start_offset(), stride, dims, cs, ss, inverse, simd_path());
                tensor_from(y, x.dims())
            })
        })
    })
}

fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    let dims = check(x, cos, sin)?;
    if x.elem_count() == 0 {
        return Ok(x.zeros_like()?);
    }
    let cd = compute_dtype(OP, x.dtype())?;
    let (xc, cc, sc) = (x.to_dtype(cd)?, cos.to_dtype(cd)?, sin.to_dtype(cd)?);
    let y = match cd {
        DType::F64 => rotate_typed::<f64>(&xc, &cc, &sc, dims, inverse)?,
        DType::F32 => rotate_typed::<f32>(&xc, &cc, &sc, dims, inverse)?,
        other => return Err(Error::Internal(format!("{OP}: compute dtype {other:?}"))),
    };
    Ok(y.to_dtype(x.dtype())?)
}

/// RoPE without a tape: `x: [b, n, h, d]` (any strides; a view is read in place), `cos, sin: [n, d/2]` or
/// `[b, n, d/2]` (from [`autosp_core::ops::rope_tables`]) -> contiguous `[b, n, h, d]` in x's dtype.
pub fn rope_forward(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if !use_fast_cpu(x) {
        return generic::rope::rope_forward(x, cos, sin);
    }
    rotate(x, cos, sin, false)
}

/// RoPE's backward without a tape: the gradient `g: [b, n, h, d]` of the output rotated back, `[b, n, h, d]`.
pub fn rope_backward(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if !use_fast_cpu(g) {
        return generic::rope::rope_backward(g, cos, sin);
    }
    rotate(g, cos, sin, true)
}

impl Op for FusedRope {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![rope_forward(i[0], i[1], i[2])?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[1, 2])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 3]) };
        Ok(vec![Some(rope_backward(g, s.input(1)?, s.input(2)?)?), None, None])
    }
}

/// Fused RoPE on the tape: `x: [b, n, h, d]` (a strided view is fine), `cos, sin: [n, d/2]` or `[b, n, d/2]`
/// -> `[b, n, h, d]`; the same maths as [`autosp_core::ops::rope`]. No gradient flows to the tables.
pub fn rope(tape: &Tape, x: &Value, cos: &Value, sin: &Value) -> Result<Value> {
    check(x.tensor(), cos.tensor(), sin.tensor())?;
    Ok(tape.apply(FusedRope, &[x, cos, sin])?.remove(0))
}

#[cfg(test)]
mod tests {
    use autosp_core::simd::{supported_paths, SimdPath};

    use super::rotate_slices;

    /// Every vector path against the scalar path on f32, both directions, head_dim 36 (halves of 18: a
    /// vector and a tail) with a strided input: the same products and sums in the same order (the vector
    /// code does not fuse them), so the results are equal to the bit.
    #[test]
    fn vector_paths_match_scalar() {
        let (b, n, h, d) = (2, 5, 3, 36);
        let half = d / 2;
        let x: Vec<f32> = (0..b * n * h * d * 2).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let cos: Vec<f32> = (0..b * n * half).map(|i| ((i as f32) * 0.1).cos()).collect();
        let sin: Vec<f32> = (0..b * n * half).map(|i| ((i as f32) * 0.1).sin()).collect();
        // x viewed as [b, n, h, d] inside a [b, n, h, 2d] buffer: strides (n·h·2d, h·2d, 2d).
        let stride = [n * h * 2 * d, h * 2 * d, 2 * d];
        for inverse in [false, true] {
            let want = rotate_slices(&x, 1, stride, (b, n, h, d, b), &cos, &sin, inverse, SimdPath::Scalar);
            for p in supported_paths() {
                let got = rotate_slices(&x, 1, stride, (b, n, h, d, b), &cos, &sin, inverse, p);
                assert_eq!(got, want, "{p}, inverse {inverse}");
            }
        }
    }
}
