//! f32 kernels written once over [`pulp::Simd`], so AVX2+FMA (pulp's `V3`, 8 lanes) and aarch64 NEON
//! (`Neon`, 4 lanes) run the same source: the attention tile product and row operations (online softmax,
//! `exp2`), and the row primitives of RMSNorm, RoPE, SwiGLU and the cross-entropy. Each function takes the
//! [`SimdPath`] to run on and returns `None` (doing nothing) for [`SimdPath::Scalar`] or a path the CPU
//! lacks: the caller ([`super::Real`]) then runs the portable loop, which stays the reference. Tails shorter
//! than a vector run the scalar formula.
//!
//! `exp2` here: the argument clamped to [-127, 127], split into an integer n (rounded to nearest by adding
//! and subtracting 1.5·2^23) and a fraction f in [-0.5, 0.5]; `2^f` from the degree-6 polynomial of the
//! AVX-512 kernel (max relative error 1.9e-9 before f32 rounding); `2^n` added to the exponent bits. An
//! argument below -125 gives exactly 0 (the exponent trick would wrap; 2^-125 is 2.4e-38), NaN gives NaN.

use autosp_core::simd::{vectorize, SimdPath};
use pulp::{Simd, WithSimd};

use super::online_softmax::{online_softmax_with, RowOps};
use super::portable;

/// Coefficients of `2^f` on [-0.5, 0.5], highest degree first (the AVX-512 kernel's).
const EXP2_C: [f32; 7] = [1.533_757_7e-4, 1.339_986e-3, 9.618_519e-3, 5.550_329e-2, 2.402_264_7e-1, 6.931_472e-1, 1.0];

/// 1.5·2^23: adding it rounds an f32 in [-2^22, 2^22] to an integer held in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `p · 2^n` lane-wise, where `t = n + ROUND_MAGIC` came from the rounding trick (so the integer `n` is
/// `bits(t) - bits(ROUND_MAGIC)`): `n` is shifted into the exponent field and added to `p`'s bits.
#[inline(always)]
fn times_pow2<S: Simd>(s: S, p: S::f32s, t: S::f32s) -> S::f32s {
    let n = s.sub_u32s(s.transmute_u32s_f32s(t), s.splat_u32s(ROUND_MAGIC.to_bits()));
    let e = s.wrapping_dyn_shl_u32s(n, s.splat_u32s(23));
    s.transmute_f32s_u32s(s.add_u32s(s.transmute_u32s_f32s(p), e))
}

/// `2^x` lane-wise (see the module doc).
#[inline(always)]
pub(crate) fn exp2_v<S: Simd>(s: S, x: S::f32s) -> S::f32s {
    let xc = s.min_f32s(s.max_f32s(x, s.splat_f32s(-127.0)), s.splat_f32s(127.0));
    let t = s.add_f32s(xc, s.splat_f32s(ROUND_MAGIC));
    let n = s.sub_f32s(t, s.splat_f32s(ROUND_MAGIC));
    let f = s.sub_f32s(xc, n);
    let mut p = s.splat_f32s(EXP2_C[0]);
    for &c in &EXP2_C[1..] {
        p = s.mul_add_f32s(p, f, s.splat_f32s(c));
    }
    let r = times_pow2(s, p, t);
    let r = s.select_f32s(s.less_than_f32s(x, s.splat_f32s(-125.0)), s.splat_f32s(0.0), r);
    // NaN compares unequal to itself: it passes through.
    s.select_f32s(s.equal_f32s(x, x), r, x)
}

/// Unaligned load of one vector at `p`.
///
/// # Safety
/// `p` valid for `S::F32_LANES` reads.
#[inline(always)]
unsafe fn load<S: Simd>(p: *const f32) -> S::f32s {
    std::ptr::read_unaligned(p as *const S::f32s)
}

/// Unaligned store of one vector at `p`.
///
/// # Safety
/// `p` valid for `S::F32_LANES` writes.
#[inline(always)]
unsafe fn store<S: Simd>(p: *mut f32, v: S::f32s) {
    std::ptr::write_unaligned(p as *mut S::f32s, v)
}

