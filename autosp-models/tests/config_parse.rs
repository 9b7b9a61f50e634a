//! config.json parsing: both spellings, rope types, sliding windows, head_dim, biases, to_json round trip.

use autosp_models::{Error, LlamaConfig, ModelType, RopeScaling, TinySpec};
use candle_core::DType;

const OLD_LLAMA31: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "attention_bias": false,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]
}"#;

const NEW_LLAMA31: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
  "rope_parameters": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3",
                   "rope_theta": 500000.0},
  "tie_word_embeddings": false, "dtype": "bfloat16", "attention_bias": false,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]
}"#;

fn parse(s: &str) -> autosp_models::Result<LlamaConfig> {
    LlamaConfig::from_json_str(s, "test/config.json")
}

#[test]
fn old_and_new_spellings_agree() {
    let old = parse(OLD_LLAMA31).unwrap();
    let new = parse(NEW_LLAMA31).unwrap();
    assert_eq!(old, new);
    assert_eq!(old.rope_theta, 500000.0);
    assert_eq!(
        old.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        })
    );
    assert_eq!(old.torch_dtype, Some(DType::BF16));
    assert_eq!(old.head_dim, 128);
    assert_eq!(old.num_key_value_heads, 8);
    assert_eq!(old.eos_token_id, Some(128001));
    // Every end-of-sequence id survives a save (Llama 3 instruct lists three).
    assert_eq!(old.eos_token_ids, vec![128001, 128008, 128009]);
    let again = LlamaConfig::from_json_str(&old.to_json(), "saved/config.json").unwrap();
    assert_eq!(again.eos_token_ids, old.eos_token_ids);
    let saved: serde_json::Value = serde_json::from_str(&old.to_json()).unwrap();
    assert_eq!(saved["eos_token_id"], serde_json::json!([128001, 128008, 128009]));
}

#[test]
fn linear_rope_old_type_key() {
    let s = OLD_LLAMA31.replace(
        r#""rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
        r#""rope_scaling": {"type": "linear", "factor": 2.0}"#,
    );
    let c = parse(&s).unwrap();
    assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
}

