//! The error type of autosp-core: every misuse of the tape, an op or an optimiser is a typed variant
//! whose message says what went wrong and what to do instead.

/// Errors raised by the tape, its ops, checkpoint regions and the optimisers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error from candle itself (allocation, an unsupported dtype for a candle kernel, ...).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    /// Two shapes that must agree do not; both are named.
    #[error("{0}")]
    ShapeMismatch(Box<ShapeMismatch>),

    /// An argument outside what the op supports.
    #[error("{op}: {msg}")]
    InvalidArgument { op: &'static str, msg: String },

    /// A dtype the op does not compute in (see [`crate::precision::Precision`]).
    #[error("{op}: dtype {dtype:?} is not supported; use f32, f64, bf16 or f16")]
    UnsupportedDType { op: &'static str, dtype: candle_core::DType },

    /// `backward` ran before on this tape without retaining the graph, so its saved tensors are gone.
    #[error(
        "backward was already run on this tape and its saved tensors were released; \
         call `Tape::backward_retained` for every backward pass but the last one if you need several, \
         or record a new tape for the next step"
    )]
    BackwardTwice,

    /// `backward` asked on an inference tape, which records nothing.
    #[error("this tape runs in inference mode and records nothing; build it with `Tape::new(policy)` to train")]
    InferenceMode,

    /// `backward` without a seed on a value that is not a scalar.
    #[error("backward without a seed gradient needs a scalar (one element) value, got shape {shape:?}; pass a seed with `Tape::backward_with_grad`")]
    NotScalar { shape: Vec<usize> },

    /// A gradient was asked of a value that is not a leaf.
    #[error("value #{value} is the output of `{op}`, not a leaf: gradients accumulate only into leaves (parameters from `Tape::param` or tensors from `Tape::leaf`)")]
    NotALeaf { value: usize, op: &'static str },

    /// A value recorded on one tape was used on another.
    #[error("a value recorded on tape {value_tape} was used on tape {tape}: each rank and each step records on its own tape; pass the tensor (`Value::tensor`) through `Tape::leaf` or `Tape::constant` instead")]
    ForeignValue { value_tape: u64, tape: u64 },

    /// Checkpoint regions were opened or closed out of order.
    #[error("unbalanced checkpoint region: {msg}")]
    UnbalancedRegion { msg: String },

    /// An optimiser or schedule hyper-parameter is out of range.
    #[error("optimiser: {msg}")]
    Optimizer { msg: String },

    /// A collective failed (timeout, a rank that left, mismatched arguments).
    #[error(transparent)]
    Comm(Box<crate::comm::CommError>),

    /// An error from an op implemented outside autosp-core (a kernel), passed through.
    #[error(transparent)]
    External(Box<dyn std::error::Error + Send + Sync>),

    /// A broken invariant inside the tape: a bug in autosp, please report it.
    #[error("internal error in the autosp tape (please report): {0}")]
    Internal(String),
}

/// Two shapes that do not fit together, by name, with what would fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{op}: {lhs_name} has shape {lhs:?} but {rhs_name} has shape {rhs:?}; {hint}")]
pub struct ShapeMismatch {
    /// The op that found the mismatch.
    pub op: &'static str,
    /// What the first shape belongs to.
    pub lhs_name: &'static str,
    /// The first shape.
    pub lhs: Vec<usize>,
    /// What the second shape belongs to.
    pub rhs_name: &'static str,
    /// The second shape.
    pub rhs: Vec<usize>,
    /// What would fit.
    pub hint: String,
}

/// The result type of autosp-core.
pub type Result<T> = std::result::Result<T, Error>;

impl From<crate::comm::CommError> for Error {
    fn from(e: crate::comm::CommError) -> Self {
        Error::Comm(Box::new(e))
    }
}
