//! The portable scalar loops of every vector kernel: the reference each vector path is tested against, the
//! scalar path ([`autosp_core::simd::SimdPath::Scalar`]), f64's only path, and the tails shorter than a
//! vector.

use super::float::Float;

/// `C[m × n] = A[m × k] · B[k × n]`, or `C += A · B` when `accumulate`: A read through any (row, column)
/// strides, B row-major with row stride `ldb`, C row-major with row stride `ldc`.
///
/// # Safety
/// All pointers must be valid for the elements the strides address.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) unsafe fn gemm<T: Float>(
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
) {
    for i in 0..m {
        let crow = std::slice::from_raw_parts_mut(c.add(i * ldc), n);
        if !accumulate {
            crow.fill(T::ZERO);
        }
        for p in 0..k {
            let av = *a.add(i * a_rs + p * a_cs);
            let brow = std::slice::from_raw_parts(b.add(p * ldb), n);
            for (cv, &bv) in crow.iter_mut().zip(brow) {
                *cv += av * bv;
            }
        }
    }
}

/// In place `x = 2^(x · mul - sub)`; returns the sum.
pub(crate) fn exp2_row<T: Float>(x: &mut [T], mul: T, sub: T) -> T {
    let mut s = T::ZERO;
    for v in x.iter_mut() {
        *v = (*v * mul - sub).exp2();
        s += *v;
    }
    s
}

/// The largest element of `x`: -inf for an empty or all -inf row, NaN when any element is NaN (a NaN score
/// must reach the softmax; `f32::max` would drop it).
pub(crate) fn max_row<T: Float>(x: &[T]) -> T {
    x.iter().fold(T::NEG_INF, |m, &v| if v > m || v.is_nan() { v } else { m })
}

/// In place `ds = p ∘ (ds - delta)` (equal lengths).
pub(crate) fn ds_row<T: Float>(ds: &mut [T], p: &[T], delta: T) {
    for (d, &pv) in ds.iter_mut().zip(p) {
        *d = pv * (*d - delta);
    }
}

/// In place `x *= a`.
pub(crate) fn scale_row<T: Float>(x: &mut [T], a: T) {
    for v in x.iter_mut() {
        *v *= a;
    }
}

/// `sum(a[i] · b[i])` with eight independent accumulators, so that the compiler vectorises it.
pub(crate) fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = T::ZERO;
    for (x, y) in ra.iter().zip(rb) {
        s += *x * *y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + s
}

/// `sum(e^(x[i] - m))` with eight accumulators.
pub(crate) fn exp_sum_row<T: Float>(x: &[T], m: T) -> T {
    let mut acc = [T::ZERO; 8];
    let chunks = x.chunks_exact(8);
    let mut s = T::ZERO;
    for &v in chunks.remainder() {
        s += (v - m).exp();
    }
    for c in chunks {
        for l in 0..8 {
            acc[l] += (c[l] - m).exp();
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + s
}

/// In place `x[i] = e^(x[i] - m)`; returns their sum.
pub(crate) fn exp_row<T: Float>(x: &mut [T], m: T) -> T {
    let mut sum = T::ZERO;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    sum
}

/// RoPE on one row's halves (all of one length): `y1 = x1 c - x2 s`, `y2 = x2 c + x1 s`; with `inverse`
/// (the backward) the negative angle, `y1 = x1 c + x2 s`, `y2 = x2 c - x1 s`.
pub(crate) fn rotate<T: Float>(y1: &mut [T], y2: &mut [T], x1: &[T], x2: &[T], c: &[T], s: &[T], inverse: bool) {
    for i in 0..y1.len() {
        if inverse {
            y1[i] = x1[i] * c[i] + x2[i] * s[i];
            y2[i] = x2[i] * c[i] - x1[i] * s[i];
        } else {
            y1[i] = x1[i] * c[i] - x2[i] * s[i];
            y2[i] = x2[i] * c[i] + x1[i] * s[i];
        }
    }
}

/// `y[i] = x[i] · r · w[i]` (equal lengths).
pub(crate) fn scale_mul<T: Float>(y: &mut [T], x: &[T], w: &[T], r: T) {
    for ((yv, &xv), &wv) in y.iter_mut().zip(x).zip(w) {
        *yv = xv * r * wv;
    }
}

/// `y = silu(a) · u` (equal lengths).
pub(crate) fn silu_mul<T: Float>(y: &mut [T], a: &[T], u: &[T]) {
    for ((yv, &av), &uv) in y.iter_mut().zip(a).zip(u) {
        *yv = av / (T::ONE + (-av).exp()) * uv;
    }
}

/// SwiGLU's backward: `da = g · u · σ(a) · (1 + a (1 - σ(a)))`, `du = g · silu(a)` (equal lengths).
pub(crate) fn swiglu_grad<T: Float>(da: &mut [T], du: &mut [T], a: &[T], u: &[T], g: &[T]) {
    for i in 0..da.len() {
        let (av, uv, gv) = (a[i], u[i], g[i]);
        let s = T::ONE / (T::ONE + (-av).exp());
        da[i] = gv * uv * (s * (av * (T::ONE - s) + T::ONE));
        du[i] = gv * (av / (T::ONE + (-av).exp()));
    }
}
