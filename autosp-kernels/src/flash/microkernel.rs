//! The inner loops of flash attention: a register-blocked `C += A · B` on small tiles and a vectorised
//! `exp2` over a row of scores. f32 runs on the [`SimdPath`] it is given: the hand-written AVX-512 kernels
//! here (tuned on Zen 4/5; kept because pulp's 512-bit `V4` needs a pulp feature that would also change
//! candle's gemm), the pulp kernels of [`crate::vector`] for AVX2+FMA and NEON (one generic source), or the
//! portable loops (the reference; f64, the finite-difference-grade test path, always runs them).
//!
//! `gemm` computes `C[m × n] = A[m × k] · B[k × n]`, or `C += A · B` when asked to accumulate, where A is read through any (row, column) strides
//! (so `Pᵀ` and `dSᵀ` need no transpose copy), B is row-major with row stride `ldb` and contiguous columns,
//! and C is row-major with row stride `ldc`. Every attention product fits this form:
//! `S = Q Kᵀ` (B = packed Kᵀ), `O += P V`, `dV += Pᵀ dO`, `dP = dO Vᵀ` (B = packed Vᵀ), `dQ += dS K`,
//! `dK += dSᵀ Q`.
//!
//! The AVX-512 kernel keeps a 6 × 64 block of C in 24 zmm registers, broadcasts one element of A per row and
//! loads 4 vectors of B per step of k (24 FMAs for 10 loads); column tails use masked loads and stores, so
//! any n is exact and nothing past a row is read.

use autosp_core::simd::SimdPath;

use crate::vector;

/// Rows of C per register block (AVX-512 path).
const MR: usize = 6;
/// Vectors of 16 f32 per register block (AVX-512 path).
const NV: usize = 4;

/// Portable `C[m × n] (+)= A[m × k] · B[k × n]` (see the module doc for the strides).
///
/// # Safety
/// All pointers must be valid for the elements the strides address.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) unsafe fn gemm_portable<T>(
    accumulate: bool,
    m: usize,
    n: usize,
    k: usize,
    a: *const T,
    a_rs: usize,
    a_cs: usize,
    b: *const T,
    ldb: usize,
    c: *mut T,
    ldc: usize,
) where
    T: Copy + Default + std::ops::Mul<Output = T> + std::ops::Add<Output = T>,
{
    for i in 0..m {
        let crow = std::slice::from_raw_parts_mut(c.add(i * ldc), n);
        if !accumulate {
            for cv in crow.iter_mut() {
                *cv = T::default();
            }
        }
        for p in 0..k {
            let av = *a.add(i * a_rs + p * a_cs);
            let brow = std::slice::from_raw_parts(b.add(p * ldb), n);
            for (cv, &bv) in crow.iter_mut().zip(brow) {
                *cv = *cv + av * bv;
            }
        }
    }
}

/// f32 `C[m × n] (+)= A[m × k] · B[k × n]` on `path`: the hand-written AVX-512 kernel below, the pulp
/// kernel of [`crate::vector`] (AVX2+FMA, NEON), or [`gemm_portable`] (the scalar path, and any path this
/// CPU lacks).
///
/// # Safety
/// All pointers valid for the elements the strides address.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) unsafe fn gemm(
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
    if path == SimdPath::Avx512 && path.is_supported() {
        return avx512::gemm(accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc);
    }
    if vector::gemm(path, accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc).is_none() {
        gemm_portable(accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc)
    }
}

/// In place `x = 2^(x · mul - sub)` on `path`; returns the sum.
#[inline]
pub(crate) fn exp2_row(path: SimdPath, x: &mut [f32], mul: f32, sub: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if path == SimdPath::Avx512 && path.is_supported() && x.len().is_multiple_of(16) {
        // SAFETY: the features were detected and the length checked.
        return unsafe { avx512::exp2_row(x, mul, sub) };
    }
    if let Some(s) = vector::exp2_row(path, x, mul, sub) {
        return s;
    }
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v * mul - sub).exp2();
        s += *v;
    }
    s
}

