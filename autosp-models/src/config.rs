//! `LlamaConfig`: the architecture of a Llama-family model (llama, mistral, qwen2, qwen3, phi3, gemma3_text)
//! read from an HF `config.json`, in both the older spelling (`rope_theta`, `rope_scaling`, `torch_dtype`) and
//! the current one (`rope_parameters`, `dtype`); written back as a config.json HF transformers loads; and the
//! list of HF tensor names and shapes the config implies.

use crate::error::{Error, Result};
use candle_core::DType;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// The model families that share the Llama layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelType {
    /// Llama 2/3/3.x, SmolLM: optional q/k/v/o biases (`attention_bias`).
    Llama,
    /// Mistral: no biases; `sliding_window` (every layer) when set.
    Mistral,
    /// Qwen2: q/k/v always have biases, o_proj never; `use_sliding_window` on the layers `layer_types` names.
    Qwen2,
    /// Qwen3: per-head RMSNorm of q and k (`q_norm`, `k_norm: [head_dim]`) before RoPE, `head_dim` of its own
    /// (128 unless given), biases on q/k/v/o only with `attention_bias`; windows as Qwen2.
    Qwen3,
    /// Phi-3: fused `qkv_proj` and `gate_up_proj` in its files (split on load, fused on save:
    /// [`crate::fused`]), no biases, `sliding_window` (every layer) when set.
    Phi3,
    /// Gemma 3's text model (`gemma3_text`): RMSNorms scaled by `1 + w` around attention and MLP (four per
    /// layer), embeddings scaled by `sqrt(hidden)`, GeGLU (gelu, tanh approximation), q/k norms, the softmax
    /// scale `query_pre_attn_scalar^-0.5`, sliding-window layers with their own RoPE base between global
    /// ones, tied embeddings.
    Gemma3,
}

impl ModelType {
    /// The `model_type` string of config.json.
    pub fn as_str(&self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::Mistral => "mistral",
            ModelType::Qwen2 => "qwen2",
            ModelType::Qwen3 => "qwen3",
            ModelType::Phi3 => "phi3",
            ModelType::Gemma3 => "gemma3_text",
        }
    }

    /// The offset of the RMSNorm scale (`offset + w`: 1 for Gemma, 0 otherwise; see `autosp_core::nn::RmsNorm`).
    pub fn norm_offset(&self) -> f64 {
        if *self == ModelType::Gemma3 {
            1.0
        } else {
            0.0
        }
    }

    /// Whether the files fuse q/k/v and gate/up into one tensor each (Phi-3; see [`crate::fused`]).
    pub fn fuses_projections(&self) -> bool {
        *self == ModelType::Phi3
    }

    /// Whether a layer norms the attention's and the MLP's outputs too (Gemma's four norms per layer).
    pub fn sandwich_norms(&self) -> bool {
        *self == ModelType::Gemma3
    }

    /// The MLP gate's activation.
    pub fn activation(&self) -> crate::llama::Activation {
        if *self == ModelType::Gemma3 {
            crate::llama::Activation::GeluTanh
        } else {
            crate::llama::Activation::Silu
        }
    }

    /// The `pad_token_id` transformers' config class gives when config.json has none: 32000 for Phi-3, 0 for
    /// Gemma 3, none for the others (`Phi3Config`, `Gemma3TextConfig`, ..; transformers 5).
    pub fn default_pad_token_id(&self) -> Option<u32> {
        match self {
            ModelType::Phi3 => Some(32000),
            ModelType::Gemma3 => Some(0),
            ModelType::Llama | ModelType::Mistral | ModelType::Qwen2 | ModelType::Qwen3 => None,
        }
    }

    /// Whether q and k get a per-head RMSNorm before RoPE (Qwen3).
    pub fn qk_norm(&self) -> bool {
        matches!(self, ModelType::Qwen3 | ModelType::Gemma3)
    }

    fn architecture(&self) -> &'static str {
        match self {
            ModelType::Llama => "LlamaForCausalLM",
            ModelType::Mistral => "MistralForCausalLM",
            ModelType::Qwen2 => "Qwen2ForCausalLM",
            ModelType::Qwen3 => "Qwen3ForCausalLM",
            ModelType::Phi3 => "Phi3ForCausalLM",
            ModelType::Gemma3 => "Gemma3ForCausalLM",
        }
    }
}

