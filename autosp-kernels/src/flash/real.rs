//! The float types the flash kernels compute in (f32, f64) and the tile operations each provides: f32 runs
//! the micro-kernels of the vector path in force ([`autosp_core::simd::simd_path`]: AVX-512, AVX2+FMA,
//! NEON or scalar), f64 (the finite-difference-grade test path) the portable ones.

use autosp_core::simd::simd_path;

use super::microkernel;

/// A float the flash kernels accumulate in.
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + Default
    + 'static
{
    const ZERO: Self;
    const NEG_INF: Self;
    fn from_f64(x: f64) -> Self;
    fn exp2(self) -> Self;
    fn log2(self) -> Self;
    fn is_nan(self) -> bool;

    /// `C[m × n] = A[m × k] · B[k × n]`, or `C += A · B` when `accumulate`; see [`microkernel`] for the
    /// strides.
    ///
    /// # Safety
    /// All pointers valid for the elements the strides address.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
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
    );

    /// In place `x = 2^(x · mul - sub)`; returns the sum. `x.len()` is a multiple of 16.
    fn exp2_row(x: &mut [Self], mul: Self, sub: Self) -> Self {
        let mut s = Self::ZERO;
        for v in x.iter_mut() {
            *v = (*v * mul - sub).exp2();
            s = s + *v;
        }
        s
    }

    /// The maximum of `x` (-inf when all are -inf, NaN when any is NaN). `x.len()` is a multiple of 16.
    fn max_row(x: &[Self]) -> Self {
        x.iter().fold(Self::NEG_INF, |m, &v| if v > m || v.is_nan() { v } else { m })
    }

    /// In place `ds = p ∘ (ds - delta)`; equal lengths, a multiple of 16.
    fn ds_row(ds: &mut [Self], p: &[Self], delta: Self) {
        for (d, &pv) in ds.iter_mut().zip(p) {
            *d = pv * (*d - delta);
        }
    }

    /// In place `x *= a`.
    fn scale_row(x: &mut [Self], a: Self) {
        for v in x.iter_mut() {
            *v = *v * a;
        }
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    fn from_f64(x: f64) -> Self {
        x
    }
    fn exp2(self) -> Self {
        f64::exp2(self)
    }
    fn log2(self) -> Self {
        f64::log2(self)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    unsafe fn gemm(
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
        microkernel::gemm_portable(accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc)
    }
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn exp2(self) -> Self {
        f32::exp2(self)
    }
    fn log2(self) -> Self {
        f32::log2(self)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    unsafe fn gemm(
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
        microkernel::gemm(simd_path(), accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc)
    }

    fn exp2_row(x: &mut [Self], mul: Self, sub: Self) -> Self {
        microkernel::exp2_row(simd_path(), x, mul, sub)
    }

    fn max_row(x: &[Self]) -> Self {
        microkernel::max_row(simd_path(), x)
    }

    fn ds_row(ds: &mut [Self], p: &[Self], delta: Self) {
        microkernel::ds_row(simd_path(), ds, p, delta)
    }

    fn scale_row(x: &mut [Self], a: Self) {
        microkernel::scale_row(simd_path(), x, a)
    }
}
