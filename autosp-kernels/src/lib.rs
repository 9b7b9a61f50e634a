//! autosp-kernels
//!
//! Fused RMSNorm / RoPE / SwiGLU ([`fused`]) and the chunked linear + cross-entropy ([`chunked_loss`]), each a
//! tape op with a hand-written backward and a plain function on candle tensors.

pub mod chunked_loss;
pub mod fused;

pub use chunked_loss::{
    chunked_cross_entropy, chunked_cross_entropy_backward, chunked_cross_entropy_forward, ChunkedCrossEntropy,
};