pub use crate::rope::RopeScaling;

/// The attention of one decoder layer, as HF's `layer_types` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Every earlier token (`full_attention`).
    Full,
    /// The `sliding_window` tokens up to and including the query (`sliding_attention`), when the config's
    /// window is on; full otherwise.
    Sliding,
}

impl LayerType {
    /// Gemma's pattern over `layers` layers: every `every`-th layer global, the others sliding (Gemma 3's
    /// `sliding_window_pattern`, 6 by default and in llama.cpp).
    pub fn every_nth_global(layers: usize, every: usize) -> Vec<LayerType> {
        let every = every.max(1);
        (0..layers).map(|i| if (i + 1) % every != 0 { LayerType::Sliding } else { LayerType::Full }).collect()
    }

    fn as_str(self) -> &'static str {
        match self {
            LayerType::Full => "full_attention",
            LayerType::Sliding => "sliding_attention",
        }
    }
}

/// The architecture of a Llama-family decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub model_type: ModelType,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Key/value heads (GQA when smaller than `num_attention_heads`, MQA when 1).
    pub num_key_value_heads: usize,
    /// Per-head dimension; `hidden_size / num_attention_heads` unless config.json gives `head_dim`.
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections have biases (always true for qwen2; for llama also the o_proj bias).
    pub attention_bias: bool,
    /// dtype the checkpoint was saved in (`torch_dtype` / `dtype`), if given.
    pub torch_dtype: Option<DType>,
    pub bos_token_id: Option<u32>,
    /// The first end-of-sequence id (the one text is ended with).
    pub eos_token_id: Option<u32>,
    /// Every end-of-sequence id config.json lists (Llama 3 instruct lists three; one when it gives a number),
    /// written back as it was given.
    pub eos_token_ids: Vec<u32>,
    /// The padding token (`pad_token_id`; the family's default when config.json has none, none when it says
    /// `null`; negative counts from the end, as PyTorch's `padding_idx`): every family's transformers model
    /// makes it its embedding's `padding_idx`, whose row the lookup gives no gradient
    /// ([`padding_idx`](Self::padding_idx)).
    pub pad_token_id: Option<i64>,
    /// The attention window in tokens (HF `sliding_window`: a query sees itself and the `w - 1` tokens
    /// before it) of the layers `layer_types` marks sliding; `None`: every layer attends to every earlier
    /// token (Mistral's `sliding_window: null`, Qwen's `use_sliding_window: false`).
    pub sliding_window: Option<usize>,
    /// Each layer's attention (`num_hidden_layers` entries).
    pub layer_types: Vec<LayerType>,
    /// Gemma 3's `query_pre_attn_scalar`: the softmax scale is its `-1/2` power instead of `head_dim`'s.
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 3's RoPE base of the sliding-window layers (`rope_local_base_freq`), unscaled; `rope_theta`
    /// and `rope_scaling` are then the global layers'.
    pub rope_local_theta: Option<f64>,
}

/// Reads a config field through the JSON object, recording which file it came from for errors.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn get(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }
    fn invalid(&self, field: &str, v: &Value, reason: &str) -> Error {
        Error::InvalidField {
            path: self.path.to_path_buf(),
            field: field.into(),
            value: v.to_string(),
            reason: reason.into(),
        }
    }
    fn usize_opt(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.invalid(field, v, "expected a non-negative integer")),
        }
    }
    fn usize(&self, field: &str) -> Result<usize> {
        self.usize_opt(field)?.ok_or_else(|| Error::MissingField { path: self.path.to_path_buf(), field: field.into() })
    }
    fn f64_opt(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.invalid(field, v, "expected a number")),
        }
    }
    fn bool_opt(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.invalid(field, v, "expected true or false")),
        }
    }
    /// Every id of a token-id field that may be a list (`eos_token_id`), in order; none when absent.
    fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as u32).ok_or_else(|| self.invalid(field, v, "expected token ids")))
                .collect(),
            Some(_) => Ok(self.token_id(field)?.into_iter().collect()),
        }
    }
    fn token_id(&self, field: &str) -> Result<Option<u32>> {
        // eos_token_id may be a list (Llama 3 instruct); the first id is the primary one.
        match self.get(field) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(a.first().and_then(|v| v.as_u64()).map(|x| x as u32)),
            Some(v) => v.as_u64().map(|x| Some(x as u32)).ok_or_else(|| self.invalid(field, v, "expected a token id")),
        }
    }
}