/// The maximum of `x` on `path` (-inf when all are -inf, NaN when any is NaN).
#[inline]
pub(crate) fn max_row(path: SimdPath, x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if path == SimdPath::Avx512 && path.is_supported() && x.len().is_multiple_of(16) {
        // SAFETY: the features were detected and the length checked.
        return unsafe { avx512::max_row(x) };
    }
    if let Some(m) = vector::max_row(path, x) {
        return m;
    }
    // Not `f32::max`, which drops NaN: a NaN score must reach the softmax.
    x.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m || v.is_nan() { v } else { m })
}

/// In place `ds = p ∘ (ds - delta)` on `path` (equal lengths).
#[inline]
pub(crate) fn ds_row(path: SimdPath, ds: &mut [f32], p: &[f32], delta: f32) {
    #[cfg(target_arch = "x86_64")]
    if path == SimdPath::Avx512 && path.is_supported() && ds.len() == p.len() && ds.len().is_multiple_of(16) {
        // SAFETY: the features were detected and the lengths checked.
        return unsafe { avx512::ds_row(ds, p, delta) };
    }
    if vector::ds_row(path, ds, p, delta).is_some() {
        return;
    }
    for (d, &pv) in ds.iter_mut().zip(p) {
        *d = pv * (*d - delta);
    }
}

