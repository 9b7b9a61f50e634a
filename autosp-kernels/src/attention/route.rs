//! Which kernel serves an attention call, decided here and only here: the CPU flash kernel for CPU tensors
//! whose head dimension it takes (unless the generic kernels are forced, `autosp_core::dispatch`), the
//! device-generic kernel everywhere else (CUDA, Metal, forced CPU, larger heads); and, with feature
//! `flash-attn`, candle-flash-attn for the inference output on CUDA when `flash_attn_plan.rs` has a plan for
//! the inputs (f16/bf16, its head dimensions, an expressible mask).

use autosp_core::dispatch::{select_where, Route};
use autosp_core::ops::AttentionSpec;
use candle_core::{DeviceLocation, Tensor};

#[cfg(feature = "flash-attn")]
use super::flash_attn_plan::{self, FlashAttnMask};

/// The largest head dimension the CPU flash kernel takes; larger heads run on the device-generic kernel.
pub const CPU_MAX_HEAD_DIM: usize = 256;

/// The kernel that serves a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    /// The CPU flash kernel (host slices, on the vector path of `autosp_core::simd`).
    Cpu,
    /// The device-generic kernel: candle tensor ops only, any device.
    Generic,
    /// candle-flash-attn with this mask (CUDA, output only).
    #[cfg(feature = "flash-attn")]
    FlashAttn(FlashAttnMask),
}

/// A candle-flash-attn plan, in builds that have it.
#[cfg(feature = "flash-attn")]
type Plan = FlashAttnMask;
#[cfg(not(feature = "flash-attn"))]
type Plan = std::convert::Infallible;

/// The routing rule on its own (a pure function, tested without a GPU): `selected` is the dispatch's route
/// for q, and `plan` the candle-flash-attn plan when the caller wants the output only and has one.
#[cfg_attr(not(feature = "flash-attn"), allow(unused_variables))]
fn route(selected: Route, location: DeviceLocation, plan: Option<Plan>) -> Backend {
    #[cfg(feature = "flash-attn")]
    if let (DeviceLocation::Cuda { .. }, Some(mask)) = (location, plan) {
        return Backend::FlashAttn(mask);
    }
    match selected {
        Route::Cpu => Backend::Cpu,
        Route::Generic => Backend::Generic,
    }
}

/// The backend for the forward (with the LSE) or backward of q (head dimension `head_dim`).
pub(crate) fn backend(q: &Tensor, head_dim: usize) -> Backend {
    route(select_where(q, head_dim <= CPU_MAX_HEAD_DIM), q.device().location(), None)
}

/// The backend for the attention output alone (inference): as [`backend`], and candle-flash-attn for CUDA
/// tensors it has a plan for (feature `flash-attn`). k and v share q's dtype (checked by the door).
#[cfg_attr(not(feature = "flash-attn"), allow(unused_variables))]
pub(crate) fn output_backend(q: &Tensor, k_len: usize, spec: &AttentionSpec) -> Backend {
    let head_dim = q.dims().last().copied().unwrap_or(0);
    #[cfg(feature = "flash-attn")]
    if q.device().is_cuda() {
        if let Some(mask) = flash_attn_plan::plan(spec, q.dtype(), q.dims(), k_len) {
            return route(Route::Generic, q.device().location(), Some(mask));
        }
    }
    backend(q, head_dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CUDA: DeviceLocation = DeviceLocation::Cuda { gpu_id: 0 };

    /// A CUDA location needs no GPU to construct: the routing is checked in every build.
    #[test]
    fn the_dispatch_route_decides_without_a_plan() {
        assert_eq!(route(Route::Cpu, DeviceLocation::Cpu, None), Backend::Cpu);
        assert_eq!(route(Route::Generic, DeviceLocation::Cpu, None), Backend::Generic);
        assert_eq!(route(Route::Generic, CUDA, None), Backend::Generic);
    }

    #[cfg(feature = "flash-attn")]
    #[test]
    fn cuda_output_goes_to_candle_flash_attn_when_it_has_a_plan() {
        let mask = FlashAttnMask::Window { left: None, right: 0 };
        assert_eq!(route(Route::Generic, CUDA, Some(mask)), Backend::FlashAttn(mask));
        // A plan never moves a CPU or Metal call.
        assert_eq!(route(Route::Cpu, DeviceLocation::Cpu, Some(mask)), Backend::Cpu);
        assert_eq!(route(Route::Generic, DeviceLocation::Metal { gpu_id: 0 }, Some(mask)), Backend::Generic);
    }
}