fn parse_dtype(s: &str) -> Option<DType> {
    match s.trim_start_matches("torch.") {
        "float32" | "float" => Some(DType::F32),
        "bfloat16" => Some(DType::BF16),
        "float16" | "half" => Some(DType::F16),
        _ => None,
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    }
}

/// Parses `rope_scaling` (old) or `rope_parameters` (new) at `field` into the theta (new spelling only) and
/// the scaling ([`crate::rope`] reads each type).
fn parse_rope(
    f: &Fields,
    field: &str,
    v: &Value,
    ctx: &crate::rope::ScalingContext,
) -> Result<(Option<f64>, Option<RopeScaling>)> {
    let obj = v.as_object().ok_or_else(|| f.invalid(field, v, "expected an object"))?;
    let sub = Fields { obj, path: f.path };
    let theta = sub.f64_opt("rope_theta")?;
    if let Some(v) = sub.get("partial_rotary_factor") {
        if v.as_f64() != Some(1.0) {
            return Err(Error::Unsupported {
                path: f.path.into(),
                field: format!("{field}.partial_rotary_factor"),
                value: v.to_string(),
                reason: "RoPE on part of the head is not implemented".into(),
            });
        }
    }
    let scaling = crate::rope::parse_scaling(&crate::rope::Params::new(obj, f.path, field), ctx)?;
    Ok((theta, scaling))
}

/// `layer_types`: one `full_attention` or `sliding_attention` per layer.
fn layer_types(f: &Fields, layers: usize) -> Result<Vec<LayerType>> {
    let v = f.get("layer_types").expect("called when present");
    let Value::Array(types) = v else { return Err(f.invalid("layer_types", v, "expected a list of layer types")) };
    if types.len() != layers {
        return Err(f.invalid(
            "layer_types",
            v,
            &format!("has {} entries for num_hidden_layers = {layers}", types.len()),
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(LayerType::Full),
            Some("sliding_attention") => Ok(LayerType::Sliding),
            _ => Err(Error::Unsupported {
                path: f.path.into(),
                field: "layer_types".into(),
                value: t.to_string(),
                reason: "only full_attention and sliding_attention layers are implemented".into(),
            }),
        })
        .collect()
}

/// The window and each layer's attention, as transformers reads them:
/// - Mistral: `sliding_window` (4096 when absent, `null` for none) on every layer; Phi-3 the same, none when
///   absent;
/// - Qwen2/Qwen3: `sliding_window` (default 4096) only with `use_sliding_window`, on the layers `layer_types`
///   marks `sliding_attention` (when absent: from `max_window_layers`, default 28, on);
/// - Gemma 3: `sliding_window` (default 4096) on the layers `layer_types` marks (when absent: all but every
///   `sliding_window_pattern`-th, default 6);
/// - Llama has no window: a `sliding_window` below `max_position_embeddings` is refused (transformers' Llama
///   would not apply it; say `null` to load the model without one).
fn parse_windows(
    f: &Fields,
    model_type: ModelType,
    layers: usize,
    max_position_embeddings: usize,
) -> Result<(Option<usize>, Vec<LayerType>)> {
    let window = |default: Option<usize>| -> Result<Option<usize>> {
        match f.obj.get("sliding_window") {
            None => Ok(default),
            Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(w) if w >= 1 => Ok(Some(w as usize)),
                _ => Err(f.invalid("sliding_window", v, "expected a window of 1 token or more, or null")),
            },
        }
    };
    match model_type {
        ModelType::Llama => {
            if let Some(w) = window(None)? {
                if w < max_position_embeddings {
                    return Err(Error::Unsupported {
                        path: f.path.into(),
                        field: "sliding_window".into(),
                        value: w.to_string(),
                        reason: format!(
                            "a llama model has no attention window and a window smaller than \
                             max_position_embeddings = {max_position_embeddings} would change the maths; set \
                             sliding_window to null, or model_type to mistral if the model was trained with it"
                        ),
                    });
                }
            }
            Ok((None, vec![LayerType::Full; layers]))
        }
        ModelType::Mistral | ModelType::Phi3 => {
            // Mistral's default window is 4096 tokens, Phi-3's none.
            let w = window(if model_type == ModelType::Mistral { Some(4096) } else { None })?;
            Ok((w, vec![if w.is_some() { LayerType::Sliding } else { LayerType::Full }; layers]))
        }
        ModelType::Gemma3 => {
            let w = window(Some(4096))?;
            let types = match f.get("layer_types") {
                Some(_) => layer_types(f, layers)?,
                None => LayerType::every_nth_global(layers, f.usize_opt("sliding_window_pattern")?.unwrap_or(6)),
            };
            Ok((w, types))
        }
        ModelType::Qwen2 | ModelType::Qwen3 => {
            let on = f.bool_opt("use_sliding_window")?.unwrap_or(false);
            let w = if on { window(Some(4096))? } else { None };
            let types = match f.get("layer_types") {
                Some(_) => layer_types(f, layers)?,
                None => {
                    let from = f.usize_opt("max_window_layers")?.unwrap_or(28);
                    (0..layers)
                        .map(|i| if w.is_some() && i >= from { LayerType::Sliding } else { LayerType::Full })
                        .collect()
                }
            };
            Ok((w, types))
        }
    }
}

