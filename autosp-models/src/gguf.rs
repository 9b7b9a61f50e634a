//! Imports GGUF files (llama.cpp) of the llama, qwen2, qwen3, phi3 and gemma3 architectures: reads and
//! dequantises every tensor with candle's GGUF reader (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! Q2_K..Q8_K), renames the tensors to HF names, undoes llama's Q/K row permutation and builds the
//! [`LlamaConfig`] from the metadata (keys `{architecture}.*`); the tokenizer comes from `tokenizer.ggml.*` (see
//! `gguf_tokenizer`). Mistral's GGUF files are llama ones. What llama.cpp implies for an architecture instead
//! of storing it is taken as llama.cpp takes it (Gemma 3: the window pattern, the sliding layers' RoPE base,
//! the softmax scale; its norms stored plus one). The RoPE scalings the converter stores as tensors (llama's
//! `rope_freqs`, Phi-3's longrope factors) become the config's scaling (`gguf_rope`). Other architectures are
//! refused, naming `general.architecture`.

use crate::config::{LayerType, LlamaConfig, ModelType, RopeScaling};
use crate::error::{Error, Result};
use crate::gguf_names::{family_hf_name, unpermute_rows};
use crate::gguf_rope::{llama3_from_factors, longrope_from_factors};
use crate::gguf_tokenizer::tokenizer_from_gguf;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// A GGUF model converted to the HF layout.
pub struct GgufModel {
    pub config: LlamaConfig,
    /// HF name -> dequantised tensor, shapes as [`LlamaConfig::expected_tensors`].
    pub weights: HashMap<String, Tensor>,
}

/// The tokenizer of a GGUF file (see [`tokenizer_from_gguf`]); separate from [`import_gguf`] so a model
/// whose tokenizer family is not supported still imports, with its tokenizer.json used instead.
pub fn gguf_tokenizer(path: &Path) -> Result<Tokenizer> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let ct = read_content(&mut file, path)?;
    tokenizer_from_gguf(&ct, path)
}

/// The tokenizer of a GGUF file ([`gguf_tokenizer`]) and, apart, its chat template ([`chat_template_of`]:
/// its own error, so a template that does not parse does not lose the tokenizer), from one read of the header.
#[allow(clippy::type_complexity)]
pub fn gguf_tokenizer_and_template(path: &Path) -> Result<(Tokenizer, Result<Option<crate::ChatTemplate>>)> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let ct = read_content(&mut file, path)?;
    Ok((tokenizer_from_gguf(&ct, path)?, chat_template_of(&ct)))
}

/// The chat template a GGUF header carries (`tokenizer.chat_template`), with the text of its BOS and EOS tokens
/// (`tokenizer.ggml.bos_token_id` / `eos_token_id` looked up in `tokenizer.ggml.tokens`); `None` without one.
fn chat_template_of(ct: &Content) -> Result<Option<crate::ChatTemplate>> {
    let Some(source) = ct.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned() else {
        return Ok(None);
    };
    let tokens = ct.metadata.get("tokenizer.ggml.tokens").and_then(|v| v.to_vec().ok());
    let text = |key: &str| -> String {
        let id = ct.metadata.get(key).and_then(|v| v.to_u32().ok());
        match (id, tokens) {
            (Some(id), Some(t)) => t.get(id as usize).and_then(|v| v.to_string().ok()).cloned().unwrap_or_default(),
            _ => String::new(),
        }
    };
    let (bos, eos) = (text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id"));
    Ok(Some(crate::ChatTemplate::new(&source, &bos, &eos)?))
}

/// The ggml type ids candle's reader does not know, by name (ggml.h's `ggml_type`).
fn ggml_type_name(id: u32) -> &'static str {
    match id {
        4 | 5 => "Q4_2/Q4_3, removed from llama.cpp",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        _ => "unknown",
    }
}

/// Reads a GGUF file's header (metadata and tensor infos). A tensor in a quantisation type candle cannot read
/// is [`Error::GgufQuantisation`], naming the type; any other failure is [`Error::Gguf`].
fn read_content(file: &mut std::fs::File, path: &Path) -> Result<Content> {
    Content::read(file).map_err(|e| {
        let message = e.to_string();
        // candle's only words for it: `unknown dtype for tensor {id}`.
        // (`to_string` may append a backtrace: only the digits right after it count.)
        let id = message.split("unknown dtype for tensor ").nth(1).and_then(|t| {
            let digits: String = t.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u32>().ok()
        });
        match id {
            Some(ggml_type) => {
                Error::GgufQuantisation { path: path.into(), ggml_type, name: ggml_type_name(ggml_type) }
            }
            None => Error::Gguf { path: path.into(), message },
        }
    })
}