/// One `R × V·lanes` block of C, held in registers over the whole k loop (the AVX-512 kernel's scheme).
///
/// # Safety
/// As [`gemm`], for this block.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn block<S: Simd, const R: usize, const V: usize>(
    s: S,
    accumulate: bool,
    k: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    let l = S::F32_LANES;
    let mut acc = [[s.splat_f32s(0.0); V]; R];
    if accumulate {
        for r in 0..R {
            for v in 0..V {
                acc[r][v] = load::<S>(c.add(r * ldc + v * l));
            }
        }
    }
    let (mut ap, mut bp) = (a, b);
    for _ in 0..k {
        let mut bv = [s.splat_f32s(0.0); V];
        for v in 0..V {
            bv[v] = load::<S>(bp.add(v * l));
        }
        for r in 0..R {
            let av = s.splat_f32s(*ap.add(r * a_rs));
            for v in 0..V {
                acc[r][v] = s.mul_add_f32s(av, bv[v], acc[r][v]);
            }
        }
        ap = ap.add(a_cs);
        bp = bp.add(ldb);
    }
    for r in 0..R {
        for v in 0..V {
            store::<S>(c.add(r * ldc + v * l), acc[r][v]);
        }
    }
}

/// Row blocks of up to `MR` rows of one column panel of `V` vectors.
///
/// # Safety
/// As [`gemm`], for this panel.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel<S: Simd, const MR: usize, const V: usize>(
    s: S,
    accumulate: bool,
    m: usize,
    k: usize,
    a: *const f32,
    a_rs: usize,
    a_cs: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
) {
    let mut i = 0;
    while i < m {
        let r = (m - i).min(MR);
        let (ai, ci) = (a.add(i * a_rs), c.add(i * ldc));
        macro_rules! rows {
            ($($n:literal)*) => {
                match r {
                    $($n => block::<S, $n, V>(s, accumulate, k, ai, a_rs, a_cs, b, ldb, ci, ldc),)*
                    _ => block::<S, 1, V>(s, accumulate, k, ai, a_rs, a_cs, b, ldb, ci, ldc),
                }
            };
        }
        // MR is at most 8 (see `gemm_with`).
        rows!(8 7 6 5 4 3 2);
        i += r;
    }
}

/// `C[m × n] (+)= A[m × k] · B[k × n]` with `MR × V` register blocks: full panels of `V` vectors, then
/// single vectors, then the last `n % lanes` columns with the scalar formula.
///
/// # Safety
/// As [`gemm`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_with<S: Simd, const MR: usize, const V: usize>(
    s: S,
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
    let l = S::F32_LANES;
    let mut j = 0;
    while j + V * l <= n {
        panel::<S, MR, V>(s, accumulate, m, k, a, a_rs, a_cs, b.add(j), ldb, c.add(j), ldc);
        j += V * l;
    }
    while j + l <= n {
        panel::<S, MR, 1>(s, accumulate, m, k, a, a_rs, a_cs, b.add(j), ldb, c.add(j), ldc);
        j += l;
    }
    if j < n {
        portable::gemm(accumulate, m, n - j, k, a, a_rs, a_cs, b.add(j), ldb, c.add(j), ldc);
    }
}

/// The tile product on `path` (see [`super::Real::gemm`] for the strides); `None` on the scalar path. Blocks: 6 rows × 2 vectors where there are 16 vector registers (AVX2: 12 accumulators, 2 of B,
/// 1 broadcast), 8 × 3 where there are 32 (NEON: 24 + 3 + 1).
///
/// # Safety
/// All pointers valid for the elements the strides address.
#[allow(clippy::too_many_arguments)]
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
) -> Option<()> {
    struct Op {
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
    }
    impl WithSimd for Op {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op { accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc } = self;
            // SAFETY: the caller of `gemm` vouches for the pointers.
            unsafe {
                if S::REGISTER_COUNT >= 32 {
                    gemm_with::<S, 8, 3>(s, accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc)
                } else {
                    gemm_with::<S, 6, 2>(s, accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc)
                }
            }
        }
    }
    vectorize(path, Op { accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc })
}

/// In place `x[i] = 2^(x[i] · mul - sub)`; returns the sum of the results (lane-wise, then reduced; the
/// tail added last).
#[inline(always)]
fn exp2_sum<S: Simd>(s: S, x: &mut [f32], mul: f32, sub: f32) -> f32 {
    let (head, tail) = S::as_mut_simd_f32s(x);
    let (mv, sv) = (s.splat_f32s(mul), s.splat_f32s(-sub));
    let mut sum = s.splat_f32s(0.0);
    for v in head.iter_mut() {
        let e = exp2_v(s, s.mul_add_f32s(*v, mv, sv));
        *v = e;
        sum = s.add_f32s(sum, e);
    }
    let mut total = s.reduce_sum_f32s(sum);
    for v in tail.iter_mut() {
        *v = (*v * mul - sub).exp2();
        total += *v;
    }
    total
}

