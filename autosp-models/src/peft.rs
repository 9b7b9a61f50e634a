//! LoRA adapters in PEFT's layout, which `peft.PeftModel.from_pretrained(base, dir)` loads:
//! `adapter_config.json` (`peft_type: LORA`, `r`, `lora_alpha`, `lora_dropout`, `target_modules`,
//! `modules_to_save`, `base_model_name_or_path`) and `adapter_model.safetensors`, whose tensors carry PEFT's
//! names: `base_model.model.` + the HF name (`...q_proj.lora_A.weight: [r, in]`, `...lora_B.weight: [out, r]`,
//! and the whole weights of the modules trained beside the adapters, `embed_tokens` and the norms). The files
//! are written aside and renamed into place, like [`crate::save_model`].

use std::collections::HashMap;
use std::path::Path;

use autosp_core::lora::LoraConfig;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::save::{match_permissions, replace_dir, sibling};

/// The adapter's config file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter's weights file.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The config.json of the model the adapter was trained on (the base with the run's RoPE scaling), written
/// beside a LoRA checkpoint's adapter: PEFT loads the base's own config, whose positions differ when the run
/// extended the window, so `AutoModelForCausalLM.from_pretrained(dir, config=AutoConfig.from_pretrained(
/// f"{dir}/base_config.json"))` loads it as trained. Not `config.json`: with one there transformers takes the
/// directory for a whole model and fails on the missing weights.
pub const BASE_CONFIG: &str = "base_config.json";
/// What PEFT puts before a causal LM's own tensor names.
const PREFIX: &str = "base_model.model.";

/// A saved adapter: its settings, its tensors under the model's own names (`model.layers.0.self_attn.q_proj.
/// lora_A.weight`, `model.embed_tokens.weight`, ..), and the base model it was trained on.
#[derive(Clone, Debug)]
pub struct Adapter {
    /// Rank, alpha, dropout, targets and what else trained.
    pub config: LoraConfig,
    /// Tensors by the model's names.
    pub weights: HashMap<String, Tensor>,
    /// `base_model_name_or_path`, when the file names one.
    pub base_model: Option<String>,
}

/// Whether `dir` holds an adapter (its `adapter_config.json`).
pub fn is_adapter(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
}

/// The config of the model the adapter in `dir` was trained on ([`BASE_CONFIG`]), when the directory has one
/// (adapters written by PEFT, or by autosp before it was written, have none).
pub fn base_config(dir: &Path) -> Result<Option<crate::LlamaConfig>> {
    let path = dir.join(BASE_CONFIG);
    if !path.is_file() {
        return Ok(None);
    }
    crate::LlamaConfig::from_file(&path).map(Some)
}

/// PEFT's `modules_to_save` for what trains beside the adapters (`lm_head` too for a tied embedding, so that
/// PEFT's untied copy of the head gets the trained table).
fn modules_to_save(config: &LoraConfig, tied: bool) -> Vec<&'static str> {
    let mut m = Vec::new();
    if config.train_embed {
        m.push("embed_tokens");
        if tied {
            m.push("lm_head");
        }
    }
    if config.train_norm {
        m.push("norm");
    }
    m
}

