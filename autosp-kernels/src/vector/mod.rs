//! The shared vector code of the CPU kernels: [`Real`], the float types they compute in (f32, f64) with every
//! row and tile operation they run, each on the [`SimdPath`] it is given. f32 runs the hand-written AVX-512
//! kernels (`avx512.rs`; the attention tile product and softmax rows) where the path is AVX-512, the pulp
//! kernels (`pulp.rs`; AVX2+FMA and NEON from one source) otherwise, and the portable loops (`portable.rs`,
//! the reference) on the scalar path and for tails; f64 always runs the portable loops. The flash forward's
//! online-softmax step over a score tile ([`Real::online_softmax`]) is one fused pulp call on AVX2 and NEON
//! and the row operations one row at a time elsewhere.
//!
//! The tile product `C[m × n] (+)= A[m × k] · B[k × n]` reads A through any (row, column) strides (so `Pᵀ`
//! and `dSᵀ` need no transpose copy), B row-major with row stride `ldb` and contiguous columns, C row-major
//! with row stride `ldc`. Every attention product fits this form: `S = Q Kᵀ` (B = packed Kᵀ), `O += P V`,
//! `dV += Pᵀ dO`, `dP = dO Vᵀ` (B = packed Vᵀ), `dQ += dS K`, `dK += dSᵀ Q`.

#[cfg(target_arch = "x86_64")]
mod avx512;
mod float;
mod online_softmax;
mod portable;
mod pulp;

pub(crate) use float::Float;
use online_softmax::{online_softmax_with, RowOps};

use autosp_core::simd::SimdPath;

