//! Reading a computed tensor back to the host, counted. On a GPU every such read waits for the device's queue
//! to drain (a host synchronisation): a training step that reads once per parameter or once per layer stalls
//! the device that many times. Every read of a tensor the training path computed goes through the functions
//! here, which count it on the calling thread (one count per call, whatever the device, so the count a CPU
//! test sees is the count a GPU run would pay); [`host_reads`] gives the count, and tests assert that a step
//! reads a constant number of times, independent of the number of parameters and layers.
//!
//! Data made on the host (token ids, flags built with `Device::Cpu`) and the CPU kernels' own reads of CPU
//! storage are not reads of device results and do not come here.

use std::cell::Cell;

use candle_core::{DType, Tensor, WithDType};

use crate::Result;

thread_local! {
    static READS: Cell<u64> = const { Cell::new(0) };
}

/// Reads of computed tensors back to the host on this thread so far (thread ranks count their own).
pub fn host_reads() -> u64 {
    READS.with(Cell::get)
}

/// Counts one host synchronisation made without a tensor read (the NCCL back end's header round copies its
/// headers to the host once per collective).
pub(crate) fn count() {
    READS.with(|c| c.set(c.get() + 1));
}

/// Every element of `t` (any shape), flattened, as `T` (one counted host read). `t` must already be of `T`'s
/// dtype.
pub fn read_vec<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    count();
    Ok(t.flatten_all()?.to_vec1::<T>()?)
}

/// Every element of `t` (any float or integer dtype), flattened, as f64 (one counted host read). The
/// conversion to f64 happens on the host: the device never sees f64 (Metal has none).
pub fn read_f64s(t: &Tensor) -> Result<Vec<f64>> {
    count();
    let flat = t.flatten_all()?;
    let host = flat.to_device(&candle_core::Device::Cpu)?;
    Ok(match host.dtype() {
        DType::F64 => host.to_vec1::<f64>()?,
        _ => host.to_dtype(DType::F64)?.to_vec1::<f64>()?,
    })
}

/// The one element of `t` (a scalar or a one-element tensor) as f64 (one counted host read).
pub fn read_f64(t: &Tensor) -> Result<f64> {
    let v = read_f64s(t)?;
    match v.as_slice() {
        [x] => Ok(*x),
        _ => Err(crate::Error::Internal(format!("read_f64: expected one element, got {} ({:?})", v.len(), t.dims()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn every_read_counts_once_on_its_own_thread() {
        let t = Tensor::new(&[1.5f32, 2.0], &Device::Cpu).unwrap();
        let before = host_reads();
        assert_eq!(read_f64s(&t).unwrap(), vec![1.5, 2.0]);
        assert_eq!(read_vec::<f32>(&t).unwrap(), vec![1.5, 2.0]);
        assert_eq!(read_f64(&t.narrow(0, 1, 1).unwrap()).unwrap(), 2.0);
        assert!(read_f64(&t).unwrap_err().to_string().contains("one element"));
        assert_eq!(host_reads() - before, 4);
        let other = std::thread::spawn(host_reads).join().unwrap();
        assert_eq!(other, 0, "another thread has its own count");
    }
}