/// The tensors llama.cpp's converter writes for a RoPE scaling (read into the config, not weights).
const ROPE_FREQS: &str = "rope_freqs.weight";
const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";
const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";

struct Meta<'a> {
    ct: &'a Content,
    path: PathBuf,
}

impl Meta<'_> {
    fn err(&self, message: String) -> Error {
        Error::Gguf { path: self.path.clone(), message }
    }
    fn get(&self, key: &str) -> Option<&Value> {
        self.ct.metadata.get(key)
    }
    fn num(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let x = match v {
            Value::U8(x) => *x as f64,
            Value::I8(x) => *x as f64,
            Value::U16(x) => *x as f64,
            Value::I16(x) => *x as f64,
            Value::U32(x) => *x as f64,
            Value::I32(x) => *x as f64,
            Value::U64(x) => *x as f64,
            Value::I64(x) => *x as f64,
            Value::F32(x) => *x as f64,
            Value::F64(x) => *x,
            other => return Err(self.err(format!("metadata `{key}` = {other:?} is not a number"))),
        };
        Ok(Some(x))
    }
    fn need(&self, key: &str) -> Result<f64> {
        self.num(key)?.ok_or_else(|| self.err(format!("metadata key `{key}` is missing")))
    }
    fn string(&self, key: &str) -> Option<String> {
        self.get(key).and_then(|v| v.to_string().ok()).cloned()
    }
}