/// The maximum of `x` (-inf for an empty or all -inf row, NaN when any element is NaN).
#[inline(always)]
fn max_of<S: Simd>(s: S, x: &[f32]) -> f32 {
    let (head, tail) = S::as_simd_f32s(x);
    let mut m = s.splat_f32s(f32::NEG_INFINITY);
    let mut nan = s.splat_f32s(0.0);
    for &v in head {
        m = s.max_f32s(m, v);
        nan = s.select_f32s(s.equal_f32s(v, v), nan, s.splat_f32s(1.0));
    }
    if s.reduce_max_f32s(nan) > 0.0 {
        return f32::NAN;
    }
    tail.iter().fold(s.reduce_max_f32s(m), |m, &v| if v > m || v.is_nan() { v } else { m })
}

/// In place `x *= a`.
#[inline(always)]
fn scale<S: Simd>(s: S, x: &mut [f32], a: f32) {
    let (h, t) = S::as_mut_simd_f32s(x);
    let av = s.splat_f32s(a);
    for v in h.iter_mut() {
        *v = s.mul_f32s(*v, av);
    }
    for v in t.iter_mut() {
        *v *= a;
    }
}

/// In place `x[i] = 2^(x[i] · mul - sub)`; returns the sum of the results. `None` on the scalar path.
pub(crate) fn exp2_row(path: SimdPath, x: &mut [f32], mul: f32, sub: f32) -> Option<f32> {
    struct Op<'a>(&'a mut [f32], f32, f32);
    impl WithSimd for Op<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            exp2_sum(s, self.0, self.1, self.2)
        }
    }
    vectorize(path, Op(x, mul, sub))
}

/// The maximum of `x` (-inf for an empty or all -inf row, NaN when any element is NaN). `None` on the
/// scalar path.
pub(crate) fn max_row(path: SimdPath, x: &[f32]) -> Option<f32> {
    struct Op<'a>(&'a [f32]);
    impl WithSimd for Op<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            max_of(s, self.0)
        }
    }
    vectorize(path, Op(x))
}

/// One online-softmax step of the flash forward over a whole score tile, in one dispatch (the formulas are
/// [`online_softmax_with`]'s, run on this module's row code). Per row it is the max, `exp2` and rescale
/// row operations run one after the other; fused, the tile pays pulp's dispatch (the CPU feature checks and a
/// call that cannot be inlined) once rather than up to three times per row. `None` on the scalar path.
#[allow(clippy::too_many_arguments)]
pub(crate) fn online_softmax(
    path: SimdPath,
    s: &mut [f32],
    ld: usize,
    c: f32,
    m: &mut [f32],
    l: &mut [f32],
    acc: &mut [f32],
    d: usize,
) -> Option<()> {
    struct Op<'a> {
        s: &'a mut [f32],
        ld: usize,
        c: f32,
        m: &'a mut [f32],
        l: &'a mut [f32],
        acc: &'a mut [f32],
        d: usize,
    }
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, simd: S) {
            let Op { s, ld, c, m, l, acc, d } = self;
            let rows = RowOps {
                max: |x: &[f32]| max_of(simd, x),
                exp2: |x: &mut [f32], mul, sub| exp2_sum(simd, x, mul, sub),
            };
            online_softmax_with(s, ld, c, m, l, acc, d, rows, |x, a| scale(simd, x, a));
        }
    }
    debug_assert!(s.len() == m.len() * ld && m.len() == l.len() && acc.len() >= m.len() * d);
    vectorize(path, Op { s, ld, c, m, l, acc, d })
}

/// In place `ds = p ∘ (ds - delta)` (equal lengths).
#[inline(always)]
fn ds_of<S: Simd>(s: S, ds: &mut [f32], p: &[f32], delta: f32) {
    let (dh, dt) = S::as_mut_simd_f32s(ds);
    let (ph, pt) = S::as_simd_f32s(p);
    let dv = s.splat_f32s(delta);
    for (d, &pv) in dh.iter_mut().zip(ph) {
        *d = s.mul_f32s(pv, s.sub_f32s(*d, dv));
    }
    for (d, &pv) in dt.iter_mut().zip(pt) {
        *d = pv * (*d - delta);
    }
}

