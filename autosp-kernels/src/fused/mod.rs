//! Fused pointwise and normalisation ops (RMSNorm, RoPE, SwiGLU): each reads its inputs once and writes its
//! output once, straight on candle's CPU slices, rows split across threads with rayon. Each is a tape op with
//! a hand-written backward and a plain function on tensors for inference. f32 and f64 compute natively; bf16
//! and f16 are converted to f32, computed, and converted back. On any other device (or with the generic kernels
//! forced, [`crate::dispatch`]) each public function runs its device-generic twin in [`crate::generic`].

pub mod rms_norm;
pub mod rope;
pub mod swiglu;

pub use rms_norm::{rms_norm, rms_norm_backward, rms_norm_forward, rms_norm_recip, FusedRmsNorm};
pub use rope::{rope, rope_backward, rope_forward, FusedRope};
pub use swiglu::{swiglu, swiglu_backward, swiglu_forward, FusedSwiGlu};

use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

use candle_core::{DType, Device, Layout, Shape, Storage, Tensor, WithDType};

use autosp_core::simd::SimdPath;
use autosp_core::{Error, Result};

use crate::vector;

/// The float types the kernels compute in (f32 and f64).
pub trait Real:
    WithDType
    + Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// e^self.
    fn exp(self) -> Self;
    /// Natural log.
    fn ln(self) -> Self;

    // Row kernels on a vector path ([`SimdPath`]): the scalar formulas here are the reference (and f64's
    // only path); f32 runs the pulp kernels of `crate::vector` on AVX2+FMA / NEON (AVX-512 runs the AVX2
    // code) and these formulas on the scalar path.

    /// `sum(a[i] · b[i])` (equal lengths).
    fn dot_on(_path: SimdPath, a: &[Self], b: &[Self]) -> Self {
        dot(a, b)
    }

    /// The largest element of a non-empty row. With a NaN in the row the scalar formula skips it unless it
    /// comes first and the vector paths return NaN; either way the row's softmax is NaN.
    fn max_on(_path: SimdPath, row: &[Self]) -> Self {
        max_ref(row)
    }

    /// `sum(e^(x[i] - m))`.
    fn exp_sum_on(_path: SimdPath, x: &[Self], m: Self) -> Self {
        exp_sum_ref(x, m)
    }

    /// `out[i] = e^(x[i] - m)`; returns their sum (equal lengths).
    fn exp_row_on(_path: SimdPath, out: &mut [Self], x: &[Self], m: Self) -> Self {
        exp_row_ref(out, x, m)
    }

    /// RoPE on one row's halves (all of one length): `y1 = x1 c - x2 s`, `y2 = x2 c + x1 s`; with `inverse`
    /// (the backward) the negative angle, `y1 = x1 c + x2 s`, `y2 = x2 c - x1 s`.
    #[allow(clippy::too_many_arguments)]
    fn rotate_on(
        _path: SimdPath,
        y1: &mut [Self],
        y2: &mut [Self],
        x1: &[Self],
        x2: &[Self],
        c: &[Self],
        s: &[Self],
        inverse: bool,
    ) {
        rotate_ref(y1, y2, x1, x2, c, s, inverse)
    }

    /// `y[i] = x[i] · r · w[i]` (equal lengths).
    fn scale_mul_on(_path: SimdPath, y: &mut [Self], x: &[Self], w: &[Self], r: Self) {
        scale_mul_ref(y, x, w, r)
    }

    /// `y = silu(a) · u` (equal lengths).
    fn silu_mul_on(_path: SimdPath, y: &mut [Self], a: &[Self], u: &[Self]) {
        silu_mul_ref(y, a, u)
    }

    /// SwiGLU's backward: `da = g · u · σ(a) · (1 + a (1 - σ(a)))`, `du = g · silu(a)` (equal lengths).
    fn swiglu_grad_on(_path: SimdPath, da: &mut [Self], du: &mut [Self], a: &[Self], u: &[Self], g: &[Self]) {
        swiglu_grad_ref(da, du, a, u, g)
    }
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn dot_on(path: SimdPath, a: &[Self], b: &[Self]) -> Self {
        vector::dot(path, a, b).unwrap_or_else(|| dot(a, b))
    }
    fn max_on(path: SimdPath, row: &[Self]) -> Self {
        vector::max_row(path, row).unwrap_or_else(|| max_ref(row))
    }
    fn exp_sum_on(path: SimdPath, x: &[Self], m: Self) -> Self {
        vector::exp_sum_row(path, x, m).unwrap_or_else(|| exp_sum_ref(x, m))
    }
    fn exp_row_on(path: SimdPath, out: &mut [Self], x: &[Self], m: Self) -> Self {
        vector::exp_row(path, out, x, m).unwrap_or_else(|| exp_row_ref(out, x, m))
    }
    fn rotate_on(
        path: SimdPath,
        y1: &mut [Self],
        y2: &mut [Self],
        x1: &[Self],
        x2: &[Self],
        c: &[Self],
        s: &[Self],
        inverse: bool,
    ) {
        if vector::rotate(path, y1, y2, x1, x2, c, s, inverse).is_none() {
            rotate_ref(y1, y2, x1, x2, c, s, inverse)
        }
    }
    fn scale_mul_on(path: SimdPath, y: &mut [Self], x: &[Self], w: &[Self], r: Self) {
        if vector::scale_mul(path, y, x, w, r).is_none() {
            scale_mul_ref(y, x, w, r)
        }
    }
    fn silu_mul_on(path: SimdPath, y: &mut [Self], a: &[Self], u: &[Self]) {
        if vector::silu_mul(path, y, a, u).is_none() {
            silu_mul_ref(y, a, u)
        }
    }
    fn swiglu_grad_on(path: SimdPath, da: &mut [Self], du: &mut [Self], a: &[Self], u: &[Self], g: &[Self]) {
        if vector::swiglu_grad(path, da, du, a, u, g).is_none() {
            swiglu_grad_ref(da, du, a, u, g)
        }
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
}

