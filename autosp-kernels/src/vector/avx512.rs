//! f32 kernels with AVX-512F intrinsics, hand-written and tuned on Zen 4/5 (pulp's 512-bit `V4` needs a
//! pulp feature that would also change candle's gemm): the attention tile product with a 6 × 64 block of C in
//! 24 zmm registers (one broadcast element of A per row, 4 vectors of B per step of k: 24 FMAs for 10 loads;
//! column tails use masked loads and stores, so any n is exact and nothing past a row is read), `exp2` and
//! the row operations of the online softmax. Callers must have checked that the CPU runs
//! [`SimdPath::Avx512`](autosp_core::simd::SimdPath::Avx512).

use std::arch::x86_64::*;

/// Rows of C per register block.
const MR: usize = 6;
/// Vectors of 16 f32 per register block.
const NV: usize = 4;

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

/// AVX-512 `C[m × n] (+)= A[m × k] · B[k × n]` (A through any row and column strides, B and C row-major).
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
    const C: [f32; 7] = [1.533_757_7e-4, 1.339_986e-3, 9.618_519e-3, 5.550_329e-2, 2.402_264_7e-1, 6.931_472e-1, 1.0];
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
