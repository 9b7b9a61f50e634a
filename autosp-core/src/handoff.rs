//! Tensors handed from one thread of a step to another (a gradient bucket to the reduction thread, a gathered
//! block to the step): on a CUDA device candle queues each thread's work on that thread's own stream, so a
//! tensor made by one thread is complete for another only once the maker's stream has reached it. The maker
//! records a [`HandOff`] with the tensor and the taker [`wait`](HandOff::wait)s on it before its first use (a
//! host wait on a CUDA event: the maker never blocks). On the CPU both are nothing: the tensor is complete
//! when the maker has it.

use candle_core::Device;

#[cfg(feature = "cuda")]
use crate::Error;
use crate::Result;

/// The work one thread had queued on its stream of a device when it handed a tensor over.
#[derive(Debug)]
pub struct HandOff {
    #[cfg(feature = "cuda")]
    event: Option<candle_core::cuda_backend::cudarc::driver::CudaEvent>,
}

impl HandOff {
    /// Marks the work this thread has queued on `device` so far (nothing to mark off CUDA).
    pub fn record(device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = device {
            let event = cuda.cuda_stream().record_event(None).map_err(|e| {
                Error::Internal(format!("recording a CUDA event to hand a tensor to another thread: {e:?}"))
            })?;
            return Ok(Self { event: Some(event) });
        }
        let _ = device;
        Ok(Self {
            #[cfg(feature = "cuda")]
            event: None,
        })
    }

    /// Waits (on the host) until the marked work is done, so that this thread's work may read what it made.
    pub fn wait(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(event) = &self.event {
            event.synchronize().map_err(|e| {
                Error::Internal(format!("waiting for the CUDA work of a tensor handed from another thread: {e:?}"))
            })?;
        }
        Ok(())
    }
}

/// Waits until the work this thread queued on `device` is done, before the thread hands what it made back
/// (the end of a communication thread's job); nothing off CUDA.
pub fn settle(device: &Device) -> Result<()> {
    HandOff::record(device)?.wait()
}