/// The largest element of a non-empty row, scalar (the reference of [`Real::max_on`]). A NaN is skipped
/// unless it comes first; the vector paths return NaN for any NaN. Either way the softmax of the row is
/// NaN (`e^(NaN - m)`), so the loss and gradient are too.
fn max_ref<T: Real>(row: &[T]) -> T {
    let mut m = row[0];
    for &v in row {
        if v > m {
            m = v;
        }
    }
    m
}

/// `sum(e^(x[i] - m))` with eight accumulators, scalar (the reference of [`Real::exp_sum_on`]).
fn exp_sum_ref<T: Real>(x: &[T], m: T) -> T {
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

/// `out[i] = e^(x[i] - m)` and their sum, scalar (the reference of [`Real::exp_row_on`]).
fn exp_row_ref<T: Real>(out: &mut [T], x: &[T], m: T) -> T {
    let mut sum = T::ZERO;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v - m).exp();
        sum += *o;
    }
    sum
}

/// The scalar RoPE of one row's halves (the reference of [`Real::rotate_on`]).
fn rotate_ref<T: Real>(y1: &mut [T], y2: &mut [T], x1: &[T], x2: &[T], c: &[T], s: &[T], inverse: bool) {
    let half = y1.len();
    if inverse {
        for i in 0..half {
            y1[i] = x1[i] * c[i] + x2[i] * s[i];
            y2[i] = x2[i] * c[i] - x1[i] * s[i];
        }
    } else {
        for i in 0..half {
            y1[i] = x1[i] * c[i] - x2[i] * s[i];
            y2[i] = x2[i] * c[i] + x1[i] * s[i];
        }
    }
}