/// In place `x *= a` on `path`.
#[inline]
pub(crate) fn scale_row(path: SimdPath, x: &mut [f32], a: f32) {
    #[cfg(target_arch = "x86_64")]
    if path == SimdPath::Avx512 && path.is_supported() {
        // SAFETY: the features were detected.
        return unsafe { avx512::scale_row(x, a) };
    }
    if vector::scale_row(path, x, a).is_some() {
        return;
    }
    for v in x.iter_mut() {
        *v *= a;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    //! f32 kernels with AVX-512F intrinsics. Callers must have checked that the CPU runs
    //! [`SimdPath::Avx512`](autosp_core::simd::SimdPath::Avx512).
    use std::arch::x86_64::*;

    use super::{MR, NV};

    /// The write mask of column vector `v` of a block of `n` columns.
    #[inline(always)]
    fn mask_for(n: usize, v: usize) -> __mmask16 {
        let left = n.saturating_sub(v * 16);
        if left >= 16 {
            0xFFFF
        } else {
            ((1u32 << left) - 1) as __mmask16
        }
    }

    /// One `R × 16·V` block of C, held in registers over the whole k loop.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn block<const R: usize, const V: usize>(
        accumulate: bool,
        k: usize,
        a: *const f32,
        a_rs: usize,
        a_cs: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        masks: &[__mmask16; NV],
    ) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        if accumulate {
            for r in 0..R {
                for v in 0..V {
                    acc[r][v] = _mm512_maskz_loadu_ps(masks[v], c.add(r * ldc + v * 16));
                }
            }
        }
        let mut ap = a;
        let mut bp = b;
        for _ in 0..k {
            let mut bv = [_mm512_setzero_ps(); V];
            for v in 0..V {
                bv[v] = _mm512_maskz_loadu_ps(masks[v], bp.add(v * 16));
            }
            for r in 0..R {
                let av = _mm512_set1_ps(*ap.add(r * a_rs));
                for v in 0..V {
                    acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
                }
            }
            ap = ap.add(a_cs);
            bp = bp.add(ldb);
        }
        for r in 0..R {
            for v in 0..V {
                _mm512_mask_storeu_ps(c.add(r * ldc + v * 16), masks[v], acc[r][v]);
            }
        }
    }

    /// Runs the `R`-row block for the `nv` column vectors of this panel.
    macro_rules! dispatch_v {
        ($r:literal, $nv:expr, $($args:expr),*) => {
            match $nv {
                1 => block::<$r, 1>($($args),*),
                2 => block::<$r, 2>($($args),*),
                3 => block::<$r, 3>($($args),*),
                _ => block::<$r, 4>($($args),*),
            }
        };
    }

    /// AVX-512 `C[m × n] (+)= A[m × k] · B[k × n]` (see the module doc for the strides).
    ///
    /// # Safety
    /// The CPU must support avx512f and fma; all pointers valid for the elements the strides address.
    #[target_feature(enable = "avx512f,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm(
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
        let mut j = 0;
        while j < n {
            let w = (n - j).min(NV * 16);
            let nv = w.div_ceil(16);
            let masks = [mask_for(w, 0), mask_for(w, 1), mask_for(w, 2), mask_for(w, 3)];
            let bj = b.add(j);
            let mut i = 0;
            while i < m {
                let r = (m - i).min(MR);
                let ai = a.add(i * a_rs);
                let ci = c.add(i * ldc + j);
                match r {
                    6 => {
                        dispatch_v!(6, nv, accumulate, k, ai, a_rs, a_cs, bj, ldb, ci, ldc, &masks)
                    }
                    5 => {
                        dispatch_v!(5, nv, accumulate, k, ai, a_rs, a_cs, bj, ldb, ci, ldc, &masks)
                    }
                    4 => {
                        dispatch_v!(4, nv, accumulate, k, ai, a_rs, a_cs, bj, ldb, ci, ldc, &masks)
                    }
                    3 => {
                        dispatch_v!(3, nv, accumulate, k, ai, a_rs, a_cs, bj, ldb, ci, ldc, &masks)
                    }
                    2 => {
                        dispatch_v!(2, nv, accumulate, k, ai, a_rs, a_cs, bj, ldb, ci, ldc, &masks)
                    }
                    _ => {
                        dispatch_v!(1, nv, accumulate, k, ai, a_rs, a_cs, bj, ldb, ci, ldc, &masks)
                    }
                }
                i += r;
            }
            j += w;
        }
    }

    /// `2^x` for 16 lanes: x clamped below at -200 (NaN stays NaN: the clamp passes a NaN lane through, so a
    /// NaN score gives a NaN weight, as the portable `exp2` does), split into an integer n and a fraction f in
    /// [-0.5, 0.5], `2^f` from a degree-6 polynomial (least-squares fit of the relative error on Chebyshev
    /// nodes: max relative error 1.9e-9 before f32 rounding, so about 1 ulp in f32), scaled by `2^n` with
    /// `vscalefps` (which underflows to exactly 0 below 2^-149, so -inf gives 0). No upper clamp: the
    /// arguments here are at most ~0 (scores minus their running maximum or their LSE).
    #[inline(always)]
    pub(crate) unsafe fn exp2_ps(x: __m512) -> __m512 {
        const C: [f32; 7] =
            [1.533_757_7e-4, 1.339_986e-3, 9.618_519e-3, 5.550_329e-2, 2.402_264_7e-1, 6.931_472e-1, 1.0];
        // `vmaxps` returns its second operand when either is NaN: the clamp goes first so NaN comes through.
        let x = _mm512_max_ps(_mm512_set1_ps(-200.0), x);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(C[0]);
        for &ci in &C[1..] {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(ci));
        }
        _mm512_scalef_ps(p, n)
    }

    /// In place `x[i] = 2^(x[i] · mul - sub)` over `x.len()` (a multiple of 16) and returns the sum of the
    /// results, added lane-wise then reduced in a fixed order.
    ///
    /// # Safety
    /// The CPU must support avx512f and fma; `x.len() % 16 == 0`.
    #[target_feature(enable = "avx512f,fma")]
    pub(crate) unsafe fn exp2_row(x: &mut [f32], mul: f32, sub: f32) -> f32 {
        debug_assert_eq!(x.len() % 16, 0);
        let mv = _mm512_set1_ps(mul);
        let sv = _mm512_set1_ps(-sub);
        let mut sum = _mm512_setzero_ps();
        for ch in x.chunks_exact_mut(16) {
            let v = _mm512_loadu_ps(ch.as_ptr());
            let e = exp2_ps(_mm512_fmadd_ps(v, mv, sv));
            _mm512_storeu_ps(ch.as_mut_ptr(), e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_reduce_add_ps(sum)
    }

    /// In place `ds[i] = p[i] · (ds[i] - delta)` (lengths equal, a multiple of 16).
    ///
    /// # Safety
    /// The CPU must support avx512f; `ds.len() == p.len()`, a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn ds_row(ds: &mut [f32], p: &[f32], delta: f32) {
        let dv = _mm512_set1_ps(delta);
        for (d, p) in ds.chunks_exact_mut(16).zip(p.chunks_exact(16)) {
            let v = _mm512_sub_ps(_mm512_loadu_ps(d.as_ptr()), dv);
            _mm512_storeu_ps(d.as_mut_ptr(), _mm512_mul_ps(_mm512_loadu_ps(p.as_ptr()), v));
        }
    }

    /// In place `x[i] *= a` for any length.
    ///
    /// # Safety
    /// The CPU must support avx512f.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn scale_row(x: &mut [f32], a: f32) {
        let av = _mm512_set1_ps(a);
        let mut i = 0;
        while i < x.len() {
            let m = mask_for(x.len() - i, 0);
            let p = x.as_mut_ptr().add(i);
            _mm512_mask_storeu_ps(p, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p), av));
            i += 16;
        }
    }

    /// The maximum of `x` (length a multiple of 16); NaN when any element is NaN.
    ///
    /// # Safety
    /// The CPU must support avx512f; `x.len() % 16 == 0`.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn max_row(x: &[f32]) -> f32 {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut nan: __mmask16 = 0;
        for ch in x.chunks_exact(16) {
            let v = _mm512_loadu_ps(ch.as_ptr());
            nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            m = _mm512_max_ps(m, v);
        }
        if nan != 0 {
            return f32::NAN;
        }
        _mm512_reduce_max_ps(m)
    }
}

