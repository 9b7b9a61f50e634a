//! autosp-kernels: autosp's heavy ops, one folder per op, each folder's `mod.rs` its one door: the public
//! functions on candle tensors, the tape op with its hand-written backward, the checks, and the choice of
//! kernel ([`dispatch`]): the fast CPU kernel (`cpu.rs`, host slices on the vector path of [`simd`]) for CPU
//! tensors, the device-generic one (`generic.rs`, candle tensor ops only: CUDA, Metal, or the CPU when forced)
//! everywhere else.
//!
//! - [`attention`]: attention forward and backward with the LSE (the CPU flash kernel, the generic kernel,
//!   candle-flash-attn for inference on CUDA), on the tape as [`AttentionOp`], the default attention slot
//!   [`LocalAttention`];
//! - [`rms_norm`], [`rope`], [`swiglu`]: the fused row ops;
//! - [`cross_entropy`]: the chunked linear + cross-entropy (no `[m, vocab]` logits ever);
//! - [`mlp`]: the chunked SwiGLU MLP (no `[n, f]` intermediates outlive a chunk);
//! - [`merge`]: the LSE merge of partial attention results (Ring attention's);
//! - [`sp`]: sequence-parallel attention, Ulysses, Ring and hybrid, over the doors above.
//!
//! Below the doors: `vector/` (the float types the CPU kernels compute in and every row and tile operation on
//! AVX-512, AVX2+FMA, NEON or the portable loops) and `host.rs` (CPU storage read in place). Which keys a
//! query sees is autosp-core's [`AttentionSpec`](autosp_core::ops::AttentionSpec); the dtypes each part
//! computes in are autosp-core's [`Precision`](autosp_core::Precision).

pub mod attention;
pub mod cross_entropy;
pub mod error;
mod host;
pub mod merge;
pub mod mlp;
pub mod rms_norm;
pub mod rope;
mod running_sum;
mod shape_error;
pub mod sp;
pub mod swiglu;
mod vector;

/// Which kernel serves a call (CPU or device-generic) and the `AUTOSP_KERNELS` switch.
pub use autosp_core::dispatch;
/// The vector path the CPU kernels run on (AVX-512, AVX2+FMA, NEON, scalar) and the `AUTOSP_SIMD` switch.
pub use autosp_core::simd;

pub use attention::{attention_backward, attention_forward, attention_output, AttentionOp, LocalAttention};
pub use cross_entropy::{
    chunked_cross_entropy, chunked_cross_entropy_backward, chunked_cross_entropy_forward, chunked_cross_entropy_param,
    sharded_head_logits, ChunkedCrossEntropyOp, ShardedHeadLoss,
};
pub use dispatch::{kernels, set_kernels, with_kernels, Kernels};
pub use error::{Error, Result};
pub use merge::RunningAttention;
pub use mlp::{chunked_mlp, chunked_mlp_backward, chunked_mlp_forward, ChunkedMlpOp};
pub use rms_norm::{rms_norm_backward, rms_norm_forward, rms_norm_recip, RmsNormOp};
pub use rope::{rope_backward, rope_forward, RopeOp};
pub use sp::{HybridAttention, RingAttention, RingLayout, SeqLayout, SpError, UlyssesAttention};
pub use swiglu::{swiglu_backward, swiglu_forward, SwiGluOp};
