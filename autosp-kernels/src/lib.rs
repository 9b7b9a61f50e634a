//! autosp-kernels: autosp's heavy ops, each a tape op with a hand-written backward and a plain function on
//! candle tensors: CPU flash attention ([`flash`], on the tape as [`FlashAttention`]), fused RMSNorm / RoPE /
//! SwiGLU ([`fused`]), the chunked linear + cross-entropy ([`chunked_loss`]), the chunked SwiGLU MLP
//! ([`chunked_mlp`]), and sequence-parallel attention:
//! Ulysses, Ring and hybrid ([`sp`]). Each op's public function runs its fast CPU kernel on CPU tensors and
//! its device-generic twin ([`generic`], candle tensor ops only) elsewhere, as [`dispatch`] chooses.

pub mod attention_op;
pub mod chunked_loss;
pub mod chunked_mlp;
pub mod dispatch;
pub mod error;
pub mod flash;
pub mod fused;
pub mod generic;
mod running_sum;
pub mod sp;
mod vector;

/// The vector path the CPU kernels run on (AVX-512, AVX2+FMA, NEON, scalar) and the `AUTOSP_SIMD` switch.
pub use autosp_core::simd;

pub use attention_op::{flash_attention, FlashAttention, FlashAttentionOp};
pub use chunked_loss::{
    chunked_cross_entropy, chunked_cross_entropy_backward, chunked_cross_entropy_forward, ChunkedCrossEntropy,
};
pub use chunked_mlp::{chunked_mlp, chunked_mlp_backward, chunked_mlp_forward, ChunkedSwiGluMlp};
pub use dispatch::{kernels, set_kernels, Kernels};
pub use error::{Error, Result};
pub use flash::{flash_attention_backward, flash_attention_forward, flash_attention_output, MAX_HEAD_DIM};
pub use sp::{HybridAttention, RingAttention, RingLayout, SeqLayout, SpError, UlyssesAttention};