impl LlamaConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parses config.json text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let v: Value =
            serde_json::from_str(text).map_err(|e| Error::Json { path: path.to_path_buf(), message: e.to_string() })?;
        let obj = v.as_object().ok_or_else(|| Error::Json {
            path: path.to_path_buf(),
            message: "the top level is not an object".into(),
        })?;
        Self::from_json_object(obj, path)
    }

    fn from_json_object(obj: &Map<String, Value>, path: &Path) -> Result<Self> {
        let f = Fields { obj, path };
        let model_type = match f.get("model_type").and_then(|v| v.as_str()) {
            Some("llama") => ModelType::Llama,
            Some("mistral") => ModelType::Mistral,
            Some("qwen2") => ModelType::Qwen2,
            Some("qwen3") => ModelType::Qwen3,
            Some("phi3") => ModelType::Phi3,
            Some("gemma3_text") => ModelType::Gemma3,
            Some("gemma3") => {
                return Err(Error::Unsupported {
                    path: path.into(),
                    field: "model_type".into(),
                    value: "\"gemma3\"".into(),
                    reason: "this is Gemma 3's vision-language checkpoint (Gemma3ForConditionalGeneration); load a \
                             text-only one (model_type gemma3_text, e.g. google/gemma-3-1b-it)"
                        .into(),
                })
            }
            Some(other) => return Err(Error::UnknownModelType { path: path.into(), model_type: other.into() }),
            None => return Err(Error::MissingField { path: path.into(), field: "model_type".into() }),
        };
        let unsupported = |field: &str, v: &Value, reason: &str| Error::Unsupported {
            path: path.into(),
            field: field.into(),
            value: v.to_string(),
            reason: reason.into(),
        };

        let vocab_size = f.usize("vocab_size")?;
        let hidden_size = f.usize("hidden_size")?;
        let intermediate_size = f.usize("intermediate_size")?;
        let num_hidden_layers = f.usize("num_hidden_layers")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let num_key_value_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_attention_heads == 0 || num_key_value_heads == 0 {
            return Err(f.invalid("num_attention_heads", &json!(num_attention_heads), "head counts must be positive"));
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.invalid(
                "num_key_value_heads",
                &json!(num_key_value_heads),
                &format!("must divide num_attention_heads = {num_attention_heads}"),
            ));
        }
        let head_dim = match f.usize_opt("head_dim")? {
            Some(h) => h,
            // Qwen3Config's and Gemma3TextConfig's defaults, whatever hidden / heads is.
            None if model_type == ModelType::Qwen3 => 128,
            None if model_type == ModelType::Gemma3 => 256,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(f.invalid(
                        "hidden_size",
                        &json!(hidden_size),
                        &format!("not divisible by num_attention_heads = {num_attention_heads}; give head_dim"),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim % 2 != 0 {
            return Err(f.invalid("head_dim", &json!(head_dim), "RoPE needs an even head_dim"));
        }

        // RoPE: new spelling `rope_parameters` (theta inside), old `rope_theta` + `rope_scaling`; Gemma 3's
        // new spelling has one set per layer type, its old one `rope_local_base_freq` for the sliding layers.
        let gemma = model_type == ModelType::Gemma3;
        let max_position_embeddings = f.usize_opt("max_position_embeddings")?.unwrap_or(4096);
        let ctx = crate::rope::ScalingContext {
            phi3: model_type == ModelType::Phi3,
            head_dim,
            max_position_embeddings,
            top_level_original: f.usize_opt("original_max_position_embeddings")?,
        };
        let mut rope_theta = f.f64_opt("rope_theta")?;
        let mut rope_local_theta =
            if gemma { Some(f.f64_opt("rope_local_base_freq")?.unwrap_or(10_000.0)) } else { None };
        let mut rope_scaling = None;
        for field in ["rope_scaling", "rope_parameters"] {
            let Some(v) = f.get(field) else { continue };
            let per_type = v.get("full_attention").or_else(|| v.get("sliding_attention")).is_some();
            if gemma && per_type {
                if let Some(full) = v.get("full_attention") {
                    let (theta, scaling) = parse_rope(&f, &format!("{field}.full_attention"), full, &ctx)?;
                    rope_theta = theta.or(rope_theta);
                    rope_scaling = scaling.or(rope_scaling);
                }
                if let Some(local) = v.get("sliding_attention") {
                    let at = format!("{field}.sliding_attention");
                    let (theta, scaling) = parse_rope(&f, &at, local, &ctx)?;
                    if scaling.is_some() {
                        return Err(unsupported(&at, local, "RoPE scaling on the sliding layers is not implemented"));
                    }
                    rope_local_theta = theta.or(rope_local_theta);
                }
                continue;
            }
            let (theta, scaling) = parse_rope(&f, field, v, &ctx)?;
            if theta.is_some() {
                rope_theta = theta;
            }
            if scaling.is_some() {
                rope_scaling = scaling;
            }
        }
        let rope_theta = rope_theta.unwrap_or(if gemma { 1_000_000.0 } else { 10000.0 });
        if let Some(v) = f.get("partial_rotary_factor") {
            if v.as_f64() != Some(1.0) {
                return Err(unsupported("partial_rotary_factor", v, "RoPE on part of the head is not implemented"));
            }
        }

        if model_type == ModelType::Phi3 {
            for field in ["resid_pdrop", "embd_pdrop", "attention_dropout"] {
                if let Some(v) = f.get(field) {
                    if v.as_f64() != Some(0.0) {
                        return Err(unsupported(field, v, "dropout is not implemented; set it to 0.0"));
                    }
                }
            }
        }
        if gemma {
            for field in ["hidden_activation", "hidden_act"] {
                if let Some(v) = f.get(field) {
                    if v.as_str() != Some("gelu_pytorch_tanh") {
                        return Err(unsupported(field, v, "Gemma's GeGLU with gelu_pytorch_tanh is implemented"));
                    }
                }
            }
            for field in ["attn_logit_softcapping", "final_logit_softcapping"] {
                if let Some(v) = f.get(field) {
                    return Err(unsupported(
                        field,
                        v,
                        "logit soft-capping (Gemma 2) is not implemented; Gemma 3 has none",
                    ));
                }
            }
            if f.bool_opt("use_bidirectional_attention")? == Some(true) {
                return Err(unsupported(
                    "use_bidirectional_attention",
                    &json!(true),
                    "only causal attention is implemented",
                ));
            }
        } else if let Some(v) = f.get("hidden_act") {
            if v.as_str() != Some("silu") {
                return Err(unsupported("hidden_act", v, "only silu (SwiGLU) is implemented"));
            }
        }
        if f.bool_opt("mlp_bias")? == Some(true) {
            return Err(unsupported("mlp_bias", &json!(true), "MLP biases are not implemented"));
        }

        let (sliding_window, layer_types) = parse_windows(&f, model_type, num_hidden_layers, max_position_embeddings)?;

        let attention_bias = match model_type {
            ModelType::Qwen2 => true,
            ModelType::Mistral | ModelType::Phi3 => false,
            ModelType::Llama | ModelType::Qwen3 | ModelType::Gemma3 => f.bool_opt("attention_bias")?.unwrap_or(false),
        };
        let torch_dtype = match f.get("dtype").or_else(|| f.get("torch_dtype")) {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .and_then(parse_dtype)
                    .ok_or_else(|| f.invalid("torch_dtype", v, "expected float32, bfloat16 or float16"))?,
            ),
        };

        Ok(LlamaConfig {
            model_type,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(gemma),
            attention_bias,
            torch_dtype,
            bos_token_id: f.token_id("bos_token_id")?,
            eos_token_id: f.token_id("eos_token_id")?,
            eos_token_ids: f.token_ids("eos_token_id")?,
            pad_token_id: match (obj.get("pad_token_id"), f.get("pad_token_id")) {
                (None, _) => model_type.default_pad_token_id().map(i64::from),
                (Some(_), None) => None,
                (Some(_), Some(v)) => {
                    Some(v.as_i64().ok_or_else(|| f.invalid("pad_token_id", v, "expected a token id or null"))?)
                }
            },
            sliding_window,
            layer_types,
            query_pre_attn_scalar: if gemma {
                Some(f.f64_opt("query_pre_attn_scalar")?.unwrap_or(256.0))
            } else {
                None
            },
            rope_local_theta,
        })
    }

    /// The softmax scale when it is not `1 / sqrt(head_dim)` (Gemma 3: `query_pre_attn_scalar^-1/2`).
    pub fn attention_scale(&self) -> Option<f64> {
        self.query_pre_attn_scalar.map(|s| 1.0 / s.sqrt())
    }

    /// The embedding row that gets no gradient from the lookup (`nn.Embedding`'s `padding_idx`):
    /// `pad_token_id` when it is inside the vocabulary, a negative one counted from the end as PyTorch does
    /// (transformers would refuse to build a model whose pad id is outside; such a config is loaded here with
    /// no padding row).
    pub fn padding_idx(&self) -> Option<usize> {
        let vocab = self.vocab_size as i64;
        let p = self.pad_token_id?;
        let p = if p < 0 { vocab + p } else { p };
        (0..vocab).contains(&p).then_some(p as usize)
    }

    /// The factor the embeddings are multiplied by (Gemma: `sqrt(hidden_size)`), if any.
    pub fn embed_scale(&self) -> Option<f64> {
        (self.model_type == ModelType::Gemma3).then(|| (self.hidden_size as f64).sqrt())
    }

    /// True when o_proj has a bias (llama and qwen3 with attention_bias; never qwen2 or mistral).
    pub fn o_proj_bias(&self) -> bool {
        self.attention_bias && matches!(self.model_type, ModelType::Llama | ModelType::Qwen3 | ModelType::Gemma3)
    }

    /// The attention window of layer `layer` as autosp counts it (the largest distance from a query back to a
    /// key it sees, [`AttentionSpec::max_distance`](autosp_core::ops::AttentionSpec)): `sliding_window - 1`
    /// for a sliding layer when the window is on, else `None` (every earlier token).
    pub fn attention_window(&self, layer: usize) -> Option<usize> {
        match self.layer_types.get(layer) {
            Some(LayerType::Sliding) => self.sliding_window.map(|w| w - 1),
            _ => None,
        }
    }

    /// config.json text HF transformers loads (both 4.x and 5.x): the older `rope_theta` / `rope_scaling`
    /// / `torch_dtype` spelling, which current transformers still reads.
    pub fn to_json(&self) -> String {
        let mut m = Map::new();
        m.insert("architectures".into(), json!([self.model_type.architecture()]));
        m.insert("model_type".into(), json!(self.model_type.as_str()));
        m.insert("vocab_size".into(), json!(self.vocab_size));
        m.insert("hidden_size".into(), json!(self.hidden_size));
        m.insert("intermediate_size".into(), json!(self.intermediate_size));
        m.insert("num_hidden_layers".into(), json!(self.num_hidden_layers));
        m.insert("num_attention_heads".into(), json!(self.num_attention_heads));
        m.insert("num_key_value_heads".into(), json!(self.num_key_value_heads));
        m.insert("head_dim".into(), json!(self.head_dim));
        if self.model_type == ModelType::Gemma3 {
            m.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
        } else {
            m.insert("hidden_act".into(), json!("silu"));
        }
        m.insert("rms_norm_eps".into(), json!(self.rms_norm_eps));
        m.insert("rope_theta".into(), json!(self.rope_theta));
        // Every field of the scaling, so that every loader computes the same positions; Phi-3's window is also
        // top-level, where its Phi3Config reads it (default 4096 otherwise).
        let scaling = self.rope_scaling.as_ref().map_or(Value::Null, RopeScaling::to_json);
        if let (ModelType::Phi3, Some(original)) =
            (self.model_type, self.rope_scaling.as_ref().and_then(RopeScaling::original_max_position_embeddings))
        {
            m.insert("original_max_position_embeddings".into(), json!(original));
        }
        m.insert("rope_scaling".into(), scaling);
        m.insert("max_position_embeddings".into(), json!(self.max_position_embeddings));
        m.insert("tie_word_embeddings".into(), json!(self.tie_word_embeddings));
        match self.model_type {
            ModelType::Llama => {
                m.insert("attention_bias".into(), json!(self.attention_bias));
                m.insert("mlp_bias".into(), json!(false));
            }
            ModelType::Mistral | ModelType::Phi3 => {
                m.insert("sliding_window".into(), json!(self.sliding_window));
            }
            ModelType::Gemma3 => {
                m.insert("attention_bias".into(), json!(self.attention_bias));
                // transformers 5.x types it `int` and refuses `256.0`: a whole value is written as an integer.
                let scalar = self.query_pre_attn_scalar.map(|s| match s.fract() == 0.0 && s.abs() < 1e15 {
                    true => json!(s as i64),
                    false => json!(s),
                });
                m.insert("query_pre_attn_scalar".into(), json!(scalar));
                m.insert("rope_local_base_freq".into(), json!(self.rope_local_theta));
                m.insert("sliding_window".into(), json!(self.sliding_window));
                m.insert("layer_types".into(), json!(self.layer_types.iter().map(|t| t.as_str()).collect::<Vec<_>>()));
                m.insert("attn_logit_softcapping".into(), Value::Null);
                m.insert("final_logit_softcapping".into(), Value::Null);
            }
            ModelType::Qwen2 | ModelType::Qwen3 => {
                if self.model_type == ModelType::Qwen3 {
                    m.insert("attention_bias".into(), json!(self.attention_bias));
                }
                m.insert("use_sliding_window".into(), json!(self.sliding_window.is_some()));
                m.insert("sliding_window".into(), json!(self.sliding_window));
                let first_sliding = self.layer_types.iter().position(|t| *t == LayerType::Sliding);
                m.insert("max_window_layers".into(), json!(first_sliding.unwrap_or(self.num_hidden_layers)));
                m.insert("layer_types".into(), json!(self.layer_types.iter().map(|t| t.as_str()).collect::<Vec<_>>()));
            }
        }
        if let Some(d) = self.torch_dtype {
            m.insert("torch_dtype".into(), json!(dtype_name(d)));
        }
        m.insert("bos_token_id".into(), json!(self.bos_token_id));
        let eos = if self.eos_token_ids.len() > 1 { json!(self.eos_token_ids) } else { json!(self.eos_token_id) };
        m.insert("eos_token_id".into(), eos);
        // Always written (null for none), so no family default stands in for what the model trained with.
        m.insert("pad_token_id".into(), json!(self.pad_token_id));
        serde_json::to_string_pretty(&Value::Object(m)).expect("a JSON map always serialises")
    }

    /// Every HF tensor name of this model's files with its shape, in a fixed order (embedding, layers, norm,
    /// head). Phi-3's files fuse q/k/v and gate/up ([`crate::fused`]); the model holds them split.
    ///
    /// Shapes are PyTorch `nn.Linear` weights: `[out_features, in_features]`.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let q = self.num_attention_heads * hd;
        let kv = self.num_key_value_heads * hd;
        let i = self.intermediate_size;
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab_size, h])];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let fused = self.model_type.fuses_projections();
            if fused {
                t.push((format!("{p}.self_attn.qkv_proj.weight"), vec![q + 2 * kv, h]));
            } else {
                t.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
                t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
                t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            }
            t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            if self.attention_bias {
                t.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
                t.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
                t.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
            }
            if self.o_proj_bias() {
                t.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
            }
            if self.model_type.qk_norm() {
                t.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
                t.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
            }
            if fused {
                t.push((format!("{p}.mlp.gate_up_proj.weight"), vec![2 * i, h]));
            } else {
                t.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
                t.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            }
            t.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
            t.push((format!("{p}.input_layernorm.weight"), vec![h]));
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            if self.model_type.sandwich_norms() {
                t.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![h]));
                t.push((format!("{p}.post_feedforward_layernorm.weight"), vec![h]));
            }
        }
        t.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            t.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        }
        t
    }

    /// The path of `config.json` inside a model directory.
    pub fn path_in(dir: &Path) -> PathBuf {
        dir.join("config.json")
    }
}

