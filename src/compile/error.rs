//! Errors of the compile step and of compiled models.

/// What can go wrong compiling or running a compiled model.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The strategy cannot split this model over P ranks.
    #[error("{what}; {suggestion}")]
    Infeasible { what: String, suggestion: String },

    /// The byte budget is below what the most frugal plan needs.
    #[error(
        "a tape budget of {budget} bytes per rank cannot train {n} tokens: the smallest plan (Full checkpointing) \
         needs about {smallest} bytes; raise the budget, shorten the sequence or add ranks"
    )]
    BudgetTooSmall { budget: usize, smallest: usize, n: usize },

    /// Bad input to a compiled model.
    #[error("{0}")]
    Input(String),

    /// No target of the batch trains (every label is -100 on every rank): there is nothing to learn from or to
    /// score. Every rank returns it alike, before any forward pass; a caller skips the batch (the trainer skips
    /// the step and says so; held-out scoring skips the window).
    #[error(
        "no target of this batch trains: every label is -100 on every rank (a chat window without an assistant \
         token, or fully masked text); skip the batch"
    )]
    NoTargets,

    /// `CompileConfig::rope_scaling` on a model that is not a `LlamaModel`.
    #[error(
        "CompileConfig::rope_scaling ({extension}) applies to a LlamaModel only: set the scaling on your model's \
         own config (its RoPE frequencies) and leave CompileConfig::rope_scaling unset"
    )]
    RopeScalingNotLlama { extension: String },

    /// `CompileConfig::rope_scaling` cannot apply to this model (another scaling type than its own, a Phi-3).
    #[error("CompileConfig::rope_scaling: {0}")]
    RopeScaling(#[source] autosp_models::ModelError),

    /// Packed documents given for a number of batch rows other than the batch's.
    #[error(
        "{given} document boundaries (Documents) given for a batch of {rows} row(s): pass one per row \
         (Documents::whole(n) for a row that is one sequence)"
    )]
    DocumentsRows { rows: usize, given: usize },

    /// A batch row's document boundaries do not fit its window.
    #[error("documents of batch row {row}: {source}")]
    Documents {
        row: usize,
        #[source]
        source: autosp_core::ops::DocumentsError,
    },

    /// Packed documents for a model that does not honour them.
    #[error(
        "this model ({kind}) does not honour packed documents (CausalLm::supports_documents is false): its \
         positions would run on and its attention cross document boundaries; implement them (restart RoPE \
         positions at each document, put Tape::documents into its AttentionSpec) or train unpacked windows"
    )]
    DocumentsUnsupported { kind: &'static str },

    /// An error from the tape, an op or a collective.
    #[error(transparent)]
    Core(#[from] autosp_core::Error),

    /// An error from candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl From<autosp_core::comm::CommError> for CompileError {
    fn from(e: autosp_core::comm::CommError) -> Self {
        CompileError::Core(e.into())
    }
}
