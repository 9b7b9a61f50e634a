//! Where a flash-attention call runs: the CPU kernel, or with feature `cuda` candle-flash-attn; and the typed
//! error for a device this build cannot run (a CUDA tensor without the feature names `--features cuda`).

use candle_core::{DeviceLocation, Tensor};

use crate::{Error, Result};

/// The kernel that serves a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    /// The CPU flash kernel of this module.
    Cpu,
    /// candle-flash-attn (forward only, no LSE).
    #[cfg(feature = "flash-attn")]
    Cuda,
}

/// The backend for a tensor at `location`; `name` is the tensor's name in errors.
pub(crate) fn backend_at(op: &'static str, name: &'static str, location: DeviceLocation) -> Result<Backend> {
    match location {
        DeviceLocation::Cpu => Ok(Backend::Cpu),
        #[cfg(feature = "flash-attn")]
        DeviceLocation::Cuda { .. } => Ok(Backend::Cuda),
        #[cfg(not(feature = "flash-attn"))]
        DeviceLocation::Cuda { .. } => Err(Error::CudaFeature { op, name, device: format!("{location:?}") }),
        DeviceLocation::Metal { .. } => Err(Error::NotCpu { op, name, device: format!("{location:?}") }),
    }
}

/// The backend for `q, k, v`: q's, once k and v are on the same kind of device.
pub(crate) fn backend(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Backend> {
    let b = backend_at(op, "q", q.device().location())?;
    for (name, t) in [("k", k), ("v", v)] {
        if backend_at(op, name, t.device().location())? != b {
            return Err(Error::DeviceMismatch {
                op,
                name,
                got: format!("{:?}", t.device().location()),
                want: format!("{:?}", q.device().location()),
            });
        }
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_runs_the_cpu_kernel_and_metal_is_refused() {
        assert_eq!(backend_at("t", "q", DeviceLocation::Cpu).unwrap(), Backend::Cpu);
        let e = backend_at("t", "k", DeviceLocation::Metal { gpu_id: 0 }).unwrap_err();
        assert!(matches!(e, Error::NotCpu { name: "k", .. }), "{e}");
    }

    /// A CUDA location needs no GPU to construct: the routing decision is checked in both builds.
    #[cfg(not(feature = "flash-attn"))]
    #[test]
    fn cuda_without_the_feature_says_to_build_with_it() {
        let e = backend_at("flash_attention_forward", "q", DeviceLocation::Cuda { gpu_id: 1 }).unwrap_err();
        assert!(matches!(e, Error::CudaFeature { name: "q", .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("--features cuda") && msg.contains("gpu_id: 1"), "{msg}");
    }

    #[cfg(feature = "flash-attn")]
    #[test]
    fn cuda_with_the_feature_goes_to_candle_flash_attn() {
        assert_eq!(backend_at("t", "q", DeviceLocation::Cuda { gpu_id: 0 }).unwrap(), Backend::Cuda);
    }
}