/// In place `ds = p ∘ (ds - delta)` (equal lengths). `None` on the scalar path.
pub(crate) fn ds_row(path: SimdPath, ds: &mut [f32], p: &[f32], delta: f32) -> Option<()> {
    struct Op<'a>(&'a mut [f32], &'a [f32], f32);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            ds_of(s, self.0, self.1, self.2)
        }
    }
    debug_assert_eq!(ds.len(), p.len());
    vectorize(path, Op(ds, p, delta))
}

/// [`ds_row`] on every row of the `[delta.len(), ld]` tiles, in one dispatch (as [`online_softmax`]: pulp's
/// feature checks and call once per tile, not once per row). `None` on the scalar path.
pub(crate) fn ds_tile(path: SimdPath, ds: &mut [f32], p: &[f32], ld: usize, delta: &[f32]) -> Option<()> {
    struct Op<'a>(&'a mut [f32], &'a [f32], usize, &'a [f32]);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op(ds, p, ld, delta) = self;
            for ((row, p), &dl) in ds.chunks_exact_mut(ld).zip(p.chunks_exact(ld)).zip(delta) {
                ds_of(s, row, p, dl);
            }
        }
    }
    vectorize(path, Op(ds, p, ld, delta))
}

/// [`exp2_row`] on every row of the `[sub.len(), ld]` tile `x` (row r with `sub[r]`), in one dispatch.
/// `None` on the scalar path.
pub(crate) fn exp2_tile(path: SimdPath, x: &mut [f32], ld: usize, mul: f32, sub: &[f32]) -> Option<()> {
    struct Op<'a>(&'a mut [f32], usize, f32, &'a [f32]);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op(x, ld, mul, sub) = self;
            for (row, &sb) in x.chunks_exact_mut(ld).zip(sub) {
                exp2_sum(s, row, mul, sb);
            }
        }
    }
    vectorize(path, Op(x, ld, mul, sub))
}

/// In place `x *= a`. `None` on the scalar path.
pub(crate) fn scale_row(path: SimdPath, x: &mut [f32], a: f32) -> Option<()> {
    struct Op<'a>(&'a mut [f32], f32);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            scale(s, self.0, self.1)
        }
    }
    vectorize(path, Op(x, a))
}

/// `ln 2 = LN2_HI + LN2_LO` for the range reduction of [`exp_v`] (Cody–Waite, Cephes' split): `LN2_HI` =
/// 355/512 has 9 significant bits, so `n · LN2_HI` is exact for the |n| <= 128 used here.
const LN2_HI: f32 = 0.693_359_4; // exactly 355/512 as an f32
const LN2_LO: f32 = -2.121_944_4e-4;

/// `e^x` lane-wise: n = round(x · log2 e), r = x - n · ln 2 in two steps (so r is exact to f32 rounding,
/// |r| <= 0.347), `e^r` from its degree-7 Taylor polynomial (truncation error 5e-9 relative, about 1 ulp in
/// f32 after rounding), `2^n` added to the exponent bits as in [`exp2_v`]. Below -86.6 (2^-125) exactly 0,
/// above 88 clamped to e^88 (callers' arguments are at most ~0 or feed `1 / (1 + e^x)`, where that clamp
/// changes nothing), NaN gives NaN.
#[inline(always)]
pub(crate) fn exp_v<S: Simd>(s: S, x: S::f32s) -> S::f32s {
    let xc = s.min_f32s(s.max_f32s(x, s.splat_f32s(-88.0)), s.splat_f32s(88.0));
    let t = s.mul_add_f32s(xc, s.splat_f32s(std::f32::consts::LOG2_E), s.splat_f32s(ROUND_MAGIC));
    let n = s.sub_f32s(t, s.splat_f32s(ROUND_MAGIC));
    let r = s.mul_add_f32s(n, s.splat_f32s(-LN2_HI), xc);
    let r = s.mul_add_f32s(n, s.splat_f32s(-LN2_LO), r);
    const C: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];
    let mut p = s.splat_f32s(C[0]);
    for &c in &C[1..] {
        p = s.mul_add_f32s(p, r, s.splat_f32s(c));
    }
    let y = times_pow2(s, p, t);
    let y = s.select_f32s(s.less_than_f32s(x, s.splat_f32s(-86.6)), s.splat_f32s(0.0), y);
    s.select_f32s(s.equal_f32s(x, x), y, x)
}

