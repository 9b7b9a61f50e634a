//! The RMSNorms of a Llama-family model through autosp-kernels' fused kernel, with the family's scale
//! (`offset + weight`: Gemma's `1 + w`, see `autosp_core::nn::RmsNorm`).

use autosp_core::nn::RmsNorm;
use autosp_core::{Tape, Value};

/// RMSNorm through the fused kernel (scale `offset + weight`, [`RmsNorm::scale`]): `x: [.., d]` -> `[.., d]`.
pub(crate) fn fused_norm(tape: &Tape, norm: &RmsNorm, x: &Value) -> autosp_core::Result<Value> {
    autosp_kernels::rms_norm::rms_norm(tape, x, &norm.scale(tape)?, norm.eps)
}
