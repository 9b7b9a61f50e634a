//! [`TrainError`]: what can stop a training run, one variant per thing to do about it. Messages name the
//! setting, file or checkpoint at fault and the fix; settings are named by their `llama_longctx` option
//! (`--seq-len` is [`TrainConfig::seq_len`](super::TrainConfig::seq_len)), as the facade's other parsers do.
//! Where a lower error is the cause it is the [`source`](std::error::Error::source), not repeated in the
//! message: print the chain (`anyhow`'s `{:#}`) to see both.

use std::path::PathBuf;

use autosp_core::comm::CommError;
use autosp_models::ModelError;

use crate::compile::CompileError;
use crate::device::DeviceError;

/// Result with [`TrainError`].
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// Everything that can go wrong preparing, running, saving or resuming training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A setting is out of range, or does not fit the model, the data or another setting: change it.
    #[error("{0}")]
    Config(String),

    /// Training or held-out data cannot be used (malformed, empty, outside the vocabulary, too short for a
    /// sequence): fix the file or the sequence length.
    #[error("{0}")]
    Data(String),

    /// A checkpoint cannot be resumed: missing, not a checkpoint, damaged, written by another run (other
    /// options) or for another model. Resume from another checkpoint, or with its run's options.
    #[error("{message}")]
    Checkpoint {
        /// What is wrong, naming the checkpoint and the file.
        message: String,
        /// The lower error, where there is one.
        #[source]
        cause: Option<Box<TrainError>>,
    },

    /// Another live process is saving checkpoints into the directory: wait for it, stop it, or save elsewhere.
    #[error(
        "--save {}: another run ({}) is saving checkpoints into this directory; wait for it to finish or stop it, \
         or give this run another --save directory",
        dir.display(),
        owner.as_ref().map_or("another process".to_string(), |pid| format!("process {pid}"))
    )]
    Locked {
        /// The save directory.
        dir: PathBuf,
        /// The process id written in the lock file, when it could be read.
        owner: Option<String>,
    },

    /// A step's loss or gradient norm was NaN or infinite and the policy is [`NonFinite::Stop`](super::NonFinite):
    /// nothing of that step was applied or saved.
    #[error(
        "{what} is not finite at step {step} ({value}): training stopped and this state was not saved ({}); lower \
         --lr or --grad-clip, check the data, or pass --skip-nonfinite to skip such steps",
        kept.as_ref().map_or("no checkpoint of this run was saved".to_string(),
            |d| format!("the last checkpoint, {}, is kept", d.display()))
    )]
    NonFinite {
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// The 1-based step.
        step: usize,
        /// The value found.
        value: f64,
        /// The newest complete checkpoint of this run (or the one it resumed from).
        kept: Option<PathBuf>,
    },

    /// Writing a checkpoint failed; the checkpoints already there are untouched.
    #[error("saving the checkpoint {} (nothing was replaced)", dir.display())]
    Save {
        /// The `step-N` directory it was to become.
        dir: PathBuf,
        /// Why.
        #[source]
        cause: Box<TrainError>,
    },

    /// Reading, writing, syncing or renaming a file failed.
    #[error("{what}")]
    Io {
        /// What was being done, naming the path (`reading token ids from data.txt`).
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// Starting the ranks' communication failed (MPI, NCCL).
    #[error("{what}")]
    Comm {
        /// What was being started.
        what: String,
        /// The back end's error.
        #[source]
        cause: Box<CommError>,
    },

    /// A safetensors file (gradients, optimizer state) could not be written or read.
    #[error("{what}")]
    Tensors {
        /// What was being done, naming the file.
        what: String,
        /// candle's error.
        #[source]
        cause: Box<candle_core::Error>,
    },

    /// A model could not be loaded or written.
    #[error("{what}")]
    ModelFile {
        /// What was being done, naming the model (`loading the model `owner/name``).
        what: String,
        /// Why.
        #[source]
        cause: Box<ModelError>,
    },

    /// The run's settings do not compile for this model (P, strategy, checkpointing, sequence length).
    #[error("{settings} cannot be compiled")]
    Compile {
        /// The settings, as options (`--sp 4 --strategy hybrid:3 ...`).
        settings: String,
        /// The compile step's reason and suggestion.
        #[source]
        cause: Box<CompileError>,
    },

    /// A compiled model's step, evaluation or logits failed.
    #[error(transparent)]
    Step(Box<CompileError>),

    /// A model's weights, config or tokenizer (autosp-models).
    #[error(transparent)]
    Model(Box<ModelError>),

    /// The tape, the optimizer or a collective (autosp-core).
    #[error(transparent)]
    Core(Box<autosp_core::Error>),

    /// The device cannot be opened.
    #[error(transparent)]
    Device(Box<DeviceError>),

    /// candle itself.
    #[error(transparent)]
    Candle(Box<candle_core::Error>),
}

impl TrainError {
    /// An [`TrainError::Io`] with what was being done.
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        TrainError::Io { what: what.into(), source }
    }

    /// A [`TrainError::Checkpoint`] without a lower cause.
    pub(crate) fn checkpoint(message: impl Into<String>) -> Self {
        TrainError::Checkpoint { message: message.into(), cause: None }
    }
}

/// `From` for the lower errors, boxed (they are large; a `Result<_, TrainError>` stays small).
macro_rules! boxed_from {
    ($($ty:ty => $variant:ident),* $(,)?) => {$(
        impl From<$ty> for TrainError {
            fn from(e: $ty) -> Self {
                TrainError::$variant(Box::new(e))
            }
        }
    )*};
}

boxed_from! {
    CompileError => Step,
    ModelError => Model,
    autosp_core::Error => Core,
    DeviceError => Device,
    candle_core::Error => Candle,
}

impl From<autosp_models::Error> for TrainError {
    fn from(e: autosp_models::Error) -> Self {
        TrainError::Model(Box::new(e.into()))
    }
}

impl From<CommError> for TrainError {
    fn from(e: CommError) -> Self {
        TrainError::Core(Box::new(e.into()))
    }
}

/// `result.io(|| "reading X")`: an io error with what was being done.
pub(crate) trait IoContext<T> {
    fn io(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::result::Result<T, std::io::Error> {
    fn io(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| TrainError::io(what(), e))
    }
}