#[cfg(test)]
mod tests {
    use autosp_core::simd::supported_paths;

    use super::*;

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
                        gemm_portable(accumulate, m, n, k, a.as_ptr(), a_rs, a_cs, b.as_ptr(), ldb, c1.as_mut_ptr(), n);
                        gemm(path, accumulate, m, n, k, a.as_ptr(), a_rs, a_cs, b.as_ptr(), ldb, c2.as_mut_ptr(), n);
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
            let sum = exp2_row(path, &mut ys, 1.0, 0.0);
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
            let s = exp2_row(path, &mut zs, 1.0, 0.0) as f64;
            assert!((s - want_sum).abs() <= 1e-5 * want_sum, "{path}: sum {s} vs {want_sum}");
            // mul and sub: 2^(x · 0.5 - 1).
            let mut w = vec![2.0f32; 35];
            exp2_row(path, &mut w, 0.5, 1.0);
            assert!(w.iter().all(|&v| (v - 1.0).abs() <= 2e-7), "{path}: {w:?}");
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
                assert_eq!(max_row(path, &x), want, "{path} len {len}");
                assert_eq!(max_row(path, &vec![f32::NEG_INFINITY; len]), f32::NEG_INFINITY, "{path}");
                for at in [0, len / 2, len - 1] {
                    let mut y = x.clone();
                    y[at] = f32::NAN;
                    assert!(max_row(path, &y).is_nan(), "{path} len {len}: NaN at {at}");
                }
                let p: Vec<f32> = (0..len).map(|_| lcg(&mut seed)).collect();
                let (mut d1, mut d2) = (x.clone(), x.clone());
                ds_row(path, &mut d1, &p, 0.375);
                ds_row(SimdPath::Scalar, &mut d2, &p, 0.375);
                assert_eq!(d1, d2, "{path} ds len {len}");
                let (mut s1, mut s2) = (x.clone(), x.clone());
                scale_row(path, &mut s1, -1.5);
                scale_row(SimdPath::Scalar, &mut s2, -1.5);
                assert_eq!(s1, s2, "{path} scale len {len}");
            }
        }
    }
}