/// A float the CPU kernels compute in, with its row and tile operations on a vector path. The defaults are
/// the portable loops (f64's path); f32 overrides each with its vector kernels.
pub(crate) trait Real: Float {
    /// `C[m × n] = A[m × k] · B[k × n]`, or `C += A · B` when `accumulate` (see the module doc for the
    /// strides).
    ///
    /// # Safety
    /// All pointers valid for the elements the strides address.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    unsafe fn gemm(
        _path: SimdPath,
        accumulate: bool,
        m: usize,
        n: usize,
        k: usize,
        a: *const Self,
        a_rs: usize,
        a_cs: usize,
        b: *const Self,
        ldb: usize,
        c: *mut Self,
        ldc: usize,
    ) {
        portable::gemm(accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc)
    }

    /// In place `x = 2^(x · mul - sub)`; returns the sum.
    fn exp2_row(_path: SimdPath, x: &mut [Self], mul: Self, sub: Self) -> Self {
        portable::exp2_row(x, mul, sub)
    }

    /// The largest element of `x`: -inf for an empty or all -inf row, NaN when any element is NaN.
    fn max_row(_path: SimdPath, x: &[Self]) -> Self {
        portable::max_row(x)
    }

    /// One online-softmax step of the flash forward (ALGORITHMS.md, log2 domain) over the score rows of `s`
    /// (`m.len()` rows of `ld` scores, hidden ones -inf): for row r with `mx = c · max(row)` and
    /// `m' = max(m[r], mx)`, the row becomes `2^(c · s - m')`, `acc[r] *= 2^(m[r] - m')` (`acc: [rows, d]`),
    /// `l[r] = l[r] · 2^(m[r] - m') + sum(row)` and `m[r] = m'`; a row with no visible score becomes 0 and
    /// leaves its state as it was. A NaN score makes the row's state NaN.
    #[allow(clippy::too_many_arguments)]
    fn online_softmax(
        path: SimdPath,
        s: &mut [Self],
        ld: usize,
        c: Self,
        m: &mut [Self],
        l: &mut [Self],
        acc: &mut [Self],
        d: usize,
    ) {
        online_softmax_rows(path, s, ld, c, m, l, acc, d)
    }

    /// In place `ds = p ∘ (ds - delta)` (equal lengths).
    fn ds_row(_path: SimdPath, ds: &mut [Self], p: &[Self], delta: Self) {
        portable::ds_row(ds, p, delta)
    }

    /// [`Real::exp2_row`] on every row of the `[sub.len(), ld]` tile `x`: row r becomes `2^(x · mul - sub[r])`.
    fn exp2_tile(path: SimdPath, x: &mut [Self], ld: usize, mul: Self, sub: &[Self]) {
        exp2_rows(path, x, ld, mul, sub)
    }

    /// [`Real::ds_row`] on every row of the `[delta.len(), ld]` tiles `ds` and `p`.
    fn ds_tile(path: SimdPath, ds: &mut [Self], p: &[Self], ld: usize, delta: &[Self]) {
        ds_rows(path, ds, p, ld, delta)
    }

    /// In place `x *= a`.
    fn scale_row(_path: SimdPath, x: &mut [Self], a: Self) {
        portable::scale_row(x, a)
    }

    /// `sum(a[i] · b[i])` (equal lengths).
    fn dot(_path: SimdPath, a: &[Self], b: &[Self]) -> Self {
        portable::dot(a, b)
    }

    /// [`Real::dot`] of every row of `a: [m, d]` with every row of `b: [n, d]` (row stride `d` both):
    /// `out[i · ld + j] = a_i · b_j` (`out: [m, ld]`, `ld >= n`; the columns past `n` untouched), each sum
    /// `dot`'s to the bit.
    fn dots(path: SimdPath, a: &[Self], b: &[Self], d: usize, out: &mut [Self], ld: usize) {
        dot_rows(path, a, b, d, out, ld)
    }

    /// `sum(e^(x[i] - m))`.
    fn exp_sum_row(_path: SimdPath, x: &[Self], m: Self) -> Self {
        portable::exp_sum_row(x, m)
    }

    /// In place `x[i] = e^(x[i] - m)`; returns their sum.
    fn exp_row(_path: SimdPath, x: &mut [Self], m: Self) -> Self {
        portable::exp_row(x, m)
    }

    /// RoPE on one row's halves (all of one length): `y1 = x1 c - x2 s`, `y2 = x2 c + x1 s`; with `inverse`
    /// (the backward) the negative angle.
    #[allow(clippy::too_many_arguments)]
    fn rotate(
        _path: SimdPath,
        y1: &mut [Self],
        y2: &mut [Self],
        x1: &[Self],
        x2: &[Self],
        c: &[Self],
        s: &[Self],
        inverse: bool,
    ) {
        portable::rotate(y1, y2, x1, x2, c, s, inverse)
    }

    /// `y[i] = x[i] · r · w[i]` (equal lengths).
    fn scale_mul(_path: SimdPath, y: &mut [Self], x: &[Self], w: &[Self], r: Self) {
        portable::scale_mul(y, x, w, r)
    }

    /// `y = silu(a) · u` (equal lengths).
    fn silu_mul(_path: SimdPath, y: &mut [Self], a: &[Self], u: &[Self]) {
        portable::silu_mul(y, a, u)
    }

    /// SwiGLU's backward: `da = g · u · σ(a) · (1 + a (1 - σ(a)))`, `du = g · silu(a)` (equal lengths).
    fn swiglu_grad(_path: SimdPath, da: &mut [Self], du: &mut [Self], a: &[Self], u: &[Self], g: &[Self]) {
        portable::swiglu_grad(da, du, a, u, g)
    }
}

impl Real for f64 {}

/// [`Real::online_softmax`] from the row operations, one row at a time (f64, the scalar path, AVX-512).
#[allow(clippy::too_many_arguments)]
fn online_softmax_rows<T: Real>(
    path: SimdPath,
    s: &mut [T],
    ld: usize,
    c: T,
    m: &mut [T],
    l: &mut [T],
    acc: &mut [T],
    d: usize,
) {
    let rows =
        RowOps { max: |x: &[T]| T::max_row(path, x), exp2: |x: &mut [T], mul, sub| T::exp2_row(path, x, mul, sub) };
    online_softmax_with(s, ld, c, m, l, acc, d, rows, |x, a| T::scale_row(path, x, a));
}

/// [`Real::exp2_row`] on every row of the `[sub.len(), ld]` tile `x` (the default [`Real::exp2_tile`], and
/// f32's where no fused kernel runs).
fn exp2_rows<T: Real>(path: SimdPath, x: &mut [T], ld: usize, mul: T, sub: &[T]) {
    for (row, &s) in x.chunks_exact_mut(ld).zip(sub) {
        T::exp2_row(path, row, mul, s);
    }
}