/// `sum(e^(x[i] - m))` over the row (lane-wise sums, reduced, then the tail). `None` on the scalar path.
pub(crate) fn exp_sum_row(path: SimdPath, x: &[f32], m: f32) -> Option<f32> {
    struct Op<'a>(&'a [f32], f32);
    impl WithSimd for Op<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            let Op(x, m) = self;
            let (head, tail) = S::as_simd_f32s(x);
            let mv = s.splat_f32s(m);
            let mut acc = [s.splat_f32s(0.0); 4];
            let mut chunks = head.chunks_exact(4);
            for c in &mut chunks {
                for l in 0..4 {
                    acc[l] = s.add_f32s(acc[l], exp_v(s, s.sub_f32s(c[l], mv)));
                }
            }
            for &v in chunks.remainder() {
                acc[0] = s.add_f32s(acc[0], exp_v(s, s.sub_f32s(v, mv)));
            }
            let sum = s.add_f32s(s.add_f32s(acc[0], acc[2]), s.add_f32s(acc[1], acc[3]));
            tail.iter().fold(s.reduce_sum_f32s(sum), |a, &v| a + (v - m).exp())
        }
    }
    vectorize(path, Op(x, m))
}

/// In place `x[i] = e^(x[i] - m)`; returns their sum. `None` on the scalar path.
pub(crate) fn exp_row(path: SimdPath, x: &mut [f32], m: f32) -> Option<f32> {
    struct Op<'a>(&'a mut [f32], f32);
    impl WithSimd for Op<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            let Op(x, m) = self;
            let (head, tail) = S::as_mut_simd_f32s(x);
            let mv = s.splat_f32s(m);
            let mut sum = s.splat_f32s(0.0);
            for v in head.iter_mut() {
                *v = exp_v(s, s.sub_f32s(*v, mv));
                sum = s.add_f32s(sum, *v);
            }
            let mut total = s.reduce_sum_f32s(sum);
            for v in tail.iter_mut() {
                *v = (*v - m).exp();
                total += *v;
            }
            total
        }
    }
    vectorize(path, Op(x, m))
}

/// `y = silu(a) · u = a / (1 + e^-a) · u` (equal lengths). `None` on the scalar path.
pub(crate) fn silu_mul(path: SimdPath, y: &mut [f32], a: &[f32], u: &[f32]) -> Option<()> {
    struct Op<'a>(&'a mut [f32], &'a [f32], &'a [f32]);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op(y, a, u) = self;
            let (yh, yt) = S::as_mut_simd_f32s(y);
            let ((ah, at), (uh, ut)) = (S::as_simd_f32s(a), S::as_simd_f32s(u));
            let one = s.splat_f32s(1.0);
            for ((yv, &av), &uv) in yh.iter_mut().zip(ah).zip(uh) {
                let den = s.add_f32s(one, exp_v(s, s.sub_f32s(s.splat_f32s(0.0), av)));
                *yv = s.mul_f32s(s.div_f32s(av, den), uv);
            }
            for ((yv, &av), &uv) in yt.iter_mut().zip(at).zip(ut) {
                *yv = av / (1.0 + (-av).exp()) * uv;
            }
        }
    }
    vectorize(path, Op(y, a, u))
}

/// SwiGLU's backward: `da = g · u · σ(a) · (1 + a (1 - σ(a)))`, `du = g · silu(a)` (equal lengths). `None` on
/// the scalar path.
pub(crate) fn swiglu_grad(
    path: SimdPath,
    da: &mut [f32],
    du: &mut [f32],
    a: &[f32],
    u: &[f32],
    g: &[f32],
) -> Option<()> {
    struct Op<'a>(&'a mut [f32], &'a mut [f32], &'a [f32], &'a [f32], &'a [f32]);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op(da, du, a, u, g) = self;
            let ((dah, dat), (duh, dut)) = (S::as_mut_simd_f32s(da), S::as_mut_simd_f32s(du));
            let ((ah, at), (uh, ut), (gh, gt)) = (S::as_simd_f32s(a), S::as_simd_f32s(u), S::as_simd_f32s(g));
            let one = s.splat_f32s(1.0);
            for i in 0..dah.len() {
                let (av, uv, gv) = (ah[i], uh[i], gh[i]);
                let den = s.add_f32s(one, exp_v(s, s.sub_f32s(s.splat_f32s(0.0), av)));
                let sg = s.div_f32s(one, den);
                let inner = s.add_f32s(s.mul_f32s(av, s.sub_f32s(one, sg)), one);
                dah[i] = s.mul_f32s(s.mul_f32s(gv, uv), s.mul_f32s(sg, inner));
                duh[i] = s.mul_f32s(gv, s.div_f32s(av, den));
            }
            for i in 0..dat.len() {
                let (av, uv, gv) = (at[i], ut[i], gt[i]);
                let sg = 1.0 / (1.0 + (-av).exp());
                dat[i] = gv * uv * (sg * (av * (1.0 - sg) + 1.0));
                dut[i] = gv * (av / (1.0 + (-av).exp()));
            }
        }
    }
    vectorize(path, Op(da, du, a, u, g))
}

