//! The tape's ops, one family per file, each with a hand-written backward. Every public function takes the
//! tape first, then [`Value`](crate::Value)s, and records itself when the tape records.

pub mod activation;
pub mod attention;
pub mod binary;
pub mod broadcast;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
mod embedding_grad;
pub mod linear;
pub mod reduce;
pub mod rms_norm;
pub mod rope;
pub mod scalar;
pub mod shard_param;
pub mod sharded_embedding;
pub mod softmax;
pub mod view;

pub use activation::{exp, gelu_tanh, log, silu};
pub use attention::{naive_attention, AttentionSpec, Documents, DocumentsError};
pub use binary::{add, div, mul, sub};
pub use cross_entropy::{cross_entropy, IGNORE_INDEX};
pub use dropout::dropout;
pub use embedding::embedding;
pub use linear::{linear, matmul};
pub use reduce::{mean, sum, sum_all};
pub use rms_norm::rms_norm;
pub use rope::{rope, rope_tables, rope_tables_scaled};
pub use scalar::{affine, powf, scale};
pub use sharded_embedding::sharded_embedding;
pub use softmax::softmax_last_dim;
pub use view::{cat, contiguous, narrow, reshape, transpose};
