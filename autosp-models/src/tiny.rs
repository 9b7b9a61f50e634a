//! Tiny random checkpoints in the HF layout, from a small spec and a seed: the same seed gives the same
//! bits on every machine (a splitmix64 stream per tensor, keyed by the seed and the tensor's name).
//! Used by tests and as the default model of the examples.

use crate::config::{LayerType, LlamaConfig, ModelType, RopeScaling};
use crate::error::Result;
use crate::rng::SplitMix64;
use crate::save::{save_model, SaveOptions};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// The shape of a tiny model.
#[derive(Debug, Clone, PartialEq)]
pub struct TinySpec {
    pub model_type: ModelType,
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub vocab: usize,
    /// lm_head shares the embedding matrix.
    pub tied: bool,
    /// q/k/v biases (and o_proj's for llama); qwen2 always has q/k/v biases.
    pub bias: bool,
    pub rope_scaling: Option<RopeScaling>,
    /// An attention window (HF `sliding_window`, in tokens): on every layer of a mistral or phi3 model, on
    /// every layer but the first of a qwen2/qwen3 one (`max_window_layers` 1: a full layer, then sliding
    /// ones), on every layer but the last of a gemma3_text one (sliding layers, then a global one); a llama
    /// model has none.
    pub window: Option<usize>,
}

impl Default for TinySpec {
    /// 2 layers, hidden 64, intermediate 128, 4 heads, 2 kv heads, vocab 128, untied, no bias.
    fn default() -> Self {
        TinySpec {
            model_type: ModelType::Llama,
            layers: 2,
            hidden: 64,
            intermediate: 128,
            heads: 4,
            kv_heads: 2,
            vocab: 128,
            tied: false,
            bias: false,
            rope_scaling: None,
            window: None,
        }
    }
}

impl TinySpec {
    /// The full config of this spec (head_dim = hidden / heads, theta 10000, eps 1e-5, 256 positions).
    pub fn config(&self) -> LlamaConfig {
        let window = if self.model_type == ModelType::Llama { None } else { self.window };
        let gemma = self.model_type == ModelType::Gemma3;
        let layer_types = (0..self.layers)
            .map(|i| {
                let qwen_first = i == 0 && matches!(self.model_type, ModelType::Qwen2 | ModelType::Qwen3);
                let gemma_last = i + 1 == self.layers && self.model_type == ModelType::Gemma3;
                if window.is_some() && !qwen_first && !gemma_last {
                    LayerType::Sliding
                } else {
                    LayerType::Full
                }
            })
            .collect();
        LlamaConfig {
            model_type: self.model_type,
            vocab_size: self.vocab,
            hidden_size: self.hidden,
            intermediate_size: self.intermediate,
            num_hidden_layers: self.layers,
            num_attention_heads: self.heads,
            num_key_value_heads: self.kv_heads,
            head_dim: self.hidden / self.heads,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: self.rope_scaling.clone(),
            max_position_embeddings: 256,
            tie_word_embeddings: self.tied,
            attention_bias: self.bias || self.model_type == ModelType::Qwen2,
            torch_dtype: Some(DType::F32),
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            eos_token_ids: vec![2],
            pad_token_id: None,
            sliding_window: window,
            layer_types,
            query_pre_attn_scalar: gemma.then_some((self.hidden / self.heads) as f64),
            rope_local_theta: gemma.then_some(10_000.0),
        }
    }
}

/// Uniform in [-1, 1) from 24 random bits.
fn uniform_pm1(rng: &mut SplitMix64) -> f32 {
    ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Random weights for `config`: HF name -> tensor of [`LlamaConfig::expected_tensors`]' shapes, in
/// `dtype` on `device`. Matrices are uniform in `[-a, a)` with `a = sqrt(3 / fan_in)` (unit-variance outputs);
/// norm weights are 1 +- 0.1 (not all ones, so a mixed-up norm shows); biases are +-0.02.
pub fn random_weights(
    config: &LlamaConfig,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (name, shape) in config.expected_tensors() {
        let mut rng = SplitMix64::new(seed ^ fnv1a(&name));
        let n: usize = shape.iter().product();
        let (offset, scale) = if name.ends_with("norm.weight") {
            (1.0, 0.1)
        } else if name.ends_with(".bias") {
            (0.0, 0.02)
        } else if name == "model.embed_tokens.weight" {
            (0.0, 1.0)
        } else {
            // Uniform(-a, a) has std a / sqrt(3); a = sqrt(3 / fan_in) gives unit-variance outputs.
            (0.0, (3.0 / shape[1] as f32).sqrt())
        };
        let data: Vec<f32> = (0..n).map(|_| offset + scale * uniform_pm1(&mut rng)).collect();
        let t = Tensor::from_vec(data, shape.as_slice(), &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?;
        out.insert(name, t);
    }
    Ok(out)
}

/// Writes a tiny random checkpoint (config.json + model.safetensors, in `dtype`) into `dir`.
pub fn write_tiny(dir: &Path, spec: &TinySpec, seed: u64, dtype: DType) -> Result<LlamaConfig> {
    let config = spec.config();
    let weights = random_weights(&config, seed, dtype, &Device::Cpu)?;
    let opts = SaveOptions { dtype: Some(dtype), ..SaveOptions::default() };
    save_model(dir, &config, &weights, &opts)?;
    let mut config = config;
    config.torch_dtype = Some(dtype);
    Ok(config)
}
