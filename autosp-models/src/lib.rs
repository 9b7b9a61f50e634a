//! autosp-models: Llama-family checkpoints (llama, mistral, qwen2, qwen3, phi3, SmolLM) for autosp: HF `config.json`,
//! safetensors weights (single or sharded, memory-mapped), hub resolution (cache first, offline aware),
//! HF-compatible saving, tiny random checkpoints, GGUF import and tokenizers.

pub mod chat;
pub mod config;
pub mod error;
pub mod fused;
pub mod gguf;
pub mod gguf_names;
pub mod gguf_rope;
pub mod gguf_tokenizer;
pub mod hub;
pub mod llama;
pub mod peft;
pub mod rng;
pub mod rope;
pub mod save;
pub mod tiny;
pub mod tokenizer;
pub mod weights;

pub use chat::ChatTemplate;
pub use config::{LayerType, LlamaConfig, ModelType, RopeScaling};
pub use error::{Error, Result};
pub use gguf::{config_from_gguf, gguf_tokenizer, gguf_tokenizer_and_template, import_gguf, GgufModel};
pub use hub::{resolve_model, HubOptions, ModelSpec, ResolvedModel};
pub use llama::{GenerateConfig, Generation, KvCache, LlamaModel, ModelError, ModelResult, Sampling};
pub use peft::{is_adapter, load_adapter, save_adapter, Adapter};
pub use rope::{
    default_inv_freq, rope_frequencies, unscaled_window_warning, LongRope, RopeExtended, RopeExtension,
    RopeFrequencies, Yarn,
};
pub use save::{save_model, SaveOptions};
pub use tiny::{random_weights, write_tiny, TinySpec};
pub use tokenizer::{load_tokenizer, Tokenizer};
pub use weights::{load_dir, load_weights, weight_files, WeightFiles};