/// Writes the adapter into `dir` (replacing one there only once the new one is complete): `config`,
/// `weights` by the model's names (the adapters' and the trained modules' tensors, in `dtype` on disk or their
/// own), `base_model` as PEFT's `base_model_name_or_path`; `tied`: the model's head is its embedding.
pub fn save_adapter(
    dir: &Path,
    config: &LoraConfig,
    weights: &HashMap<String, Tensor>,
    base_model: &str,
    tied: bool,
    dtype: Option<DType>,
) -> Result<()> {
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len() + 1);
    for name in names {
        let t = weights[name].to_device(&Device::Cpu)?;
        let t = match dtype {
            Some(d) => t.to_dtype(d)?,
            None => t,
        };
        if tied && name == "model.embed_tokens.weight" {
            tensors.push((format!("{PREFIX}lm_head.weight"), t.contiguous()?));
        }
        tensors.push((format!("{PREFIX}{name}"), t.contiguous()?));
    }
    let doc = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": config.targets,
        "modules_to_save": if config.train_embed || config.train_norm {
            Value::from(modules_to_save(config, tied))
        } else {
            Value::Null
        },
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    });
    let tmp = sibling(dir, "tmp")?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = (|| -> Result<()> {
        let cfg = tmp.join(ADAPTER_CONFIG);
        let text = serde_json::to_string_pretty(&doc).expect("a JSON map always serialises");
        std::fs::write(&cfg, text).map_err(|e| Error::io(&cfg, e))?;
        let path = tmp.join(ADAPTER_WEIGHTS);
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        let data: Vec<(&str, &Tensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        safetensors::serialize_to_file(data, Some(meta), &path)
            .map_err(|e| Error::Safetensors { path: path.clone(), message: e.to_string() })?;
        match_permissions(&path, &cfg)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    replace_dir(&tmp, dir)
}

/// Reads the adapter in `dir` (PEFT's layout, written by [`save_adapter`] or by PEFT itself): settings and
/// tensors under the model's names, in the file's dtype on the CPU. A tied model's `lm_head.weight` copy is dropped (the
/// embedding's is the one that counts). Only LoRA adapters without per-layer ranks, DoRA or rsLoRA load.
pub fn load_adapter(dir: &Path) -> Result<Adapter> {
    let cfg_path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
    let doc: Value =
        serde_json::from_str(&text).map_err(|e| Error::Json { path: cfg_path.clone(), message: e.to_string() })?;
    let field = |k: &str| doc.get(k).filter(|v| !v.is_null());
    let need = |k: &str| field(k).ok_or_else(|| Error::MissingField { path: cfg_path.clone(), field: k.into() });
    let unsupported = |k: &str, v: &Value, reason: &str| Error::Unsupported {
        path: cfg_path.clone(),
        field: k.into(),
        value: v.to_string(),
        reason: reason.into(),
    };
    let kind = need("peft_type")?;
    if kind.as_str() != Some("LORA") {
        return Err(unsupported("peft_type", kind, "only LoRA adapters load"));
    }
    for (k, reason) in [
        ("use_dora", "DoRA adapters are not supported; merge it with PEFT first"),
        ("use_rslora", "rsLoRA's scaling is not supported"),
        ("fan_in_fan_out", "adapters of Conv1D layers (GPT-2 style) do not fit a Llama-family model"),
    ] {
        if let Some(v) = field(k).filter(|v| v.as_bool() == Some(true)) {
            return Err(unsupported(k, v, reason));
        }
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if let Some(v) = field(k).filter(|v| v.as_object().is_some_and(|m| !m.is_empty())) {
            return Err(unsupported(k, v, "per-layer ranks or alphas are not supported"));
        }
    }
    let r = need("r")?;
    let r = r.as_u64().filter(|&r| r > 0).ok_or_else(|| unsupported("r", r, "the rank must be a whole number"))?;
    let mut config = LoraConfig::new(r as usize);
    if let Some(a) = field("lora_alpha") {
        config.alpha = a.as_f64().ok_or_else(|| unsupported("lora_alpha", a, "alpha must be a number"))?;
    } else {
        config.alpha = 8.0; // PEFT's default
    }
    config.dropout = field("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0) as f32;
    let targets = need("target_modules")?;
    config.targets = match targets {
        Value::Array(a) => a.iter().filter_map(|t| t.as_str().map(str::to_string)).collect(),
        Value::String(s) => {
            return Err(unsupported(
                "target_modules",
                targets,
                &format!("a regex (`{s}`) is not supported: list the modules"),
            ))
        }
        _ => return Err(unsupported("target_modules", targets, "give a list of module names")),
    };
    if let Some(m) = field("modules_to_save").and_then(Value::as_array) {
        for name in m.iter().filter_map(Value::as_str) {
            match name {
                "embed_tokens" => config.train_embed = true,
                "lm_head" => {}
                n if n.ends_with("norm") => config.train_norm = true,
                n => {
                    return Err(unsupported(
                        "modules_to_save",
                        &Value::from(n),
                        "only embed_tokens, lm_head (tied) and norms can train beside the adapters",
                    ))
                }
            }
        }
    }
    let path = dir.join(ADAPTER_WEIGHTS);
    let raw = candle_core::safetensors::load(&path, &Device::Cpu)
        .map_err(|e| Error::Safetensors { path: path.clone(), message: e.to_string() })?;
    let mut weights = HashMap::new();
    for (name, t) in raw {
        let Some(own) = name.strip_prefix(PREFIX) else {
            return Err(Error::UnexpectedTensor { name, found: t.dims().to_vec(), path });
        };
        // PEFT files may keep the adapter's name (`lora_A.default.weight`); ours never do.
        let own = own.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.");
        if own == "lm_head.weight" && config.train_embed {
            continue;
        }
        weights.insert(own, t);
    }
    let base_model = field("base_model_name_or_path").and_then(Value::as_str).map(str::to_string);
    Ok(Adapter { config, weights, base_model })
}
