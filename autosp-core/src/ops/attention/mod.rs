//! Attention's contract: the [`AttentionSpec`] every attention kernel takes (mask, scale, position offsets;
//! the one definition of which keys a query sees), the shape checks they all share, the layout conversions
//! between autosp's sequence-major layout and the heads-major one of batched matmuls, and a naive attention
//! that materialises the scores: the test reference for every fast kernel (CPU flash, generic, Ulysses,
//! Ring), and a tape op of kind attention.
//!
//! Layout everywhere: `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`,
//! output `o: [batch, q_len, heads, head_dim]`, `lse: [batch, heads, q_len]` (f32, or f64 for f64 inputs).
//! Query head `h` reads kv head `h / (heads / kv_heads)` (GQA/MQA).

mod documents;
mod naive;
mod spec;

pub use documents::{Documents, DocumentsError};
pub use naive::{naive_attention, naive_attention_backward, naive_attention_forward, NaiveAttention};
pub use spec::{AttentionDims, AttentionSpec, Visibility};

use candle_core::{DType, Tensor};

use crate::{Op, Result, Tape, Value};

/// `x: [b, n, heads, d]` as `[b, heads, n, d]`, contiguous, in `dtype` (one copy at most).
pub fn heads_major(x: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(x.transpose(1, 2)?.to_dtype(dtype)?.contiguous()?)
}

/// `x: [b, heads, n, d]` back to `[b, n, heads, d]`, contiguous, in `dtype`.
pub fn seq_major(x: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(x.transpose(1, 2)?.contiguous()?.to_dtype(dtype)?)
}

/// Records an attention op (inputs `q, k, v`; outputs `o, lse`, as every attention kernel's) on `tape` and
/// returns `(o, lse)`.
pub fn apply_attention(
    tape: &Tape,
    op: std::sync::Arc<dyn Op>,
    q: &Value,
    k: &Value,
    v: &Value,
) -> Result<(Value, Value)> {
    let mut out = tape.apply_arc(op, &[q, k, v])?;
    let lse = out.pop().expect("two outputs");
    Ok((out.pop().expect("two outputs"), lse))
}
