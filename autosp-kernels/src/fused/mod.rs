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

use autosp_core::{Error, Result};

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
