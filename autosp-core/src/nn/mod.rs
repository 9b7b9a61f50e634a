//! Building blocks for models on the tape, each a [`Module`](crate::module::Module) that owns its parameters:
//! linear layers (with an optional LoRA adapter), RMSNorm and embeddings.

pub mod embedding;
pub mod linear;
pub mod lora;
pub mod rms_norm;

pub use embedding::Embedding;
pub use linear::Linear;
pub use lora::LoraAdapter;
pub use rms_norm::RmsNorm;
