//! `pad_token_id` as transformers 5 reads it: the family's default when config.json has none (Phi-3 32000,
//! Gemma 3 0, none for llama, mistral, qwen2, qwen3), none for `null`, a negative id counted from the end as
//! PyTorch's `padding_idx`; the embedding's padding row only inside the vocabulary; written back by
//! `to_json` so a saved model keeps it.

use autosp_models::{LlamaConfig, ModelType};

/// A config.json of `model_type` with 100 tokens, plus `extra` fields (`"pad_token_id": ..`).
fn config(model_type: &str, extra: &str) -> LlamaConfig {
    let text = format!(
        r#"{{"model_type": "{model_type}", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "head_dim": 8 {extra}}}"#
    );
    LlamaConfig::from_json_str(&text, "test/config.json").unwrap()
}

#[test]
fn absent_pad_token_ids_take_each_familys_default() {
    for (ty, want) in [
        ("llama", None),
        ("mistral", None),
        ("qwen2", None),
        ("qwen3", None),
        ("phi3", Some(32000)),
        ("gemma3_text", Some(0)),
    ] {
        let c = config(ty, "");
        assert_eq!(c.pad_token_id, want, "{ty}");
        assert_eq!(c.model_type.default_pad_token_id().map(i64::from), want, "{ty}");
    }
    // Phi-3's default is past this vocabulary: no padding row (transformers would refuse the model).
    assert_eq!(config("phi3", "").padding_idx(), None);
    assert_eq!(config("gemma3_text", "").padding_idx(), Some(0));
    assert_eq!(config("llama", "").padding_idx(), None);
}

#[test]
fn given_null_and_negative_pad_token_ids() {
    assert_eq!(config("llama", r#", "pad_token_id": 7"#).padding_idx(), Some(7));
    assert_eq!(config("gemma3_text", r#", "pad_token_id": null"#).pad_token_id, None);
    assert_eq!(config("phi3", r#", "pad_token_id": null"#).padding_idx(), None);
    let last = config("llama", r#", "pad_token_id": -1"#);
    assert_eq!((last.pad_token_id, last.padding_idx()), (Some(-1), Some(99)));
    assert_eq!(config("llama", r#", "pad_token_id": -101"#).padding_idx(), None);
    assert_eq!(config("llama", r#", "pad_token_id": 100"#).padding_idx(), None);
    let bad = LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "pad_token_id": "x"}"#,
        "test/config.json",
    );
    assert!(bad.unwrap_err().to_string().contains("pad_token_id"));
}

#[test]
fn to_json_keeps_the_pad_token_id_and_its_absence() {
    for c in [
        config("llama", r#", "pad_token_id": 7"#),
        config("llama", ""),
        config("gemma3_text", ""),
        config("phi3", r#", "pad_token_id": null"#),
    ] {
        let again = LlamaConfig::from_json_str(&c.to_json(), "saved/config.json").unwrap();
        assert_eq!(again.pad_token_id, c.pad_token_id, "{:?}", c.model_type);
        assert_eq!(again, c);
    }
    // A Gemma config saved with no padding row stays without one (the explicit null, not the default 0).
    let none = config("gemma3_text", r#", "pad_token_id": null"#);
    assert!(none.to_json().contains("\"pad_token_id\": null"));
    assert_eq!(none.model_type, ModelType::Gemma3);
}