/// [`Real::dot`] of each pair of rows, one call per pair (the default [`Real::dots`], and f32's where no
/// batched kernel runs).
fn dot_rows<T: Real>(path: SimdPath, a: &[T], b: &[T], d: usize, out: &mut [T], ld: usize) {
    for (j, br) in b.chunks_exact(d).enumerate() {
        for (i, ar) in a.chunks_exact(d).enumerate() {
            out[i * ld + j] = T::dot(path, ar, br);
        }
    }
}

/// [`Real::ds_row`] on every row of the `[delta.len(), ld]` tiles (the default [`Real::ds_tile`], and f32's
/// where no fused kernel runs).
fn ds_rows<T: Real>(path: SimdPath, ds: &mut [T], p: &[T], ld: usize, delta: &[T]) {
    for ((row, p), &dl) in ds.chunks_exact_mut(ld).zip(p.chunks_exact(ld)).zip(delta) {
        T::ds_row(path, row, p, dl);
    }
}

/// Whether f32's fused pulp kernels (one dispatch per tile) may run on `path`: not where the AVX-512 kernels
/// do, which keep their own row kernels one row at a time.
#[inline]
fn pulp_fused(path: SimdPath) -> bool {
    #[cfg(target_arch = "x86_64")]
    return !avx512(path);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = path;
        true
    }
}

/// Whether the AVX-512 kernels run on `path` (the path asks for them and the CPU has them).
#[cfg(target_arch = "x86_64")]
#[inline]
fn avx512(path: SimdPath) -> bool {
    path == SimdPath::Avx512 && path.is_supported()
}

impl Real for f32 {
    #[inline]
    unsafe fn gemm(
        path: SimdPath,
        accumulate: bool,
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        a_rs: usize,
        a_cs: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        if avx512(path) {
            return avx512::gemm(accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc);
        }
        if pulp::gemm(path, accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc).is_none() {
            portable::gemm(accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc)
        }
    }

