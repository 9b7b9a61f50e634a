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
        "{op}: head_dim {head_dim} (q has shape {q_shape:?}) is outside 1..={max}, the head dimensions this kernel \
         takes; call `attention_forward`/`_backward`, which route head dimensions the CPU kernel does not take to \
         the device-generic kernel"
    )]
    HeadDim { op: &'static str, head_dim: usize, max: usize, q_shape: Vec<usize> },

    /// Two tensors that must share a dtype do not.
    #[error("{op}: {name} has dtype {got:?} but q has dtype {want:?}; convert them to one dtype first")]
    DTypeMismatch { op: &'static str, name: &'static str, got: DType, want: DType },

    /// A tensor handed straight to a CPU kernel (the `attention::kernels` test hooks) is not on the CPU.
    /// The doors never raise it: they send such tensors to the device-generic kernels.
    #[error(
        "{op}: {name} is on {device}; the CPU kernels need CPU tensors: call the op's public function (e.g. \
         `attention_forward`), which runs the device-generic kernel on other devices"
    )]
    NotCpu { op: &'static str, name: &'static str, device: String },

    /// Two tensors that must be on one device are not.
    #[error("{op}: {name} is on {got} but q is on {want}; put q, k and v on one device")]
    DeviceMismatch { op: &'static str, name: &'static str, got: String, want: String },

    /// Other ranks of a collective kernel failed before it (each says why in its own error), so this rank
    /// cannot complete its result: they still entered the collective, so that this rank learns it at once.
    #[error(
        "{op}: rank(s) {ranks:?} of the group failed before the collective (each says why in its own error); \
         this rank's part was fine: fix what those ranks report"
    )]
    PeerFailed { op: &'static str, ranks: Vec<usize> },

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