/// `sum(a[i] · b[i])` on `S` (equal lengths): four vector accumulators, reduced in a fixed order, then the
/// tail.
#[inline(always)]
fn dot_of<S: Simd>(s: S, a: &[f32], b: &[f32]) -> f32 {
    let ((ah, at), (bh, bt)) = (S::as_simd_f32s(a), S::as_simd_f32s(b));
    let mut acc = [s.splat_f32s(0.0); 4];
    let (ca, cb) = (ah.chunks_exact(4), bh.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            acc[l] = s.mul_add_f32s(x[l], y[l], acc[l]);
        }
    }
    for (&x, &y) in ra.iter().zip(rb) {
        acc[0] = s.mul_add_f32s(x, y, acc[0]);
    }
    let sum = s.add_f32s(s.add_f32s(acc[0], acc[2]), s.add_f32s(acc[1], acc[3]));
    at.iter().zip(bt).fold(s.reduce_sum_f32s(sum), |t, (&x, &y)| t + x * y)
}

/// `sum(a[i] · b[i])` (four vector accumulators, reduced in a fixed order, then the tail). `None` on the
/// scalar path.
pub(crate) fn dot(path: SimdPath, a: &[f32], b: &[f32]) -> Option<f32> {
    struct Op<'a>(&'a [f32], &'a [f32]);
    impl WithSimd for Op<'_> {
        type Output = f32;
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) -> f32 {
            dot_of(s, self.0, self.1)
        }
    }
    debug_assert_eq!(a.len(), b.len());
    vectorize(path, Op(a, b))
}

/// [`dot`] of every row of `a: [m, d]` with every row of `b: [n, d]` (row stride `d` both), in one dispatch:
/// `out[i · ld + j] = a_i · b_j` (`out: [m, ld]`), each sum [`dot`]'s to the bit; `b`'s rows outermost, so
/// each is read once while `a`'s few rows stay in L1. `None` on the scalar path.
pub(crate) fn dots(path: SimdPath, a: &[f32], b: &[f32], d: usize, out: &mut [f32], ld: usize) -> Option<()> {
    struct Op<'a>(&'a [f32], &'a [f32], usize, &'a mut [f32], usize);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op(a, b, d, out, ld) = self;
            for (j, br) in b.chunks_exact(d).enumerate() {
                for (i, ar) in a.chunks_exact(d).enumerate() {
                    out[i * ld + j] = dot_of(s, ar, br);
                }
            }
        }
    }
    debug_assert!(d > 0 && a.len().is_multiple_of(d) && b.len().is_multiple_of(d) && b.len() / d <= ld);
    vectorize(path, Op(a, b, d, out, ld))
}

/// `y[i] = x[i] · r · w[i]` (RMSNorm's output row; equal lengths). `None` on the scalar path.
pub(crate) fn scale_mul(path: SimdPath, y: &mut [f32], x: &[f32], w: &[f32], r: f32) -> Option<()> {
    struct Op<'a>(&'a mut [f32], &'a [f32], &'a [f32], f32);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op(y, x, w, r) = self;
            let (yh, yt) = S::as_mut_simd_f32s(y);
            let ((xh, xt), (wh, wt)) = (S::as_simd_f32s(x), S::as_simd_f32s(w));
            let rv = s.splat_f32s(r);
            for ((yv, &xv), &wv) in yh.iter_mut().zip(xh).zip(wh) {
                *yv = s.mul_f32s(s.mul_f32s(xv, rv), wv);
            }
            for ((yv, &xv), &wv) in yt.iter_mut().zip(xt).zip(wt) {
                *yv = xv * r * wv;
            }
        }
    }
    vectorize(path, Op(y, x, w, r))
}

