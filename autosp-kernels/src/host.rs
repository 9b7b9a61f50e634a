//! The CPU kernels' access to candle's CPU storage: a tensor's elements read in place as a slice (read-locked
//! for as long as the kernel reads them), and the results handed back as CPU tensors. Only the CPU kernels
//! (`cpu.rs` of each op) use it; the doors send every other device to the generic kernels first.

use candle_core::{Device, Layout, Shape, Storage, StorageRef, Tensor, WithDType};

use crate::{Error, Result};

/// A CPU tensor's storage, read-locked for as long as the kernel reads it, and its layout.
pub(crate) struct Host<'a> {
    guard: StorageRef<'a>,
    layout: Layout,
}

impl<'a> Host<'a> {
    /// The storage of `t` (called `name` in errors of `op`); [`Error::NotCpu`] when `t` is on another device.
    pub fn new(op: &'static str, name: &'static str, t: &'a Tensor) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        if !matches!(&*guard, Storage::Cpu(_)) {
            return Err(Error::NotCpu { op, name, device: format!("{:?}", t.device().location()) });
        }
        Ok(Self { guard, layout: layout.clone() })
    }

    /// The whole storage as `T` and the tensor's layout (for kernels that follow strides).
    pub fn strided<T: WithDType>(&self) -> Result<(&[T], &Layout)> {
        match &*self.guard {
            Storage::Cpu(cpu) => Ok((cpu.as_slice::<T>()?, &self.layout)),
            _ => unreachable!("Host::new checked the device"),
        }
    }

    /// The elements of a contiguous tensor in row-major order (make it contiguous first).
    pub fn slice<T: WithDType>(&self) -> Result<&[T]> {
        let (all, layout) = self.strided::<T>()?;
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            autosp_core::Error::Internal(format!("a CPU kernel was handed a non-contiguous tensor {:?}", layout))
        })?;
        Ok(&all[start..end])
    }
}

/// A CPU tensor of `shape` from `data`.
pub(crate) fn tensor_from<T: WithDType>(data: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// Rows per rayon task: enough work per task to amortise scheduling, small enough to balance two or more cores.
pub(crate) fn rows_per_task(row_len: usize) -> usize {
    (16384 / row_len.max(1)).max(1)
}
