//! [`InferError`]: what generation over a compiled model refuses, each saying what to change, and the errors
//! of the layers below passing through.

use autosp_models::ModelError;

use crate::compile::CompileError;

/// Errors of [`Compiled::generate`](crate::Compiled::generate).
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    /// The prompt has no token.
    #[error("the prompt is empty: give at least one token (e.g. the tokenizer's BOS id, or text for --prompt)")]
    EmptyPrompt,

    /// A prompt id the model's embedding does not have.
    #[error(
        "prompt token {id} (index {index}) is outside the model's vocabulary of {vocab} ids: tokenize the prompt \
         with the model's own tokenizer"
    )]
    TokenOutOfVocab { id: u32, index: usize, vocab: usize },

    /// A stop token the model can never produce.
    #[error(
        "stop token {id} is outside the model's vocabulary of {vocab} ids, so it can never end generation: give \
         ids below {vocab} (GenerateConfig::stop_tokens, --stop-token)"
    )]
    UnknownStopToken { id: u32, vocab: usize },

    /// The prompt and the new tokens pass the positions the model has, with no RoPE scaling to go past them.
    #[error(
        "the prompt's {prompt} tokens plus max_new_tokens {new} pass the model's {max} positions \
         (max_position_embeddings) and it has no RoPE scaling: shorten the prompt, lower max_new_tokens \
         (--max-new-tokens), or extend the context with a scaling (--rope-scaling)"
    )]
    TooLong { prompt: usize, new: usize, max: usize },

    /// Other ranks refused the same generation request (each says why in its own error), so none started
    /// it: every rank calls `generate` with the same prompt and config.
    #[error(
        "rank(s) {ranks:?} refused this generation request (each says why in its own error), so no rank started \
         it: every rank must call generate with the same prompt and config"
    )]
    RefusedElsewhere { ranks: Vec<usize> },

    /// The command line's prompt or model could not be used (`--prompt`, `--chat`, `--resume`), or a rank
    /// failed (the message names it).
    #[error("{0}")]
    Prompt(String),

    /// From the trainer's loading of the model, its adapter or the checkpoint resumed.
    #[error(transparent)]
    Train(Box<crate::train::TrainError>),

    /// From autosp-models' files (tokenizer, chat template).
    #[error(transparent)]
    Files(#[from] autosp_models::Error),

    /// From the compiled model (positions, layout).
    #[error(transparent)]
    Compile(#[from] CompileError),

    /// From the model (its forward, sampling).
    #[error(transparent)]
    Model(#[from] ModelError),

    /// From autosp-core (collectives, parameters).
    #[error(transparent)]
    Core(#[from] autosp_core::Error),

    /// From the kernels (the cache, decode attention).
    #[error(transparent)]
    Kernel(#[from] autosp_kernels::Error),

    /// The device `--device` names could not be opened.
    #[error(transparent)]
    Device(#[from] crate::DeviceError),

    /// From candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl From<crate::train::TrainError> for InferError {
    fn from(e: crate::train::TrainError) -> Self {
        InferError::Train(Box::new(e))
    }
}
