//! The Llama-family model on the autosp tape: one file per part (attention, MLP, decoder layer, the model),
//! the KV cache, sampling and generation. The same code trains (on a recording tape) and infers (on an
//! inference tape); the compile step rewrites it through the module tree (attention and region slots).

pub mod attention;
pub mod block;
pub mod causal_lm;
pub mod error;
pub mod generate;
pub mod kv_cache;
mod lora;
pub mod mlp;
pub mod model;
mod norm;
pub mod sampling;

pub use attention::{LlamaAttention, RotaryTables};
pub use block::LlamaDecoderLayer;
pub use error::{ModelError, ModelResult};
pub use generate::{GenerateConfig, Generation};
pub use kv_cache::{KvCache, LayerKv};
pub use mlp::{Activation, LlamaMlp};
pub use model::{LlamaLayers, LlamaModel};
pub use sampling::{argmax, sample, SampleRng, Sampling};
