//! Errors of autosp-models: each names the file, field or tensor at fault and the shapes involved.

use std::path::PathBuf;

/// Everything that can go wrong reading, resolving, importing or saving a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("{path}: {source} (check that the file exists and is readable/writable)")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config.json, index) is not valid JSON or has a field of the wrong type.
    #[error("{path}: invalid JSON: {message}")]
    Json { path: PathBuf, message: String },
    /// config.json lacks a field the architecture needs.
    #[error("{path}: config field `{field}` is missing; add it to config.json")]
    MissingField { path: PathBuf, field: String },
    /// A config field has a value that is malformed or inconsistent with the others.
    #[error("{path}: config field `{field}` = {value}: {reason}")]
    InvalidField { path: PathBuf, field: String, value: String, reason: String },
    /// A config field that changes the maths and that autosp does not implement.
    #[error("{path}: config field `{field}` = {value} is not supported: {reason}")]
    Unsupported { path: PathBuf, field: String, value: String, reason: String },
    /// A rope_scaling / rope_parameters type other than default, linear, llama3, yarn, dynamic and longrope.
    #[error(
        "{path}: rope type `{rope_type}` in `{field}` is not implemented (RoPE scaling changes the positions' \
         angles, so the model would compute something else); supported: default, linear, llama3, yarn, dynamic, \
         longrope"
    )]
    UnknownRopeType { path: PathBuf, field: String, rope_type: String },
    /// `--rope-scaling` (`CompileConfig::rope_scaling`) names a type that does not extend a window.
    #[error("--rope-scaling {spec}: unknown type `{given}`; give TYPE:FACTOR with a type of {types}, e.g. yarn:2")]
    RopeExtensionType { spec: String, given: String, types: String },
    /// `--rope-scaling` with a factor of 1 or less.
    #[error(
        "--rope-scaling {spec}: factor {factor} does not extend the window: a factor > 1 extends it (new window = \
         original window x factor); give `none` for no scaling"
    )]
    RopeExtensionFactor { spec: String, factor: String },
    /// `--rope-scaling` with a malformed factor, or a KEY=VALUE its type does not take or with a bad value.
    #[error("--rope-scaling {spec}: `{key}` = `{value}`: {reason}")]
    RopeExtensionKey { spec: String, key: String, value: String, reason: String },
    /// `--rope-scaling` that cannot apply to this model (another scaling type than its own, or a family that
    /// takes no such scaling).
    #[error("--rope-scaling {spec}: {reason}")]
    RopeExtensionRefused { spec: String, reason: String },
    /// The model_type is not one of the Llama family.
    #[error("{path}: model_type `{model_type}` is not supported; supported: llama, mistral, qwen2, qwen3, phi3, gemma3_text")]
    UnknownModelType { path: PathBuf, model_type: String },
    /// A safetensors file could not be parsed: bad header, truncated data, bad dtype.
    #[error("{path}: not a valid safetensors file ({message}); the file is corrupted or truncated, download or save it again")]
    Safetensors { path: PathBuf, message: String },
    /// A tensor the config needs is in no weight file.
    #[error("tensor `{name}` (expected shape {expected:?}) is missing from {path}")]
    MissingTensor { name: String, expected: Vec<usize>, path: PathBuf },
    /// A weight file holds a tensor the config does not describe.
    #[error("tensor `{name}` (shape {found:?}) in {path} is not part of this model's config; the config and weights disagree")]
    UnexpectedTensor { name: String, found: Vec<usize>, path: PathBuf },
    /// A tensor has a different shape from the one the config implies.
    #[error("tensor `{name}` in {path} has shape {found:?}, the config expects {expected:?}")]
    ShapeMismatch { name: String, expected: Vec<usize>, found: Vec<usize>, path: PathBuf },
    /// A tensor is stored in a dtype other than f32, bf16, f16.
    #[error("tensor `{name}` in {path} has dtype {dtype}; only F32, BF16 and F16 weights are supported")]
    UnsupportedDtype { name: String, dtype: String, path: PathBuf },
    /// The sharded index names a shard file that is not there.
    #[error(
        "shard `{shard}` named in {index} is missing (looked for {path}); download the checkpoint again, or fix \
         the index's weight_map"
    )]
    MissingShard { shard: String, index: PathBuf, path: PathBuf },
    /// A model string resolved to nothing: files missing locally and from the hub cache.
    #[error("model `{model}`: missing {missing:?}; looked in {looked_in}{hint}")]
    NotFound { model: String, missing: Vec<String>, looked_in: String, hint: String },
    /// The hub could be reached but a download failed.
    #[error("model `{model}`: downloading `{file}` from the hub failed: {message}")]
    Hub { model: String, file: String, message: String },
    /// A GGUF tensor is stored in a quantisation type candle cannot read (the IQ types, for instance).
    #[error(
        "{path}: GGUF tensor type {ggml_type} ({name}) is not supported; supported: F32, F16, BF16, Q4_0, Q4_1, \
         Q5_0, Q5_1, Q8_0, Q8_1, Q2_K to Q6_K and Q8_K: requantise the file with llama.cpp's llama-quantize (Q8_0 \
         or Q4_K_M, say), or load the model's safetensors checkpoint instead"
    )]
    GgufQuantisation { path: PathBuf, ggml_type: u32, name: &'static str },
    /// A GGUF file is malformed or is not a Llama-architecture model.
    #[error("{path}: GGUF: {message}")]
    Gguf { path: PathBuf, message: String },
    /// The tokenizer could not be loaded or used.
    #[error("tokenizer {source_name}: {message}")]
    Tokenizer { source_name: String, message: String },
    /// A candle operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Wraps an io error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}