    #[inline]
    fn exp2_row(path: SimdPath, x: &mut [f32], mul: f32, sub: f32) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if avx512(path) && x.len().is_multiple_of(16) {
            // SAFETY: the features were detected and the length checked.
            return unsafe { avx512::exp2_row(x, mul, sub) };
        }
        pulp::exp2_row(path, x, mul, sub).unwrap_or_else(|| portable::exp2_row(x, mul, sub))
    }

    #[inline]
    fn max_row(path: SimdPath, x: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if avx512(path) && x.len().is_multiple_of(16) {
            // SAFETY: the features were detected and the length checked.
            return unsafe { avx512::max_row(x) };
        }
        pulp::max_row(path, x).unwrap_or_else(|| portable::max_row(x))
    }

    fn online_softmax(
        path: SimdPath,
        s: &mut [f32],
        ld: usize,
        c: f32,
        m: &mut [f32],
        l: &mut [f32],
        acc: &mut [f32],
        d: usize,
    ) {
        if !pulp_fused(path) || pulp::online_softmax(path, s, ld, c, m, l, acc, d).is_none() {
            online_softmax_rows(path, s, ld, c, m, l, acc, d)
        }
    }

    #[inline]
    fn ds_row(path: SimdPath, ds: &mut [f32], p: &[f32], delta: f32) {
        #[cfg(target_arch = "x86_64")]
        if avx512(path) && ds.len() == p.len() && ds.len().is_multiple_of(16) {
            // SAFETY: the features were detected and the lengths checked.
            return unsafe { avx512::ds_row(ds, p, delta) };
        }
        if pulp::ds_row(path, ds, p, delta).is_none() {
            portable::ds_row(ds, p, delta)
        }
    }

    fn exp2_tile(path: SimdPath, x: &mut [f32], ld: usize, mul: f32, sub: &[f32]) {
        if !pulp_fused(path) || pulp::exp2_tile(path, x, ld, mul, sub).is_none() {
            exp2_rows(path, x, ld, mul, sub)
        }
    }

    fn ds_tile(path: SimdPath, ds: &mut [f32], p: &[f32], ld: usize, delta: &[f32]) {
        if !pulp_fused(path) || pulp::ds_tile(path, ds, p, ld, delta).is_none() {
            ds_rows(path, ds, p, ld, delta)
        }
    }

    #[inline]
    fn scale_row(path: SimdPath, x: &mut [f32], a: f32) {
        #[cfg(target_arch = "x86_64")]
        if avx512(path) {
            // SAFETY: the features were detected.
            return unsafe { avx512::scale_row(x, a) };
        }
        if pulp::scale_row(path, x, a).is_none() {
            portable::scale_row(x, a)
        }
    }

    fn dot(path: SimdPath, a: &[f32], b: &[f32]) -> f32 {
        pulp::dot(path, a, b).unwrap_or_else(|| portable::dot(a, b))
    }

    fn dots(path: SimdPath, a: &[f32], b: &[f32], d: usize, out: &mut [f32], ld: usize) {
        if pulp::dots(path, a, b, d, out, ld).is_none() {
            dot_rows(path, a, b, d, out, ld)
        }
    }

    fn exp_sum_row(path: SimdPath, x: &[f32], m: f32) -> f32 {
        pulp::exp_sum_row(path, x, m).unwrap_or_else(|| portable::exp_sum_row(x, m))
    }

    fn exp_row(path: SimdPath, x: &mut [f32], m: f32) -> f32 {
        if let Some(sum) = pulp::exp_row(path, x, m) {
            return sum;
        }
        portable::exp_row(x, m)
    }

    fn rotate(
        path: SimdPath,
        y1: &mut [f32],
        y2: &mut [f32],
        x1: &[f32],
        x2: &[f32],
        c: &[f32],
        s: &[f32],
        inverse: bool,
    ) {
        if pulp::rotate(path, y1, y2, x1, x2, c, s, inverse).is_none() {
            portable::rotate(y1, y2, x1, x2, c, s, inverse)
        }
    }

    fn scale_mul(path: SimdPath, y: &mut [f32], x: &[f32], w: &[f32], r: f32) {
        if pulp::scale_mul(path, y, x, w, r).is_none() {
            portable::scale_mul(y, x, w, r)
        }
    }

    fn silu_mul(path: SimdPath, y: &mut [f32], a: &[f32], u: &[f32]) {
        if pulp::silu_mul(path, y, a, u).is_none() {
            portable::silu_mul(y, a, u)
        }
    }

    fn swiglu_grad(path: SimdPath, da: &mut [f32], du: &mut [f32], a: &[f32], u: &[f32], g: &[f32]) {
        if pulp::swiglu_grad(path, da, du, a, u, g).is_none() {
            portable::swiglu_grad(da, du, a, u, g)
        }
    }
}

#[cfg(test)]
mod tests {
    use autosp_core::simd::supported_paths;

    use super::*;
    use autosp_core::simd::SimdPath;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The vector paths this CPU runs (the scalar path is the reference they are compared with).
    fn vector_paths() -> Vec<SimdPath> {
        supported_paths().into_iter().filter(|&p| p != SimdPath::Scalar).collect()
    }

    /// Every vector path's gemm equals the portable one, accumulating or not, for every block shape and tail
    /// (to f32 rounding: the sums over k run in the same order, but FMA rounds once where the portable code
    /// may round twice, hence 1e-5 · (1 + |x|) with |entries| <= 1 and k <= 64).
    #[test]
    fn vector_gemm_matches_portable() {
        let mut seed = 7;
        let shapes = [(1, 1, 1), (7, 17, 5), (13, 64, 64), (64, 80, 33), (6, 128, 9), (5, 200, 3), (9, 23, 4)];
        for path in vector_paths() {
            for (&(m, n, k), accumulate) in shapes.iter().flat_map(|s| [(s, true), (s, false)]) {
                for &(a_rs, a_cs) in &[(k, 1), (1, m)] {
                    let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
                    let ldb = n + 3;
                    let b: Vec<f32> = (0..k * ldb).map(|_| lcg(&mut seed)).collect();
                    let c0: Vec<f32> = (0..m * n).map(|_| lcg(&mut seed)).collect();
                    let mut c1 = c0.clone();
                    // Without accumulation C's old contents (here NaN) must not matter.
                    let mut c2 = if accumulate { c0.clone() } else { vec![f32::NAN; m * n] };
                    unsafe {
                        portable::gemm(
                            accumulate,
                            m,
                            n,
                            k,
                            a.as_ptr(),
                            a_rs,
                            a_cs,
                            b.as_ptr(),
                            ldb,
                            c1.as_mut_ptr(),
                            n,
                        );
                        f32::gemm(
                            path,
                            accumulate,
                            m,
                            n,
                            k,
                            a.as_ptr(),
                            a_rs,
                            a_cs,
                            b.as_ptr(),
                            ldb,
                            c2.as_mut_ptr(),
                            n,
                        );
                    }
                    for (x, y) in c1.iter().zip(&c2) {
                        assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{path} m={m} n={n} k={k}: {x} vs {y}");
                    }
                }
            }
        }
    }

