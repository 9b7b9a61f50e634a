//! Which model to train and its tokenizer: a directory, a hub id or a `.gguf` file (`--model`), a checkpoint
//! being resumed, or the default tiny random Llama, made once in the HF layout under the autosp cache.

use std::path::{Path, PathBuf};

use autosp_core::Precision;
use autosp_models::weights::WeightFiles;
use autosp_models::{gguf_tokenizer_and_template, load_tokenizer, ChatTemplate, Tokenizer};
use autosp_models::{
    random_weights, resolve_model, save_model, HubOptions, LlamaConfig, LlamaModel, SaveOptions, TinySpec,
};
use candle_core::{DType, Device};

use super::checkpoint::model_slices::{skeleton, WeightPaths, WeightRanges};
use super::error::{IoContext, Result, TrainError};

/// The autosp cache: `AUTOSP_CACHE`, else `$XDG_CACHE_HOME/autosp`, else `~/.cache/autosp`, else
/// `target/autosp-cache`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("AUTOSP_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("autosp");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache").join("autosp"),
        None => PathBuf::from("target").join("autosp-cache"),
    }
}

/// The default model's shape: 2 layers, hidden 64, 4 heads (4 kv heads), vocab 128. Small enough that a
/// few thousand tokens train in well under a second per step on two CPU cores. (With 2 kv heads, GQA's
/// 32 value dimensions per layer learned the needles task to about 85% only: copying one of 96 answer
/// tokens wants the full 64.)
pub fn tiny_spec() -> TinySpec {
    TinySpec { layers: 2, hidden: 64, intermediate: 128, heads: 4, kv_heads: 4, vocab: 128, ..TinySpec::default() }
}

/// The default model's RoPE base. At 1e9 the slower half of the 8 rotation frequencies of a 16-dimension
/// head turn by less than 0.1 radian over 4096 tokens, so a head can match a question with its needle by
/// content at any distance, and what it learns on short sequences holds at 4096 (long-context Llamas raise
/// the base for the same reason: Llama 3 uses 5e5). Measured on the needles task: 99% after the default run
/// at 1e9, 88% at 5e5.
pub const TINY_ROPE_THETA: f64 = 1e9;

/// The default tiny model's directory (made now if it is not in the cache yet; the write is atomic, so
/// concurrent first runs are safe).
pub fn tiny_model(seed: u64) -> Result<PathBuf> {
    let spec = tiny_spec();
    let dir = cache_dir().join(format!(
        "tiny-llama-l{}-h{}-kv{}-v{}-theta{TINY_ROPE_THETA:e}-seed{seed}",
        spec.layers, spec.hidden, spec.kv_heads, spec.vocab
    ));
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let mut config = spec.config();
    config.max_position_embeddings = 1 << 16;
    config.rope_theta = TINY_ROPE_THETA;
    let weights = random_weights(&config, seed, DType::F32, &Device::Cpu)?;
    save_model(&dir, &config, &weights, &SaveOptions::default()).map_err(|e| TrainError::ModelFile {
        what: format!("writing the tiny model into {}", dir.display()),
        cause: Box::new(e.into()),
    })?;
    Ok(dir)
}

/// The model as loaded (see [`load`] for its dtype), and its tokenizer file when it has one.
pub struct Loaded {
    /// The model.
    pub model: LlamaModel,
    /// The text of `tokenizer.json` (written into checkpoints), when the model has a tokenizer.
    pub tokenizer_json: Option<String>,
    /// The tokenizer itself (from tokenizer.json or the GGUF file).
    pub tokenizer: Option<Tokenizer>,
    /// The text of `tokenizer_config.json` (written into checkpoints beside `tokenizer.json`), when the model
    /// has one; for a GGUF file with a chat template, one holding that template and its BOS and EOS.
    pub tokenizer_config_json: Option<String>,
    /// The model's chat template, for conversations (`--data` with "messages").
    pub chat_template: Option<ChatTemplate>,
}

impl Loaded {
    /// What tokenising `--data` or `--eval-data` (`what`, for messages) needs from this model (`source`, for
    /// messages) and the run's options: fails when the model has no tokenizer.
    pub fn tokenising(&self, what: &str, source: &str, o: &super::RunOptions) -> Result<super::corpus::Tokenising<'_>> {
        let (Some(tokenizer), Some(tokenizer_json)) = (&self.tokenizer, &self.tokenizer_json) else {
            return Err(TrainError::Config(format!(
                "{what}: text needs the model's tokenizer, and `{source}` has no tokenizer.json; give token ids as \
                 ids:FILE"
            )));
        };
        Ok(super::corpus::Tokenising {
            tokenizer,
            tokenizer_json,
            template: self.chat_template.as_ref(),
            eos: self.model.config.eos_token_id,
            layout: o.chat_layout,
            seq_len: o.seq_len,
        })
    }

    /// The tokenizer files a checkpoint of this model holds: `tokenizer.json` and `tokenizer_config.json`.
    pub fn tokenizer_files(&self) -> Vec<(String, String)> {
        let mut files = Vec::new();
        if let Some(t) = &self.tokenizer_json {
            files.push(("tokenizer.json".to_string(), t.clone()));
        }
        if let Some(c) = &self.tokenizer_config_json {
            files.push(("tokenizer_config.json".to_string(), c.clone()));
        }
        files
    }
}