/// RoPE on one row's halves: `y1 = x1 c - x2 s`, `y2 = x2 c + x1 s`, or with `inverse` (the backward, the
/// negative angle) `y1 = x1 c + x2 s`, `y2 = x2 c - x1 s` (all of one length). `None` on the scalar path.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rotate(
    path: SimdPath,
    y1: &mut [f32],
    y2: &mut [f32],
    x1: &[f32],
    x2: &[f32],
    c: &[f32],
    sn: &[f32],
    inverse: bool,
) -> Option<()> {
    struct Op<'a>(&'a mut [f32], &'a mut [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32], bool);
    impl WithSimd for Op<'_> {
        type Output = ();
        #[inline(always)]
        fn with_simd<S: Simd>(self, s: S) {
            let Op(y1, y2, x1, x2, c, sn, inverse) = self;
            let ((y1h, y1t), (y2h, y2t)) = (S::as_mut_simd_f32s(y1), S::as_mut_simd_f32s(y2));
            let ((x1h, x1t), (x2h, x2t)) = (S::as_simd_f32s(x1), S::as_simd_f32s(x2));
            let ((ch, ct), (sh, st)) = (S::as_simd_f32s(c), S::as_simd_f32s(sn));
            for i in 0..y1h.len() {
                let (a, b, cv, sv) = (x1h[i], x2h[i], ch[i], sh[i]);
                if inverse {
                    y1h[i] = s.add_f32s(s.mul_f32s(a, cv), s.mul_f32s(b, sv));
                    y2h[i] = s.sub_f32s(s.mul_f32s(b, cv), s.mul_f32s(a, sv));
                } else {
                    y1h[i] = s.sub_f32s(s.mul_f32s(a, cv), s.mul_f32s(b, sv));
                    y2h[i] = s.add_f32s(s.mul_f32s(b, cv), s.mul_f32s(a, sv));
                }
            }
            for i in 0..y1t.len() {
                let (a, b, cv, sv) = (x1t[i], x2t[i], ct[i], st[i]);
                if inverse {
                    y1t[i] = a * cv + b * sv;
                    y2t[i] = b * cv - a * sv;
                } else {
                    y1t[i] = a * cv - b * sv;
                    y2t[i] = b * cv + a * sv;
                }
            }
        }
    }
    vectorize(path, Op(y1, y2, x1, x2, c, sn, inverse))
}

#[cfg(test)]
mod tests {
    use autosp_core::simd::{supported_paths, SimdPath};

    use super::*;

    /// Both register blocks of the tile product, on every vector path this CPU runs, against the portable
    /// loop: 6 × 2 vectors (what 16-register ISAs run) and 8 × 3 (what 32-register ones run: NEON). The 8 × 3
    /// block is chosen by `S::REGISTER_COUNT`, so on x86 (AVX2, 16 registers) `gemm` never picks it; here it
    /// runs on the AVX2 path all the same (the compiler spills what does not fit), which checks its blocking,
    /// row remainders, panel and column tails and strided A on any machine. Shapes cover full blocks, every
    /// row remainder up to 7, n with whole panels, single vectors and a scalar tail, and accumulation.
    /// Tolerance 1e-5 relative to the largest |C|: the same sums in the same k order, FMA vs separate rounding.
    #[test]
    fn both_register_blocks_equal_the_portable_product() {
        struct Blocks {
            mr8: bool,
            accumulate: bool,
            m: usize,
            n: usize,
            k: usize,
            a: Vec<f32>,
            transposed: bool,
            b: Vec<f32>,
            c: Vec<f32>,
        }
        impl WithSimd for Blocks {
            type Output = Vec<f32>;
            #[inline(always)]
            fn with_simd<S: Simd>(mut self, s: S) -> Vec<f32> {
                let (m, n, k) = (self.m, self.n, self.k);
                let (rs, cs) = if self.transposed { (1, m) } else { (k, 1) };
                let (a, b, c) = (self.a.as_ptr(), self.b.as_ptr(), self.c.as_mut_ptr());
                // SAFETY: A is m × k with the strides above, B is k × n (ldb n), C is m × n (ldc n).
                unsafe {
                    if self.mr8 {
                        gemm_with::<S, 8, 3>(s, self.accumulate, m, n, k, a, rs, cs, b, n, c, n)
                    } else {
                        gemm_with::<S, 6, 2>(s, self.accumulate, m, n, k, a, rs, cs, b, n, c, n)
                    }
                }
                self.c
            }
        }
        let value = |i: usize, salt: usize| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0;
        for path in supported_paths().into_iter().filter(|&p| p != SimdPath::Scalar) {
            for (m, n, k) in [(16, 48, 9), (23, 61, 17), (7, 100, 5), (1, 3, 4), (15, 24, 33)] {
                for (mr8, accumulate, transposed) in [(true, false, false), (true, true, true), (false, true, false)] {
                    let a: Vec<f32> = (0..m * k).map(|i| value(i, 1)).collect();
                    let b: Vec<f32> = (0..k * n).map(|i| value(i, 2)).collect();
                    let c0: Vec<f32> = (0..m * n).map(|i| value(i, 3)).collect();
                    let mut want = c0.clone();
                    let (rs, cs) = if transposed { (1, m) } else { (k, 1) };
                    // SAFETY: as above.
                    unsafe {
                        portable::gemm(accumulate, m, n, k, a.as_ptr(), rs, cs, b.as_ptr(), n, want.as_mut_ptr(), n)
                    };
                    let op = Blocks { mr8, accumulate, m, n, k, a, transposed, b, c: c0 };
                    let got = vectorize(path, op).expect("a vector path");
                    let scale = want.iter().fold(0f32, |x, y| x.max(y.abs()));
                    let err = got.iter().zip(&want).fold(0f32, |x, (g, w)| x.max((g - w).abs()));
                    assert!(err <= 1e-5 * scale, "{path} {m}x{n}x{k} 8x3={mr8} acc={accumulate}: error {err}");
                }
            }
        }
    }