/// The scalar `y[i] = x[i] · r · w[i]` (the reference of [`Real::scale_mul_on`]).
fn scale_mul_ref<T: Real>(y: &mut [T], x: &[T], w: &[T], r: T) {
    for ((yv, &xv), &wv) in y.iter_mut().zip(x).zip(w) {
        *yv = xv * r * wv;
    }
}

/// The scalar `y = silu(a) · u` (the reference of [`Real::silu_mul_on`]).
fn silu_mul_ref<T: Real>(y: &mut [T], a: &[T], u: &[T]) {
    for ((yv, &av), &uv) in y.iter_mut().zip(a).zip(u) {
        *yv = av / (T::ONE + (-av).exp()) * uv;
    }
}

/// The scalar SwiGLU backward (the reference of [`Real::swiglu_grad_on`]).
fn swiglu_grad_ref<T: Real>(da: &mut [T], du: &mut [T], a: &[T], u: &[T], g: &[T]) {
    for i in 0..da.len() {
        let (av, uv, gv) = (a[i], u[i], g[i]);
        let s = T::ONE / (T::ONE + (-av).exp());
        da[i] = gv * uv * (s * (av * (T::ONE - s) + T::ONE));
        du[i] = gv * (av / (T::ONE + (-av).exp()));
    }
}

/// Runs `f` on the CPU slice behind `t` (the whole storage) and `t`'s layout.
pub(crate) fn with_cpu_slice<T: WithDType, R>(
    t: &Tensor,
    op: &'static str,
    name: &'static str,
    f: impl FnOnce(&[T], &Layout) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => f(cpu.as_slice::<T>()?, layout),
        _ => Err(Error::InvalidArgument {
            op,
            msg: format!(
                "{name} is on {:?}; this kernel runs on the CPU: move it with `to_device(&Device::Cpu)`",
                t.device()
            ),
        }),
    }
}

/// Runs `f` on the elements of `t` in row-major order as one slice (copying only when `t` is not contiguous).
pub(crate) fn with_contiguous<T: WithDType, R>(
    t: &Tensor,
    op: &'static str,
    name: &'static str,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    let t = t.contiguous()?;
    let n = t.elem_count();
    with_cpu_slice(&t, op, name, |data: &[T], layout| f(&data[layout.start_offset()..layout.start_offset() + n]))
}

/// A CPU tensor of `shape` from `data`.
pub(crate) fn tensor_from<T: WithDType>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// The dtype a kernel computes in for inputs of `dtype`: f32 and f64 as they are, bf16/f16 in f32.
pub(crate) fn compute_dtype(op: &'static str, dtype: DType) -> Result<DType> {
    match dtype {
        DType::F32 | DType::F64 => Ok(dtype),
        DType::BF16 | DType::F16 => Ok(DType::F32),
        other => Err(Error::InvalidArgument {
            op,
            msg: format!("dtype {other:?} is not supported; use f32, f64, bf16 or f16"),
        }),
    }
}

/// Rows per rayon task: enough work per task to amortise scheduling, small enough to balance two or more cores.
pub(crate) fn rows_per_task(row_len: usize) -> usize {
    (16384 / row_len.max(1)).max(1)
}

/// `sum(a[i] * b[i])` with eight independent accumulators so that the compiler vectorises it.
#[inline]
pub(crate) fn dot<T: Real>(a: &[T], b: &[T]) -> T {
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

/// A typed shape error (autosp-core's [`ShapeMismatch`](autosp_core::ShapeMismatch)) naming both shapes.
pub(crate) fn mismatch(
    op: &'static str,
    lhs_name: &'static str,
    lhs: &[usize],
    rhs_name: &'static str,
    rhs: &[usize],
    hint: String,
) -> Error {
    Error::ShapeMismatch(Box::new(autosp_core::ShapeMismatch {
        op,
        lhs_name,
        lhs: lhs.to_vec(),
        rhs_name,
        rhs: rhs.to_vec(),
        hint,
    }))
}
