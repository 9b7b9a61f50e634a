//! Attention forward on CUDA through candle-flash-attn (feature `cuda`), for inference.
//!
//! candle-flash-attn 0.11 computes the output only: its `flash_attn` computes the log-sum-exp internally but
//! does not return it, has no backward, takes f16/bf16, and uses our layout (`[batch, seq, heads, head_dim]`,
//! GQA by fewer kv heads), so no transpose is needed. Hence, on CUDA:
//! - [`flash_attention_output`](super::flash_attention_output) (and `Attention::forward_output`) return `o`;
//! - asking for the LSE (`flash_attention_forward`, `Attention::forward`, the tape op) is
//!   [`Error::CudaLse`](crate::Error::CudaLse): no placeholder LSE is ever made up;
//! - asking for a gradient (`flash_attention_backward`, or a recording tape whose inputs take a gradient) is
//!   [`Error::CudaBackward`](crate::Error::CudaBackward).
//!
//! Masks map as `cuda_plan.rs` says; f32 inputs are refused rather than silently rounded to bf16.

use autosp_core::ops::AttentionSpec;
use candle_core::Tensor;

use super::cuda_plan::{check_cuda_inputs, flash_attn_mask, FlashAttnMask};
use crate::{Error, Result};

/// Attention output on CUDA: `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads,
/// head_dim]`, all f16 or all bf16 on one CUDA device, head_dim a multiple of 8 up to 512. Returns
/// `o: [batch, q_len, heads, head_dim]` in q's dtype on q's device.
pub(crate) fn forward_output(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
) -> Result<Tensor> {
    let dims = spec.dims(op, q, k, v)?;
    check_cuda_inputs(op, q.dtype(), q.dims())?;
    for (name, t) in [("k", k), ("v", v)] {
        if !t.device().same_device(q.device()) {
            return Err(Error::DeviceMismatch {
                op,
                name,
                got: format!("{:?}", t.device().location()),
                want: format!("{:?}", q.device().location()),
            });
        }
        if t.dtype() != q.dtype() {
            return Err(Error::DTypeMismatch { op, name, got: t.dtype(), want: q.dtype() });
        }
    }
    let mask = flash_attn_mask(op, spec, dims.q_len, dims.k_len)?;
    let scale = spec.scale_for(dims.head_dim) as f32;
    // candle-flash-attn reads strides but needs the last dimension contiguous; contiguous() copies only when
    // the tensor is not already.
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let o = match mask {
        FlashAttnMask::Full => candle_flash_attn::flash_attn(&q, &k, &v, scale, false)?,
        FlashAttnMask::Window { right } => {
            candle_flash_attn::flash_attn_windowed(&q, &k, &v, scale, None, Some(right))?
        }
    };
    Ok(o)
}