/// Loads `source` (a directory, hub id or `.gguf` file) in `dtype`. The job loads in [`load_dtype`]: the
/// optimizer's master dtype (f32), so that bf16/f16 training starts its f32 master weights from the
/// checkpoint's own values, or the compute dtype where the files hold nothing wider; the ranks convert to the
/// compute dtype.
pub fn load(source: &str, dtype: DType) -> Result<Loaded> {
    let model = LlamaModel::load(source, dtype).map_err(|cause| TrainError::ModelFile {
        what: format!("loading the model `{source}`"),
        cause: Box::new(cause),
    })?;
    with_tokenizer(source, model)
}

/// The dtype the job reads `source`'s whole weights in for a run computing in `dtype` (below `--shard
/// parameters`, where every process reads them all): the master dtype (f32 for bf16/f16), so that the f32
/// master weights start from the checkpoint's own values, unless every weight in the files is stored in
/// `dtype` already (a bf16 checkpoint trained in bf16). Then `dtype`: half the bytes, and the masters widened
/// from it are the same values. Reads the safetensors headers only; a GGUF file (quantised) or a family whose
/// files fuse projections is read in the master dtype.
pub fn load_dtype(source: &str, dtype: DType) -> Result<DType> {
    let master = Precision::float(dtype).master();
    if master == dtype {
        return Ok(dtype);
    }
    let Some((config, files)) = config_of(source)? else { return Ok(master) };
    let Some(paths) = WeightPaths::of(&files, &config) else { return Ok(master) };
    let stored = WeightRanges::open(&paths)?.stored_dtype(&config);
    Ok(if stored == Some(dtype) { dtype } else { master })
}

/// `source`'s config and tokenizer with the model as a [`skeleton`] in `dtype` (no weight read), and the
/// files each rank reads its own slices of the weights from ([`crate::train::checkpoint::model_slices`]), open,
/// their headers read once and checked against the config; `None` when the weights cannot be read in ranges (a
/// GGUF file, whose weights are quantised, or a family whose files fuse projections): then [`load`] it whole.
pub fn load_skeleton(source: &str, dtype: DType) -> Result<Option<(Loaded, WeightRanges)>> {
    let Some((config, files)) = config_of(source)? else {
        return Ok(None);
    };
    let Some(paths) = WeightPaths::of(&files, &config) else {
        return Ok(None);
    };
    let ranges = WeightRanges::open(&paths)?;
    ranges.check(&config)?;
    let model = skeleton(&config, dtype, &Device::Cpu)?;
    Ok(Some((with_tokenizer(source, model)?, ranges)))
}

/// `source`'s config read from its `config.json` alone (no weight, header or tokenizer read), with the weight
/// files it resolved to; `None` for a GGUF file, whose config comes with its weights ([`load`]).
pub fn config_of(source: &str) -> Result<Option<(LlamaConfig, WeightFiles)>> {
    let path = Path::new(source);
    if path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return Ok(None);
    }
    let resolved = resolve_model(source, &HubOptions::default())?;
    let config = LlamaConfig::from_file(&resolved.config)?;
    Ok(Some((config, resolved.weights)))
}

/// `model` loaded from `source` with its tokenizer, chat template and their files.
fn with_tokenizer(source: &str, model: LlamaModel) -> Result<Loaded> {
    let path = Path::new(source);
    let mut loaded =
        Loaded { model, tokenizer_json: None, tokenizer: None, tokenizer_config_json: None, chat_template: None };
    if path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        if let Ok((t, template)) = gguf_tokenizer_and_template(path) {
            let text = t.to_string(false).map_err(|e| {
                TrainError::from(autosp_models::Error::Tokenizer {
                    source_name: path.display().to_string(),
                    message: format!("serialising the GGUF tokenizer: {e}"),
                })
            })?;
            (loaded.tokenizer_json, loaded.tokenizer) = (Some(text), Some(t));
            loaded.chat_template = template?;
            loaded.tokenizer_config_json = loaded.chat_template.as_ref().map(ChatTemplate::to_tokenizer_config);
        }
    } else if let Some(f) = resolve_model(source, &HubOptions::default())?.tokenizer {
        let text = std::fs::read_to_string(&f).io(|| format!("reading {}", f.display()))?;
        (loaded.tokenizer_json, loaded.tokenizer) = (Some(text), Some(load_tokenizer(&f)?));
        let config = f.with_file_name("tokenizer_config.json");
        loaded.tokenizer_config_json = std::fs::read_to_string(&config).ok();
        loaded.chat_template = ChatTemplate::beside_tokenizer(&f)?;
    }
    Ok(loaded)
}