    /// The batched dot products equal [`dot`]'s pair by pair to the bit, on every vector path, for row
    /// lengths with whole groups of four vectors, a remainder of vectors and a scalar tail, into an output of
    /// row stride past `n` whose other columns stay as they were.
    #[test]
    fn dots_equal_dot_pair_by_pair() {
        let value = |i: usize, salt: usize| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0;
        for path in supported_paths().into_iter().filter(|&p| p != SimdPath::Scalar) {
            for (m, n, d) in [(3, 11, 64), (2, 5, 45), (1, 9, 7)] {
                let a: Vec<f32> = (0..m * d).map(|i| value(i, 1)).collect();
                let b: Vec<f32> = (0..n * d).map(|i| value(i, 2)).collect();
                let ld = n + 3;
                let mut out = vec![f32::NAN; m * ld];
                dots(path, &a, &b, d, &mut out, ld).expect("a vector path");
                for i in 0..m {
                    for j in 0..ld {
                        let got = out[i * ld + j];
                        if j < n {
                            let want = dot(path, &a[i * d..(i + 1) * d], &b[j * d..(j + 1) * d]).unwrap();
                            assert_eq!(got.to_bits(), want.to_bits(), "{path} d {d} pair ({i}, {j})");
                        } else {
                            assert!(got.is_nan(), "{path} column {j} past n = {n} written");
                        }
                    }
                }
            }
        }
        assert!(dots(SimdPath::Scalar, &[1.0], &[1.0], 1, &mut [0.0], 1).is_none());
    }

    /// `e^x` on every vector path against f64's over [-86, 88]: within 3e-7 relative (Taylor truncation 5e-9
    /// plus the f32 rounding of r, the polynomial's steps and the result, about 2 ulp); exactly 0 below
    /// -88 and for -inf, NaN for NaN; tails take the scalar formula.
    #[test]
    fn exp_is_accurate() {
        let mut xs: Vec<f32> = (0..17_401).map(|i| -86.0 + i as f32 * 0.01).collect();
        xs.extend([f32::NEG_INFINITY, -1e30, -100.0, f32::NAN, 0.0, -0.0]);
        for p in supported_paths().into_iter().filter(|&p| p != SimdPath::Scalar) {
            let mut ys = xs.clone();
            exp_row(p, &mut ys, 0.0).unwrap();
            for (&x, &y) in xs.iter().zip(&ys) {
                if x.is_nan() {
                    assert!(y.is_nan(), "{p}: e^NaN = {y}");
                } else if x < -88.0 {
                    // 0 in the vector lanes, libm's subnormal in a scalar tail.
                    assert!((0.0..1.2e-38).contains(&y), "{p}: e^{x} = {y}");
                } else {
                    let want = (x as f64).exp();
                    assert!(((y as f64) - want).abs() <= 3e-7 * want, "{p}: e^{x} = {y}, want {want}");
                }
            }
        }
    }
}
