//! [`ModelError`]: what can go wrong building, running or generating with a [`LlamaModel`](super::LlamaModel).
//! Checkpoint errors (config, safetensors, hub, GGUF) keep the crate's [`Error`](crate::Error) inside.

/// Errors of the Llama model: bad inputs (ids, positions, targets), weights that do not fit the config, and
/// the errors of the layers below (tape ops, candle, checkpoint loading).
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `ids` is not a `[batch, seq]` u32 tensor.
    #[error("ids have shape {dims:?} and dtype {dtype:?}; the model takes token ids as a [batch, seq] u32 tensor")]
    BadIds { dims: Vec<usize>, dtype: candle_core::DType },
    /// A token id is not below the vocabulary size.
    #[error("token id {id} at flat position {index} is out of range for a vocabulary of {vocab}; check the tokenizer matches the model")]
    TokenOutOfVocab { id: u32, index: usize, vocab: usize },
    /// The number of positions differs from the sequence length of `ids`.
    #[error("{positions} positions given for a sequence of {seq} tokens; pass one position per token")]
    PositionsMismatch { positions: usize, seq: usize },
    /// `targets` does not have one entry per token.
    #[error("targets have shape {dims:?}; the loss takes [batch * seq] = [{expected}] i64 targets (-100 to ignore)")]
    TargetsMismatch { dims: Vec<usize>, expected: usize },
    /// A weight the config needs is absent from the weights map.
    #[error("weight `{name}` (expected shape {expected:?}) is missing from the weights map")]
    MissingWeight { name: String, expected: Vec<usize> },
    /// A weight has a different shape from the one the config implies.
    #[error("weight `{name}` has shape {found:?}; the config expects {expected:?}")]
    WeightShape { name: String, expected: Vec<usize>, found: Vec<usize> },
    /// The weights map holds a tensor the config does not describe.
    #[error("weight `{name}` (shape {found:?}) is not part of this model's config; the config and weights disagree")]
    UnexpectedWeight { name: String, found: Vec<usize> },
    /// A KV cache was used with a different batch size, model or position than it was started with.
    #[error("KV cache mismatch: {0}")]
    Cache(String),
    /// A generation request that cannot run (empty prompt, bad sampling parameters, prompt too long).
    #[error("generation: {0}")]
    Generate(String),
    /// LoRA cannot be added, or an adapter does not fit the model.
    #[error("LoRA: {0}")]
    Lora(String),
    /// A tape op failed.
    #[error(transparent)]
    Core(#[from] autosp_core::Error),
    /// Loading or resolving a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] crate::Error),
    /// A candle operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result with [`ModelError`].
pub type ModelResult<T> = std::result::Result<T, ModelError>;