#[test]
fn unknown_rope_type_is_an_error_naming_it() {
    let s = NEW_LLAMA31.replace(r#""rope_type": "llama3""#, r#""rope_type": "ntk-by-parts""#);
    let e = parse(&s).unwrap_err();
    assert!(matches!(&e, Error::UnknownRopeType { rope_type, .. } if rope_type == "ntk-by-parts"), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("ntk-by-parts") && msg.contains("rope_parameters") && msg.contains("yarn"), "{msg}");
}

#[test]
fn explicit_head_dim_and_defaults() {
    let s = r#"{"model_type": "mistral", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 48, "sliding_window": null}"#;
    let c = parse(s).unwrap();
    assert_eq!(c.model_type, ModelType::Mistral);
    assert_eq!(c.head_dim, 48);
    assert_eq!(c.num_key_value_heads, 2);
    assert_eq!(c.rope_theta, 10000.0);
    assert!(!c.attention_bias);
    let shapes: std::collections::HashMap<_, _> = c.expected_tensors().into_iter().collect();
    assert_eq!(shapes["model.layers.0.self_attn.q_proj.weight"], vec![96, 64]);
    assert_eq!(shapes["model.layers.0.self_attn.o_proj.weight"], vec![64, 96]);
}

#[test]
fn sliding_windows_are_read_as_transformers_reads_them() {
    use autosp_models::LayerType::{Full, Sliding};
    let mistral = r#"{"model_type": "mistral", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 32768,
      "sliding_window": 4096}"#;
    let c = parse(mistral).unwrap();
    assert_eq!((c.sliding_window, c.layer_types.clone()), (Some(4096), vec![Sliding, Sliding]));
    assert_eq!(c.attention_window(1), Some(4095), "a query sees itself and the 4095 tokens before it");
    // Mistral without the field: transformers' default window of 4096; null: none.
    let absent = r#"{"model_type": "mistral", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 2, "num_attention_heads": 2}"#;
    assert_eq!(parse(absent).unwrap().sliding_window, Some(4096));
    let none = parse(&mistral.replace("4096", "null")).unwrap();
    assert_eq!((none.sliding_window, none.attention_window(0)), (None, None));

    // Qwen2/Qwen3: only with use_sliding_window, on the layers from max_window_layers on (or layer_types).
    let qwen = r#"{"model_type": "qwen2", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 3, "num_attention_heads": 2, "use_sliding_window": true, "max_window_layers": 1,
      "sliding_window": 16}"#;
    let c = parse(qwen).unwrap();
    assert_eq!(c.layer_types, vec![Full, Sliding, Sliding]);
    assert_eq!((c.attention_window(0), c.attention_window(2)), (None, Some(15)));
    let off = parse(&qwen.replace("true", "false")).unwrap();
    assert!(off.attention_bias, "qwen2 always has q/k/v biases");
    assert_eq!((off.sliding_window, off.attention_window(2)), (None, None));
    let typed = qwen.replace(
        r#""max_window_layers": 1"#,
        r#""layer_types": ["sliding_attention", "full_attention", "sliding_attention"]"#,
    );
    assert_eq!(parse(&typed).unwrap().layer_types, vec![Sliding, Full, Sliding]);
    let e = parse(&qwen.replace(r#""max_window_layers": 1"#, r#""layer_types": ["full_attention"]"#)).unwrap_err();
    assert!(matches!(&e, Error::InvalidField { field, .. } if field == "layer_types"), "{e}");
    let e = parse(&typed.replace("full_attention", "chunked_attention")).unwrap_err();
    assert!(matches!(&e, Error::Unsupported { field, .. } if field == "layer_types"), "{e}");

    // Llama has no window: an active one is refused, naming the field.
    let llama = mistral.replace("mistral", "llama");
    let e = parse(&llama).unwrap_err();
    assert!(matches!(&e, Error::Unsupported { field, .. } if field == "sliding_window"), "{e}");
    parse(&llama.replace("4096", "32768")).unwrap();
}

#[test]
fn qwen3_has_its_own_head_dim_and_q_k_norms() {
    let qwen3 = r#"{"model_type": "qwen3", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}"#;
    let c = parse(qwen3).unwrap();
    assert_eq!(c.head_dim, 128, "Qwen3Config's default head_dim, not hidden / heads");
    assert!(!c.attention_bias && !c.o_proj_bias());
    let shapes: std::collections::HashMap<String, Vec<usize>> = c.expected_tensors().into_iter().collect();
    assert_eq!(shapes["model.layers.0.self_attn.q_norm.weight"], vec![128]);
    assert_eq!(shapes["model.layers.0.self_attn.q_proj.weight"], vec![256, 64]);
    let biased =
        parse(&qwen3.replace(r#""num_key_value_heads": 1"#, r#""num_key_value_heads": 1, "attention_bias": true"#))
            .unwrap();
    assert!(biased.o_proj_bias(), "qwen3's attention_bias covers o_proj too");
}

#[test]
fn unknown_model_type_and_missing_field() {
    let e = parse(r#"{"model_type": "gemma"}"#).unwrap_err();
    assert!(matches!(&e, Error::UnknownModelType { model_type, .. } if model_type == "gemma"));
    let msg = e.to_string();
    assert!(msg.contains("config.json") && msg.contains("`gemma`") && msg.contains("supported: llama"), "{msg}");
    let e = parse(r#"{"model_type": "llama", "vocab_size": 3}"#).unwrap_err();
    assert!(matches!(&e, Error::MissingField { field, .. } if field == "hidden_size"), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("config.json") && msg.contains("`hidden_size`") && msg.contains("add it"), "{msg}");
}

#[test]
fn biases_follow_the_model_type() {
    let llama_bias = TinySpec { bias: true, ..TinySpec::default() }.config();
    let names: Vec<String> = llama_bias.expected_tensors().into_iter().map(|x| x.0).collect();
    assert!(names.contains(&"model.layers.1.self_attn.o_proj.bias".to_string()));
    let qwen = TinySpec { model_type: ModelType::Qwen2, ..TinySpec::default() }.config();
    let names: Vec<String> = qwen.expected_tensors().into_iter().map(|x| x.0).collect();
    assert!(names.contains(&"model.layers.1.self_attn.k_proj.bias".to_string()));
    assert!(!names.contains(&"model.layers.1.self_attn.o_proj.bias".to_string()));
    // 1 embedding + 2 layers * (4 weights + 3 biases + 3 mlp + 2 norms) + norm + lm_head.
    assert_eq!(names.len(), 1 + 2 * 12 + 1 + 1);
}

#[test]
fn to_json_round_trips() {
    for spec in [
        TinySpec::default(),
        TinySpec { model_type: ModelType::Qwen2, tied: true, ..TinySpec::default() },
        TinySpec { model_type: ModelType::Qwen2, window: Some(16), ..TinySpec::default() },
        TinySpec { model_type: ModelType::Qwen3, bias: true, window: Some(8), ..TinySpec::default() },
        TinySpec { model_type: ModelType::Mistral, window: Some(8), ..TinySpec::default() },
        TinySpec { model_type: ModelType::Phi3, window: Some(8), ..TinySpec::default() },
        TinySpec { model_type: ModelType::Gemma3, window: Some(8), tied: true, ..TinySpec::default() },
        TinySpec {
            model_type: ModelType::Mistral,
            rope_scaling: Some(RopeScaling::Linear { factor: 4.0 }),
            ..TinySpec::default()
        },
        TinySpec {
            bias: true,
            rope_scaling: Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64,
            }),
            ..TinySpec::default()
        },
    ] {
        let c = spec.config();
        assert_eq!(parse(&c.to_json()).unwrap(), c, "{}", c.to_json());
    }
}

#[test]
fn gemma3_query_pre_attn_scalar_is_written_as_transformers_types_it() {
    // transformers 5.x declares it `int` and refuses a config.json holding `256.0`; a fraction stays a float.
    let mut c = TinySpec { model_type: ModelType::Gemma3, window: Some(8), tied: true, ..TinySpec::default() }.config();
    c.query_pre_attn_scalar = Some(256.0);
    let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert!(v["query_pre_attn_scalar"].is_u64(), "{}", v["query_pre_attn_scalar"]);
    assert_eq!(parse(&c.to_json()).unwrap(), c);
    c.query_pre_attn_scalar = Some(42.5);
    let v: serde_json::Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(v["query_pre_attn_scalar"].as_f64(), Some(42.5));
}

#[test]
fn phi3_reads_its_window_and_refuses_what_it_does_not_do() {
    let phi3 = r#"{"model_type": "phi3", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2, "sliding_window": 2047, "resid_pdrop": 0.0}"#;
    let c = parse(phi3).unwrap();
    assert_eq!((c.attention_window(0), c.attention_bias), (Some(2046), false));
    let names: Vec<String> = c.expected_tensors().into_iter().map(|x| x.0).collect();
    assert!(names.contains(&"model.layers.0.self_attn.qkv_proj.weight".to_string()));
    assert!(names.contains(&"model.layers.0.mlp.gate_up_proj.weight".to_string()));
    assert!(!names.iter().any(|n| n.ends_with(".q_proj.weight") || n.ends_with("mlp.up_proj.weight")), "{names:?}");
    // No window when the field is absent (Phi3Config's default).
    assert_eq!(parse(&phi3.replace(r#""sliding_window": 2047, "#, "")).unwrap().sliding_window, None);
    // Dropout and Phi-4-mini's partial RoPE are refused, naming the field; Phi-3-128k's longrope (`su`) loads
    // when it has a factor per rotated pair, and says which field is short otherwise.
    let e = parse(&phi3.replace(r#""resid_pdrop": 0.0"#, r#""resid_pdrop": 0.1"#)).unwrap_err();
    assert!(matches!(&e, Error::Unsupported { field, .. } if field == "resid_pdrop"), "{e}");
    let longrope = phi3.replace(
        r#""resid_pdrop": 0.0"#,
        r#""rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}"#,
    );
    let e = parse(&longrope).unwrap_err();
    assert!(matches!(&e, Error::InvalidField { field, .. } if field == "rope_scaling.short_factor"), "{e}");
    assert!(e.to_string().contains("head_dim / 2"), "{e}");
    let partial = phi3.replace(
        r#""resid_pdrop": 0.0"#,
        r#""rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}"#,
    );
    let e = parse(&partial).unwrap_err();
    assert!(matches!(&e, Error::Unsupported { field, .. } if field == "rope_parameters.partial_rotary_factor"), "{e}");
}

#[test]
fn gemma3_text_reads_both_rope_spellings_and_its_layer_pattern() {
    use autosp_models::LayerType::{Full, Sliding};
    // The spelling of the released checkpoints (transformers 4.x): rope_theta and rope_scaling are the global
    // layers', rope_local_base_freq the sliding ones'; every 6th layer global.
    let old = r#"{"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
      "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
      "query_pre_attn_scalar": 32, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
      "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": null}"#;
    let c = parse(old).unwrap();
    assert_eq!(c.layer_types, vec![Sliding, Sliding, Sliding, Sliding, Sliding, Full, Sliding]);
    assert_eq!((c.attention_window(0), c.attention_window(5)), (Some(511), None));
    assert_eq!(
        (c.rope_theta, c.rope_local_theta, c.rope_scaling.clone()),
        (1e6, Some(1e4), Some(RopeScaling::Linear { factor: 8.0 }))
    );
    assert_eq!(c.attention_scale(), Some(1.0 / 32f64.sqrt()));
    assert!(c.tie_word_embeddings, "Gemma ties by default");
    assert_eq!(c.embed_scale(), Some(8.0));
    // transformers 5's spelling: one rope set per layer type.
    let new = old.replace(
        r#""rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0},"#,
        r#""rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},"#,
    );
    assert_ne!(new, old);
    assert_eq!(parse(&new).unwrap(), c);
    // What it does not do is refused by field: soft-capping, another activation, the vision-language model.
    let e =
        parse(&old.replace(r#""final_logit_softcapping": null"#, r#""final_logit_softcapping": 30.0"#)).unwrap_err();
    assert!(matches!(&e, Error::Unsupported { field, .. } if field == "final_logit_softcapping"), "{e}");
    let e = parse(&old.replace("gelu_pytorch_tanh", "gelu")).unwrap_err();
    assert!(matches!(&e, Error::Unsupported { field, .. } if field == "hidden_activation"), "{e}");
    let e = parse(&old.replace("gemma3_text", "gemma3")).unwrap_err();
    assert!(matches!(&e, Error::Unsupported { field, .. } if field == "model_type"), "{e}");
    assert!(e.to_string().contains("gemma3_text"), "{e}");
}
