//! RoPE scalings in GGUF metadata, as llama.cpp's converter writes them (`{arch}.rope.scaling.type`,
//! `.factor`, `.original_context_length`, YaRN's `.yarn_beta_fast` / `.yarn_beta_slow`), read into the
//! config's [`RopeScaling`]; what llama.cpp computes differently from transformers (its YaRN attention
//! multiplier, DeepSeek's log multiplier) is refused naming the key.

use autosp_models::{config_from_gguf, Error, RopeScaling, Yarn};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// A metadata-only llama GGUF (one embedding tensor) with `extra` keys (without the `llama.` prefix), read
/// back into a config.
fn config_with(extra: &[(&str, Value)]) -> Result<autosp_models::LlamaConfig, Error> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("llama.block_count".into(), Value::U32(1)),
        ("llama.embedding_length".into(), Value::U32(64)),
        ("llama.feed_forward_length".into(), Value::U32(64)),
        ("llama.attention.head_count".into(), Value::U32(4)),
        ("llama.attention.layer_norm_rms_epsilon".into(), Value::F32(1e-5)),
        ("llama.rope.freq_base".into(), Value::F32(10000.0)),
        ("llama.context_length".into(), Value::U32(128)),
    ];
    meta.extend(extra.iter().map(|(k, v)| (format!("llama.{k}"), v.clone())));
    let embd =
        QTensor::quantize(&Tensor::zeros((32, 64), candle_core::DType::F32, &Device::Cpu).unwrap(), GgmlDType::F32)
            .unwrap();
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &[("token_embd.weight", &embd)]).unwrap();
    drop(f);
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    config_from_gguf(&ct, &path)
}

#[test]
fn yarn_keys_become_the_yarn_scaling() {
    let c = config_with(&[
        ("rope.scaling.type", Value::String("yarn".into())),
        ("rope.scaling.factor", Value::F32(4.0)),
        ("rope.scaling.original_context_length", Value::U32(32)),
        ("rope.scaling.yarn_beta_fast", Value::F32(16.0)),
        ("rope.scaling.yarn_beta_slow", Value::F32(2.0)),
    ])
    .unwrap();
    let want = Yarn { beta_fast: Some(16.0), beta_slow: Some(2.0), ..Yarn::new(4.0, 32) };
    assert_eq!(c.rope_scaling, Some(RopeScaling::Yarn(want)));
    // Without the original window: the context length (transformers' default, max_position_embeddings).
    let c =
        config_with(&[("rope.scaling.type", Value::String("yarn".into())), ("rope.scaling.factor", Value::F32(2.0))])
            .unwrap();
    assert_eq!(c.rope_scaling, Some(RopeScaling::Yarn(Yarn::new(2.0, 128))));
}

#[test]
fn yarn_keys_llama_cpp_reads_otherwise_are_refused() {
    for (k, v) in [("rope.scaling.attn_factor", 0.5f32), ("rope.scaling.yarn_log_multiplier", 0.1)] {
        let e = config_with(&[
            ("rope.scaling.type", Value::String("yarn".into())),
            ("rope.scaling.factor", Value::F32(4.0)),
            (k, Value::F32(v)),
        ])
        .unwrap_err();
        assert!(e.to_string().contains(k), "{k}: {e}");
    }
    let e = config_with(&[("rope.scaling.type", Value::String("yarn".into()))]).unwrap_err();
    assert!(e.to_string().contains("rope.scaling.factor"), "{e}");
    let e =
        config_with(&[("rope.scaling.type", Value::String("yarn".into())), ("rope.scaling.factor", Value::F32(0.5))])
            .unwrap_err();
    assert!(e.to_string().contains("rope.scaling.factor"), "{e}");
}