impl LlamaConfig {
    /// This config's RoPE inverse frequencies `[head_dim / 2]` for a sequence inside the original window
    /// (what transformers' rotary embedding holds after `__init__`); see [`rope_frequencies`](Self::rope_frequencies).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        self.rope_frequencies(0).inv_freq
    }

    /// The RoPE frequencies and attention factor of the (global, for Gemma 3) layers for a forward pass over
    /// `seq_len` tokens (`max(position) + 1`; read by `dynamic` and `longrope` only).
    pub fn rope_frequencies(&self, seq_len: usize) -> crate::rope::RopeFrequencies {
        crate::rope::rope_frequencies(
            self.head_dim,
            self.rope_theta,
            self.max_position_embeddings,
            self.rope_scaling.as_ref(),
            seq_len,
        )
    }

    /// Extends (or, with `none`, un-scales) the model's context window: sets `rope_scaling` and
    /// `max_position_embeddings` as [`RopeExtension::extend`](crate::rope::RopeExtension::extend) gives them
    /// (`rope_theta` stays, written explicitly); returns what it did, with the line a run prints. Phi-3 is
    /// refused (transformers' Phi3Config takes only `longrope`, and reads `yarn` as it).
    pub fn extend_rope(&mut self, extension: &crate::rope::RopeExtension) -> Result<crate::rope::RopeExtended> {
        if self.model_type == ModelType::Phi3 && *extension != crate::rope::RopeExtension::None {
            return Err(Error::RopeExtensionRefused {
                spec: extension.to_string(),
                reason: "a phi3 model takes only a longrope scaling (transformers' Phi3Config reads any other as \
                         longrope), which --rope-scaling does not make; train it without --rope-scaling"
                    .into(),
            });
        }
        let extended = extension.extend(self.rope_scaling.as_ref(), self.max_position_embeddings)?;
        self.rope_scaling = extended.scaling.clone();
        self.max_position_embeddings = extended.max_position_embeddings;
        Ok(extended)
    }

    /// The RoPE inverse frequencies of the sliding-window layers when they have a base of their own (Gemma 3's
    /// `rope_local_base_freq`, unscaled), else `None`: they use [`rope_inv_freq`](Self::rope_inv_freq).
    pub fn rope_inv_freq_local(&self) -> Option<Vec<f64>> {
        self.rope_local_theta.map(|theta| crate::rope::default_inv_freq(self.head_dim, theta))
    }
}
