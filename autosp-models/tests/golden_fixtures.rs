//! The golden checkpoints made by HF transformers (tests/fixtures/make_golden.py) load with our loader:
//! config (transformers 5 spelling: rope_parameters, dtype) and every tensor shape; and our RoPE inverse
//! frequencies match the ones transformers computed.

use autosp_models::{load_dir, ModelType, RopeScaling};
use candle_core::{DType, Device};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/golden")
        .join(name)
}

fn check(name: &str) -> autosp_models::LlamaConfig {
    let dir = fixture(name);
    let (config, weights) = load_dir(&dir, DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{name}: {e} (regenerate with tests/fixtures/make_golden.py)"));
    for (n, shape) in config.expected_tensors() {
        assert_eq!(weights[&n].dims(), shape.as_slice(), "{name}: {n}");
    }
    assert_eq!(weights.len(), config.expected_tensors().len());
    assert_eq!((config.vocab_size, config.hidden_size), (128, 64), "{name}");
    assert_eq!(config.num_hidden_layers, 2);
    assert_eq!(config.torch_dtype, Some(DType::F32));

    // transformers computes inv_freq in f32; ours is f64: agree to f32 rounding (2^-23 relative, with
    // slack for pow's rounding in f32).
    let golden =
        candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu).unwrap();
    let hf: Vec<f32> = golden["inv_freq"].to_vec1().unwrap();
    let ours = config.rope_inv_freq();
    assert_eq!(hf.len(), ours.len());
    for (i, (a, b)) in hf.iter().zip(&ours).enumerate() {
        let rel = ((*a as f64) - b).abs() / b.abs();
        assert!(
            rel < 1e-6,
            "{name}: inv_freq[{i}] hf {a} ours {b} rel {rel}"
        );
    }
    config
}

#[test]
fn mha() {
    let c = check("mha");
    assert_eq!((c.num_attention_heads, c.num_key_value_heads), (4, 4));
    assert!(!c.tie_word_embeddings && !c.attention_bias);
}

#[test]
fn gqa() {
    let c = check("gqa");
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (8, 2, 8)
    );
}

#[test]
fn tied() {
    let c = check("tied");
    assert!(c.tie_word_embeddings);
    assert!(!c
        .expected_tensors()
        .iter()
        .any(|(n, _)| n == "lm_head.weight"));
}

#[test]
fn qwen2_bias() {
    let c = check("qwen2_bias");
    assert_eq!(c.model_type, ModelType::Qwen2);
    assert!(c.attention_bias && !c.o_proj_bias());
}

#[test]
fn llama3_rope() {
    let c = check("llama3_rope");
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(
        c.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16
        })
    );
}