    /// Every vector path's exp2 is within 2e-7 relative of f64's (the polynomial's 1.9e-9 plus f32 rounding
    /// of the argument and result), exactly 0 for -inf and very negative input, NaN for NaN; the row sum
    /// matches; lengths that are not a multiple of the vector take the scalar tail.
    #[test]
    fn vector_exp2_is_accurate() {
        for path in vector_paths() {
            let mut xs: Vec<f32> = (0..4096).map(|i| -100.0 + i as f32 * 0.0271).collect();
            xs.extend([f32::NEG_INFINITY, -1e30, -300.0, -126.0, 0.0, -0.5, 0.5, 3.0, f32::NAN, -7.25, -2.0]);
            let mut ys = xs.clone();
            let sum = f32::exp2_row(path, &mut ys, 1.0, 0.0);
            let mut want_sum = 0.0f64;
            for (&x, &y) in xs.iter().zip(&ys) {
                let want = (x as f64).exp2();
                if x.is_nan() {
                    assert!(y.is_nan(), "{path}: 2^NaN must be NaN, got {y}");
                    continue;
                }
                want_sum += want;
                if x < -150.0 {
                    assert_eq!(y, 0.0, "{path}: 2^{x}");
                } else if want > 1e-37 {
                    assert!(((y as f64) - want).abs() <= 2e-7 * want, "{path}: 2^{x}: {y} vs {want}");
                }
            }
            assert!(sum.is_nan(), "{path}: a NaN element makes the sum NaN");
            // Without the NaN: the sum to f32 accumulation error (4k terms, relative 1e-5).
            let mut zs: Vec<f32> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
            let s = f32::exp2_row(path, &mut zs, 1.0, 0.0) as f64;
            assert!((s - want_sum).abs() <= 1e-5 * want_sum, "{path}: sum {s} vs {want_sum}");
            // mul and sub: 2^(x · 0.5 - 1).
            let mut w = vec![2.0f32; 35];
            f32::exp2_row(path, &mut w, 0.5, 1.0);
            assert!(w.iter().all(|&v| (v - 1.0).abs() <= 2e-7), "{path}: {w:?}");
        }
    }

    /// The fused online-softmax step equals the row operations run one by one on the same path, bit for bit
    /// (the same operations in the same order), over several steps: rows whose maximum rises, stays or falls,
    /// rows with no visible score (-inf) and a NaN row, whole vectors and a tail.
    #[test]
    fn fused_online_softmax_equals_its_rows() {
        let mut seed = 11;
        for path in vector_paths() {
            for (rows, ld, d) in [(7, 64, 16), (5, 19, 9)] {
                let (mut m1, mut l1) = (vec![f32::NEG_INFINITY; rows], vec![0.0f32; rows]);
                let (mut m2, mut l2) = (m1.clone(), l1.clone());
                let mut acc1: Vec<f32> = (0..rows * d).map(|_| lcg(&mut seed)).collect();
                let mut acc2 = acc1.clone();
                for step in 0..4 {
                    let mut s1: Vec<f32> = (0..rows * ld).map(|_| lcg(&mut seed) * (3 - step) as f32 * 4.0).collect();
                    s1[ld..2 * ld].fill(f32::NEG_INFINITY);
                    if step == 3 {
                        s1[2 * ld + 1] = f32::NAN;
                    }
                    let mut s2 = s1.clone();
                    f32::online_softmax(path, &mut s1, ld, 0.7, &mut m1, &mut l1, &mut acc1, d);
                    online_softmax_rows(path, &mut s2, ld, 0.7, &mut m2, &mut l2, &mut acc2, d);
                    // Bit for bit, or NaN in both (a NaN's payload is not compared).
                    let same = |a: &[f32], b: &[f32]| {
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
                    };
                    assert!(same(&s1, &s2) && same(&m1, &m2) && same(&l1, &l2), "{path} {rows}x{ld} step {step}");
                    assert!(same(&acc1, &acc2), "{path} {rows}x{ld} step {step}: acc");
                }
                assert!(m1[2].is_nan() && l1[2].is_nan() && acc1[2 * d].is_nan(), "{path}: NaN row");
            }
        }
    }

