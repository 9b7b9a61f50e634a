//! Attention forward on CUDA through candle-flash-attn (feature `flash-attn`), for inference: the one place
//! "flash" names a GPU kernel.
//!
//! candle-flash-attn 0.11 computes the output only: its `flash_attn` computes the log-sum-exp internally but
//! does not return it, has no backward, takes f16/bf16, and uses our layout (`[batch, seq, heads, head_dim]`,
//! GQA by fewer kv heads), so no transpose is needed. Hence it serves
//! `attention_output` (and `LocalAttention::forward_output` on inputs that take no gradient) when
//! `flash_attn_plan.rs` has a plan for the inputs; everything else on CUDA (the LSE, the backward, f32/f64,
//! masks it cannot express) runs the device-generic kernel (`generic.rs`).

use autosp_core::ops::AttentionSpec;
use candle_core::Tensor;

use super::flash_attn_plan::FlashAttnMask;
use crate::Result;

/// Attention output on CUDA with the planned `mask`: `q: [batch, q_len, heads, head_dim]`, `k, v: [batch,
/// k_len, kv_heads, head_dim]`, all f16 or all bf16 on one CUDA device (the plan and the caller's checks
/// ensured it). Returns `o: [batch, q_len, heads, head_dim]` in q's dtype on q's device.
pub(crate) fn forward_output(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    mask: FlashAttnMask,
) -> Result<Tensor> {
    let scale = spec.scale_for(q.dims()[3]) as f32;
    // candle-flash-attn reads strides but needs the last dimension contiguous; contiguous() copies only when
    // the tensor is not already.
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let o = match mask {
        FlashAttnMask::Full => candle_flash_attn::flash_attn(&q, &k, &v, scale, false)?,
        FlashAttnMask::Window { left, right } => {
            candle_flash_attn::flash_attn_windowed(&q, &k, &v, scale, left, Some(right))?
        }
    };
    Ok(o)
}
