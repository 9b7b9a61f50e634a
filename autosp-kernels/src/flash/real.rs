//! The float types the flash kernels compute in (f32, f64) and the tile operations each provides: f32 runs
//! the AVX-512 micro-kernels when the CPU has them, f64 (the finite-difference-grade test path) the portable
//! ones.

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
        #[cfg(target_arch = "x86_64")]
        if microkernel::has_avx512() {
            return microkernel::avx512::gemm(accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc);
        }
        microkernel::gemm_portable(accumulate, m, n, k, a, a_rs, a_cs, b, ldb, c, ldc)
    }

    fn exp2_row(x: &mut [Self], mul: Self, sub: Self) -> Self {
        #[cfg(target_arch = "x86_64")]
        if microkernel::has_avx512() && x.len().is_multiple_of(16) {
            // SAFETY: the features were detected and the length checked.
            return unsafe { microkernel::avx512::exp2_row(x, mul, sub) };
        }
        let mut s = 0.0;
        for v in x.iter_mut() {
            *v = (*v * mul - sub).exp2();
            s += *v;
        }
        s
    }

    fn max_row(x: &[Self]) -> Self {
        #[cfg(target_arch = "x86_64")]
        if microkernel::has_avx512() && x.len().is_multiple_of(16) {
            // SAFETY: the features were detected and the length checked.
            return unsafe { microkernel::avx512::max_row(x) };
        }
        // Not `f32::max`, which drops NaN: a NaN score must reach the softmax.
        x.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m || v.is_nan() { v } else { m })
    }

    fn ds_row(ds: &mut [Self], p: &[Self], delta: Self) {
        #[cfg(target_arch = "x86_64")]
        if microkernel::has_avx512() && ds.len() == p.len() && ds.len().is_multiple_of(16) {
            // SAFETY: the features were detected and the lengths checked.
            return unsafe { microkernel::avx512::ds_row(ds, p, delta) };
        }
        for (d, &pv) in ds.iter_mut().zip(p) {
            *d = pv * (*d - delta);
        }
    }

    fn scale_row(x: &mut [Self], a: Self) {
        #[cfg(target_arch = "x86_64")]
        if microkernel::has_avx512() {
            // SAFETY: the features were detected.
            return unsafe { microkernel::avx512::scale_row(x, a) };
        }
        for v in x.iter_mut() {
            *v *= a;
        }
    }
}
