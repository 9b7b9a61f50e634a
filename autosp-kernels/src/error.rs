//! The error type of autosp-kernels: shape, dtype and device misuse of a kernel is a typed variant whose
//! message names the shapes or values and says what to do; errors of autosp-core and candle pass through.

use candle_core::DType;

/// Errors raised by the kernels.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error from autosp-core, e.g. the shape checks of `AttentionSpec::dims` (mismatched head counts,
    /// heads not divisible by kv heads, wrong ranks), each naming the shapes.
    /// Boxed: autosp-core's error is large, and kernels return `Result` on every call.
    #[error(transparent)]
    Core(Box<autosp_core::Error>),

    /// An error from candle itself (allocation, dtype conversion, ...).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    /// The head dimension is outside what the kernel supports.
    #[error(
        "{op}: head_dim {head_dim} (q has shape {q_shape:?}) is outside 1..={max}; the CPU flash kernel \
         supports head dimensions up to {max}: split larger heads or use the naive attention"
    )]
    HeadDim { op: &'static str, head_dim: usize, max: usize, q_shape: Vec<usize> },

    /// Two tensors that must share a dtype do not.
    #[error("{op}: {name} has dtype {got:?} but q has dtype {want:?}; convert them to one dtype first")]
    DTypeMismatch { op: &'static str, name: &'static str, got: DType, want: DType },

    /// A dtype the kernel does not compute in.
    #[error("{op}: dtype {dtype:?} is not supported; use f32, f64, bf16 or f16")]
    UnsupportedDType { op: &'static str, dtype: DType },

    /// A tensor that is not on the CPU.
    #[error("{op}: {name} is on {device}; the CPU flash kernel needs CPU tensors (move them with `to_device`)")]
    NotCpu { op: &'static str, name: &'static str, device: String },

    /// A CUDA tensor reached a kernel of a build without the `cuda` feature.
    #[error(
        "{op}: {name} is on {device} but autosp was built without CUDA support; rebuild with `--features cuda` \
         (needs CUDA >= 12 and a GPU of compute capability >= 8.0) or move the tensors to the CPU"
    )]
    CudaFeature { op: &'static str, name: &'static str, device: String },

    /// A gradient was asked of attention on CUDA: candle-flash-attn has no backward.
    #[error(
        "{op}: the CUDA backward is not implemented (candle-flash-attn has forward only); train on the CPU, or \
         run CUDA inference on `Tape::inference()` with inputs that take no gradient"
    )]
    CudaBackward { op: &'static str },

    /// The log-sum-exp was asked of attention on CUDA: candle-flash-attn does not return it.
    #[error(
        "{op}: candle-flash-attn does not return the log-sum-exp, so attention on CUDA gives the output only; \
         call `flash_attention_output` (or `Attention::forward_output`) for inference, or run on the CPU \
         where the LSE is needed (Ring attention, training)"
    )]
    CudaLse { op: &'static str },

    /// A dtype candle-flash-attn does not compute in.
    #[error(
        "{op}: candle-flash-attn computes in f16 or bf16 only, but q has dtype {dtype:?}; convert q, k, v with \
         `to_dtype(DType::BF16)` (or F16) first, or use the CPU kernel"
    )]
    CudaDType { op: &'static str, dtype: DType },

    /// A head dimension candle-flash-attn does not take.
    #[error(
        "{op}: candle-flash-attn needs head_dim a multiple of 8 and at most {max}, but q has shape {q_shape:?} \
         (head_dim {head_dim}); pad the head dimension or use the CPU kernel"
    )]
    CudaHeadDim { op: &'static str, head_dim: usize, max: usize, q_shape: Vec<usize> },

    /// A causal mask that candle-flash-attn's bottom-right aligned window cannot express.
    #[error(
        "{op}: causal attention with q_offset {q_offset}, k_offset {k_offset}, q_len {q_len}, k_len {k_len} \
         cannot be expressed by candle-flash-attn, whose causal window lets query i see keys \
         j <= i + (k_len - q_len) + w for a w in 0..=k_len; here w = {w}; use the CPU kernel for this shard \
         layout"
    )]
    CudaMask { op: &'static str, q_offset: usize, k_offset: usize, q_len: usize, k_len: usize, w: i128 },

    /// Two tensors that must be on one device are not.
    #[error("{op}: {name} is on {got} but q is on {want}; put q, k and v on one device")]
    DeviceMismatch { op: &'static str, name: &'static str, got: String, want: String },

    /// A tensor of the backward pass whose shape does not follow from q.
    #[error("{op}: {name} has shape {got:?} but must have shape {want:?} (from q {q_shape:?})")]
    Shape { op: &'static str, name: &'static str, got: Vec<usize>, want: Vec<usize>, q_shape: Vec<usize> },
}

impl From<autosp_core::Error> for Error {
    fn from(e: autosp_core::Error) -> Self {
        Error::Core(Box::new(e))
    }
}

/// The result type of autosp-kernels.
pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for autosp_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Core(e) => *e,
            Error::Candle(e) => autosp_core::Error::Candle(e),
            other => autosp_core::Error::External(Box::new(other)),
        }
    }
}