    /// The tile forms of the backward's row operations (one dispatch per tile on AVX2/NEON) give the bits of
    /// the row operations run row by row, on every path, with a row stride that is and one that is not a
    /// multiple of the vector width (tails) and -inf entries (masked scores).
    #[test]
    fn tile_row_operations_equal_their_rows() {
        let mut seed = 5;
        for path in supported_paths() {
            for (rows, ld) in [(6, 64), (3, 21)] {
                let mut x: Vec<f32> = (0..rows * ld).map(|_| lcg(&mut seed) * 8.0).collect();
                x[ld + 2] = f32::NEG_INFINITY;
                let sub: Vec<f32> = (0..rows).map(|_| lcg(&mut seed) * 4.0 + 4.0).collect();
                let (mut tile, mut by_row) = (x.clone(), x.clone());
                f32::exp2_tile(path, &mut tile, ld, 0.9, &sub);
                for (row, &sb) in by_row.chunks_exact_mut(ld).zip(&sub) {
                    f32::exp2_row(path, row, 0.9, sb);
                }
                assert!(tile.iter().zip(&by_row).all(|(a, b)| a.to_bits() == b.to_bits()), "{path} exp2 {rows}x{ld}");
                let delta: Vec<f32> = (0..rows).map(|_| lcg(&mut seed)).collect();
                let mut ds: Vec<f32> = (0..rows * ld).map(|_| lcg(&mut seed)).collect();
                let mut ds_rows = ds.clone();
                f32::ds_tile(path, &mut ds, &tile, ld, &delta);
                for ((row, p), &dl) in ds_rows.chunks_exact_mut(ld).zip(tile.chunks_exact(ld)).zip(&delta) {
                    f32::ds_row(path, row, p, dl);
                }
                assert!(ds.iter().zip(&ds_rows).all(|(a, b)| a.to_bits() == b.to_bits()), "{path} ds {rows}x{ld}");
            }
        }
    }

    /// Every vector path's max, ds and scale rows equal the portable formulas exactly (no rounding
    /// differs: max is exact, ds and scale do the same operations), including NaN and -inf rows and tails.
    #[test]
    fn vector_rows_match_portable() {
        let mut seed = 3;
        for path in vector_paths() {
            for len in [1, 7, 16, 64, 67] {
                let x: Vec<f32> = (0..len).map(|_| lcg(&mut seed) * 10.0).collect();
                let want = x.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
                assert_eq!(f32::max_row(path, &x), want, "{path} len {len}");
                assert_eq!(f32::max_row(path, &vec![f32::NEG_INFINITY; len]), f32::NEG_INFINITY, "{path}");
                for at in [0, len / 2, len - 1] {
                    let mut y = x.clone();
                    y[at] = f32::NAN;
                    assert!(f32::max_row(path, &y).is_nan(), "{path} len {len}: NaN at {at}");
                }
                let p: Vec<f32> = (0..len).map(|_| lcg(&mut seed)).collect();
                let (mut d1, mut d2) = (x.clone(), x.clone());
                f32::ds_row(path, &mut d1, &p, 0.375);
                f32::ds_row(SimdPath::Scalar, &mut d2, &p, 0.375);
                assert_eq!(d1, d2, "{path} ds len {len}");
                let (mut s1, mut s2) = (x.clone(), x.clone());
                f32::scale_row(path, &mut s1, -1.5);
                f32::scale_row(SimdPath::Scalar, &mut s2, -1.5);
                assert_eq!(s1, s2, "{path} scale len {len}");
            }
        }
    }
}
