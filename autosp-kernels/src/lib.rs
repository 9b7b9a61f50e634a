//! autosp-kernels: autosp's heavy ops. Today: CPU flash attention forward and backward as plain functions on
//! candle tensors ([`flash`]).

pub mod attention_op;
pub mod error;
pub mod flash;
pub mod sp;

pub use attention_op::{flash_attention, FlashAttention, FlashAttentionOp};
pub use error::{Error, Result};
pub use flash::{flash_attention_backward, flash_attention_forward, MAX_HEAD_DIM};
pub use sp::{HybridAttention, RingAttention, RingLayout, SeqLayout, SpError, UlyssesAttention};
