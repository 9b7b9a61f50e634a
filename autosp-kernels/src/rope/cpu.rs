//! RoPE on the CPU: one pass that reads x through its strides (a narrow or head-split view of a fused QKV
//! projection needs no transpose copy) and writes a contiguous `[b, n, h, d]` output, rows split across
//! threads, on the vector path in force. The backward is the inverse rotation by the same kernel. Inputs are
//! checked by the door (`mod.rs`).

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use autosp_core::simd::{simd_path, SimdPath};
use autosp_core::{Precision, Result};

use crate::host::{tensor_from, Host};
use crate::vector::Real;

const OP: &str = "rope (CPU)";

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
            T::rotate(path, y1, y2, x1, x2, c, s, inverse);
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
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let (hx, hc, hs) = (Host::new(OP, "x", &x)?, Host::new(OP, "cos", &cos)?, Host::new(OP, "sin", &sin)?);
    let (xs, layout) = hx.strided::<T>()?;
    let y = rotate_slices(xs, layout.start_offset(), stride, dims, hc.slice()?, hs.slice()?, inverse, simd_path());
    Ok(tensor_from(y, x.dims())?)
}

/// Rotates every `[d]` row of a checked `x: [b, n, h, d]` (`dims` from the door: `(b, n, h, d, table
/// batch)`) by the angles of `cos, sin`; `inverse` rotates by the negative angle. Contiguous output in x's
/// dtype.
pub(crate) fn rotate(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    dims: (usize, usize, usize, usize, usize),
    inverse: bool,
) -> Result<Tensor> {
    let cd = Precision::float(x.dtype()).compute();
    let (xc, cc, sc) = (x.to_dtype(cd)?, cos.to_dtype(cd)?, sin.to_dtype(cd)?);
    let y = match cd {
        DType::F64 => rotate_typed::<f64>(&xc, &cc, &sc, dims, inverse)?,
        _ => rotate_typed::<f32>(&xc, &cc, &sc, dims, inverse)?,
    };
    Ok(y.to_dtype(x.dtype())?)
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
