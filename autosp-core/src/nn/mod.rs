//! Building blocks for models on the tape, each a [`Module`](crate::module::Module) that owns its parameters:
//! linear layers, RMSNorm and embeddings.

pub mod embedding;
pub mod linear;
pub mod rms_norm;

pub use embedding::Embedding;
pub use linear::Linear;
pub use rms_norm::RmsNorm;