/// Builds the config of a llama, qwen2, qwen3, phi3 or gemma3 GGUF from its metadata.
pub fn config_from_gguf(ct: &Content, path: &Path) -> Result<LlamaConfig> {
    let m = Meta { ct, path: path.into() };
    let arch = m.string("general.architecture").unwrap_or_default();
    let model_type = match arch.as_str() {
        "llama" => ModelType::Llama,
        "qwen2" => ModelType::Qwen2,
        "qwen3" => ModelType::Qwen3,
        "phi3" => ModelType::Phi3,
        "gemma3" => ModelType::Gemma3,
        _ => {
            return Err(m.err(format!(
                "general.architecture is `{arch}`; GGUF import reads llama (and Mistral, stored as llama), qwen2, \
                 qwen3, phi3 and gemma3 files; load this model from its HF checkpoint (config.json + safetensors)"
            )))
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let heads = m.need(&key("attention.head_count"))? as usize;
    let hidden = m.need(&key("embedding_length"))? as usize;
    let embd = ct
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| m.err("tensor `token_embd.weight` is missing".into()))?;
    let vocab = match m.num(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => embd.shape.dims()[0],
    };
    let head_dim = match m.num(&key("attention.key_length"))? {
        Some(k) => k as usize,
        None => match m.num(&key("rope.dimension_count"))? {
            Some(d) => d as usize,
            None => hidden / heads,
        },
    };
    if let Some(d) = m.num(&key("rope.dimension_count"))? {
        if d as usize != head_dim {
            return Err(m.err(format!(
                "{} = {d} rotates part of each {head_dim}-wide head (partial RoPE), which is not implemented",
                key("rope.dimension_count")
            )));
        }
    }
    let rope_theta =
        m.num(&key("rope.freq_base"))?.unwrap_or(if model_type == ModelType::Gemma3 { 1_000_000.0 } else { 10_000.0 });
    let stored = |name: &str| -> Result<Option<Vec<f64>>> {
        if !ct.tensor_infos.contains_key(name) {
            return Ok(None);
        }
        let gguf_err = |e: candle_core::Error| m.err(format!("reading tensor `{name}`: {e}"));
        let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let t = ct.tensor(&mut file, name, &Device::Cpu).and_then(|q| q.dequantize(&Device::Cpu)).map_err(gguf_err)?;
        Ok(Some(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?))
    };
    let rope_scaling = match m.string(&key("rope.scaling.type")).as_deref() {
        // llama.cpp's converter stores Llama 3.1's scaling as the tensor `rope_freqs` (no metadata).
        None | Some("none") if model_type == ModelType::Llama => match stored(ROPE_FREQS)? {
            Some(f) => llama3_from_factors(&f, rope_theta, head_dim).map_err(|e| m.err(e))?,
            None => None,
        },
        // Phi-3 128K: longrope, the two factor lists as tensors (Phi3MiniModel writes no scaling type).
        None | Some("longrope") if model_type == ModelType::Phi3 && ct.tensor_infos.contains_key(ROPE_FACTORS_LONG) => {
            let (short, long) = (stored(ROPE_FACTORS_SHORT)?, stored(ROPE_FACTORS_LONG)?);
            let (Some(short), Some(long)) = (short, long) else {
                return Err(m.err("longrope scaling without its rope_factors_short / rope_factors_long".into()));
            };
            let original = m.num(&key("rope.scaling.original_context_length"))?.map(|n| n as usize);
            let attn = m.num(&key("rope.scaling.attn_factor"))?;
            Some(longrope_from_factors(short, long, original, attn, head_dim).map_err(|e| m.err(e))?)
        }
        None | Some("none") => None,
        Some("linear") => Some(RopeScaling::Linear { factor: m.need(&key("rope.scaling.factor"))? }),
        // YaRN as the converter writes it; what llama.cpp applies on top of YaRN's own attention factor
        // (its attention multiplier, DeepSeek's log multiplier) transformers does not, so it is refused.
        Some("yarn") => {
            for (k, neutral) in [("rope.scaling.attn_factor", 1.0), ("rope.scaling.yarn_log_multiplier", 0.0)] {
                if let Some(v) = m.num(&key(k))?.filter(|v| *v != neutral) {
                    return Err(m.err(format!(
                        "{} = {v}: llama.cpp applies it on top of YaRN's attention factor, transformers does not; \
                         load the model from its HF checkpoint",
                        key(k)
                    )));
                }
            }
            let factor = m.need(&key("rope.scaling.factor"))?;
            if factor < 1.0 {
                return Err(m.err(format!(
                    "{} = {factor}: a RoPE scaling factor must be 1 or more",
                    key("rope.scaling.factor")
                )));
            }
            let original = match m.num(&key("rope.scaling.original_context_length"))? {
                Some(n) => n as usize,
                None => m.num(&key("context_length"))?.unwrap_or(4096.0) as usize,
            };
            Some(RopeScaling::Yarn(crate::rope::Yarn {
                beta_fast: m.num(&key("rope.scaling.yarn_beta_fast"))?,
                beta_slow: m.num(&key("rope.scaling.yarn_beta_slow"))?,
                ..crate::rope::Yarn::new(factor, original)
            }))
        }
        Some(other) => {
            return Err(Error::UnknownRopeType {
                path: path.into(),
                field: key("rope.scaling.type"),
                rope_type: other.into(),
            })
        }
    };
    let layers = m.need(&key("block_count"))? as usize;
    // Phi-3 and Gemma 3 store their window (Phi-3: 0 for none, Phi-4); the others read here have none.
    let window = match m.num(&key("attention.sliding_window"))? {
        Some(w) if w >= 1.0 && matches!(model_type, ModelType::Phi3 | ModelType::Gemma3) => Some(w as usize),
        _ => None,
    };
    let gemma = model_type == ModelType::Gemma3;
    let layer_types = match (gemma, window) {
        // llama.cpp's Gemma 3 with a window: `attention.sliding_window_pattern` (a per-layer array of "is
        // sliding", or N: every N-th layer global), else every 6th layer global (its `load_swa_pattern(ml, 6)`).
        (true, Some(_)) => gemma_layer_types(&m, &key("attention.sliding_window_pattern"), layers)?,
        (false, Some(_)) => vec![LayerType::Sliding; layers],
        // No window written (the converter's `sliding_window_pattern == 1`): every layer global.
        (_, None) => vec![LayerType::Full; layers],
    };
    if let Some(cap) = m.num(&key("final_logit_softcapping"))? {
        if cap != 0.0 {
            return Err(m.err(format!(
                "{} = {cap}: logit soft-capping is not implemented; use a model without it",
                key("final_logit_softcapping")
            )));
        }
    }
    // llama.cpp's Gemma 3 softmax scale: 1/sqrt(hidden / heads) for the 27B (62 layers), 1/sqrt(head_dim) for
    // the others (not in the file); its sliding layers' RoPE base is `rope.freq_base_swa` (written by newer
    // converters), else 10^4, unscaled.
    let query_pre_attn_scalar = gemma.then(|| if layers == 62 { (hidden / heads) as f64 } else { head_dim as f64 });
    let tok_id = |k: &str| -> Result<Option<u32>> { Ok(m.num(k)?.map(|x| x as u32)) };
    Ok(LlamaConfig {
        model_type,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: m.need(&key("feed_forward_length"))? as usize,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: m.num(&key("attention.head_count_kv"))?.unwrap_or(heads as f64) as usize,
        head_dim,
        rms_norm_eps: m.need(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta,
        rope_scaling,
        max_position_embeddings: m.num(&key("context_length"))?.unwrap_or(4096.0) as usize,
        tie_word_embeddings: !ct.tensor_infos.contains_key("output.weight"),
        // Qwen2 always has q/k/v biases; a llama or qwen3 file has them when it stores them.
        attention_bias: model_type == ModelType::Qwen2 || ct.tensor_infos.contains_key("blk.0.attn_q.bias"),
        torch_dtype: None,
        bos_token_id: tok_id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: tok_id("tokenizer.ggml.eos_token_id")?,
        eos_token_ids: tok_id("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
        // transformers reads a GGUF's padding id into the tokenizer, not the config: the family's default.
        pad_token_id: model_type.default_pad_token_id().map(i64::from),
        sliding_window: window,
        layer_types,
        query_pre_attn_scalar,
        rope_local_theta: match gemma {
            true => Some(m.num(&key("rope.freq_base_swa"))?.unwrap_or(10_000.0)),
            false => None,
        },
    })
}

/// Gemma 3's layer types from `key` (`gemma3.attention.sliding_window_pattern`) as llama.cpp reads it: an
/// array of booleans (true: sliding) per layer, or a number N (every N-th layer global); absent: N = 6.
fn gemma_layer_types(m: &Meta, key: &str, layers: usize) -> Result<Vec<LayerType>> {
    if let Some(Value::Array(flags)) = m.get(key) {
        if flags.len() != layers {
            return Err(m.err(format!("`{key}` has {} entries for {layers} layers", flags.len())));
        }
        return flags
            .iter()
            .map(|f| match f {
                Value::Bool(true) => Ok(LayerType::Sliding),
                Value::Bool(false) => Ok(LayerType::Full),
                other => Err(m.err(format!("`{key}` holds {other:?}, not a boolean"))),
            })
            .collect();
    }
    match m.num(key)?.map_or(6, |n| n as usize) {
        // llama.cpp's `set_swa_pattern(0)`: every layer sliding.
        0 => Ok(vec![LayerType::Sliding; layers]),
        every => Ok(LayerType::every_nth_global(layers, every)),
    }
}

/// Imports a llama, qwen2, qwen3, phi3 or gemma3 GGUF file: config, dequantised weights in `dtype` on `device`
/// (Phi-3's fused projections as its HF files hold them: `LlamaModel::from_weights` splits them; Gemma's norms
/// back from llama.cpp's `1 + w` to HF's `w`).
pub fn import_gguf(path: &Path, dtype: DType, device: &Device) -> Result<GgufModel> {
    let gguf_err = |e: candle_core::Error| Error::Gguf { path: path.into(), message: e.to_string() };
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let ct = read_content(&mut file, path)?;
    let config = config_from_gguf(&ct, path)?;
    let expected: HashMap<String, Vec<usize>> = config.expected_tensors().into_iter().collect();

    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    let mut weights = HashMap::new();
    for gguf_name in names {
        if [ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT].contains(&gguf_name.as_str()) {
            continue; // read into config.rope_scaling
        }
        let (heads, kv_heads) = (config.num_attention_heads, config.num_key_value_heads);
        let named = family_hf_name(config.model_type, gguf_name, heads, kv_heads);
        let hf = named.ok_or_else(|| Error::UnexpectedTensor {
            name: gguf_name.clone(),
            found: ct.tensor_infos[gguf_name].shape.dims().to_vec(),
            path: path.into(),
        })?;
        let q = ct.tensor(&mut file, gguf_name, &Device::Cpu).map_err(gguf_err)?;
        let mut t = q.dequantize(&Device::Cpu).map_err(gguf_err)?;
        let shape = expected.get(&hf.name).ok_or_else(|| Error::UnexpectedTensor {
            name: format!("{gguf_name} (HF {})", hf.name),
            found: t.dims().to_vec(),
            path: path.into(),
        })?;
        if t.dims() != shape.as_slice() {
            return Err(Error::ShapeMismatch {
                name: format!("{gguf_name} (HF {})", hf.name),
                expected: shape.clone(),
                found: t.dims().to_vec(),
                path: path.into(),
            });
        }
        if let Some(n_head) = hf.permuted_heads {
            t = unpermute_rows(&t, n_head)?;
        }
        if config.model_type == ModelType::Gemma3 && hf.name.ends_with("norm.weight") {
            // llama.cpp stores Gemma's norms as the scale `1 + w`; the HF weight is `w`.
            t = (t - 1.0)?;
        }
        weights.insert(hf.name, t.to_dtype(dtype)?.to_device(device)?);
    }
    for (name, shape) in config.expected_tensors() {
        if !weights.contains_key(&name) {
            return Err(Error::MissingTensor { name, expected: shape, path: path.into() });
        }
    }
    Ok(GgufModel { config, weights })
}
