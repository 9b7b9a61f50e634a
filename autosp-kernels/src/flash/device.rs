//! Where a flash-attention call runs, decided here and only here: the fast CPU kernel for CPU tensors (unless
//! the generic path is forced, [`crate::dispatch`], or the head dimension is one the CPU kernel does not take),
//! the device-generic kernel ([`crate::generic::attention`]) everywhere else (CUDA, Metal, forced CPU); and,
//! with feature `flash-attn`, candle-flash-attn for the inference output on CUDA when `cuda_plan.rs` has a plan
//! for the inputs (f16/bf16, its head dimensions, an expressible mask).

use autosp_core::ops::AttentionSpec;
use candle_core::{DeviceLocation, Tensor};

#[cfg(feature = "flash-attn")]
use super::cuda_plan::{self, FlashAttnMask};
use super::MAX_HEAD_DIM;
use crate::{Error, Result};

/// The kernel that serves a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    /// The fast CPU flash kernel of this module (host slices, on the vector path of [`crate::simd`]).
    FastCpu,
    /// The device-generic kernel: candle tensor ops only, any device.
    Generic,
    /// candle-flash-attn with this mask (CUDA, output only).
    #[cfg(feature = "flash-attn")]
    FlashAttn(FlashAttnMask),
}

/// The routing rule on its own (a pure function, tested without a GPU): `fast_cpu` is
/// [`crate::dispatch::use_fast_cpu`]'s answer for q, `head_dim` q's head dimension, and `flash_attn` the
/// candle-flash-attn plan when the caller wants the output only and q is on CUDA.
#[cfg_attr(not(feature = "flash-attn"), allow(unused_variables))]
fn route(fast_cpu: bool, location: DeviceLocation, head_dim: usize, flash_attn: Option<Plan>) -> Backend {
    if fast_cpu && matches!(location, DeviceLocation::Cpu) && head_dim <= MAX_HEAD_DIM {
        return Backend::FastCpu;
    }
    #[cfg(feature = "flash-attn")]
    if let (DeviceLocation::Cuda { .. }, Some(mask)) = (location, flash_attn) {
        return Backend::FlashAttn(mask);
    }
    Backend::Generic
}

/// A candle-flash-attn plan, in builds that have it.
#[cfg(feature = "flash-attn")]
type Plan = FlashAttnMask;
#[cfg(not(feature = "flash-attn"))]
type Plan = std::convert::Infallible;

/// The backend for the forward (with the LSE) or backward of `q, k, v`, once k and v are on q's device.
pub(crate) fn backend(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Backend> {
    same_device(op, q, k, v)?;
    let head_dim = q.dims().last().copied().unwrap_or(0);
    Ok(route(crate::dispatch::use_fast_cpu(q), q.device().location(), head_dim, None))
}

/// The backend for the attention output alone (inference): as [`backend`], and candle-flash-attn for CUDA
/// tensors it has a plan for (feature `flash-attn`).
#[cfg_attr(not(feature = "flash-attn"), allow(unused_variables))]
pub(crate) fn output_backend(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
) -> Result<Backend> {
    same_device(op, q, k, v)?;
    let head_dim = q.dims().last().copied().unwrap_or(0);
    #[cfg(feature = "flash-attn")]
    let plan = if q.device().is_cuda() && k.rank() == 4 && k.dtype() == q.dtype() && v.dtype() == q.dtype() {
        cuda_plan::plan(spec, q.dtype(), q.dims(), k.dims()[1])
    } else {
        None
    };
    #[cfg(not(feature = "flash-attn"))]
    let plan = None;
    Ok(route(crate::dispatch::use_fast_cpu(q), q.device().location(), head_dim, plan))
}

/// [`Error::DeviceMismatch`] unless k and v are on q's device.
pub(crate) fn same_device(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    for (name, t) in [("k", k), ("v", v)] {
        check_device(op, name, t, q)?;
    }
    Ok(())
}

/// [`Error::DeviceMismatch`] unless `t` (called `name`) is on q's device.
pub(crate) fn check_device(op: &'static str, name: &'static str, t: &Tensor, q: &Tensor) -> Result<()> {
    if !t.device().same_device(q.device()) {
        return Err(Error::DeviceMismatch {
            op,
            name,
            got: format!("{:?}", t.device().location()),
            want: format!("{:?}", q.device().location()),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CUDA: DeviceLocation = DeviceLocation::Cuda { gpu_id: 0 };
    const METAL: DeviceLocation = DeviceLocation::Metal { gpu_id: 0 };

    /// A CUDA or Metal location needs no GPU to construct: the routing is checked in every build.
    #[test]
    fn cpu_runs_the_fast_kernel_unless_forced_and_other_devices_the_generic_one() {
        assert_eq!(route(true, DeviceLocation::Cpu, 64, None), Backend::FastCpu);
        assert_eq!(route(true, DeviceLocation::Cpu, MAX_HEAD_DIM, None), Backend::FastCpu);
        // Forced generic, or a head_dim the CPU kernel does not take.
        assert_eq!(route(false, DeviceLocation::Cpu, 64, None), Backend::Generic);
        assert_eq!(route(true, DeviceLocation::Cpu, MAX_HEAD_DIM + 1, None), Backend::Generic);
        // `use_fast_cpu` is false off the CPU; a stray `true` still never sends a GPU tensor to host slices.
        for fast in [false, true] {
            assert_eq!(route(fast, CUDA, 64, None), Backend::Generic);
            assert_eq!(route(fast, METAL, 64, None), Backend::Generic);
        }
    }

    #[cfg(feature = "flash-attn")]
    #[test]
    fn cuda_output_goes_to_candle_flash_attn_when_it_has_a_plan() {
        let mask = FlashAttnMask::Window { left: None, right: 0 };
        assert_eq!(route(false, CUDA, 64, Some(mask)), Backend::FlashAttn(mask));
        // A plan never moves a CPU or Metal call.
        assert_eq!(route(true, DeviceLocation::Cpu, 64, Some(mask)), Backend::FastCpu);
        assert_eq!(route(false, METAL, 64, Some(mask)), Backend::Generic);
    }
}
