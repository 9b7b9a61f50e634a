//! Each RoPE scaling type read from config.json gives transformers' own inverse frequencies and attention
//! factor (`tests/fixtures/rope/frequencies.json`, made by `tests/fixtures/make_rope_golden.py` from
//! transformers' rotary embedding modules after one forward over `seq_len` positions), inside and past the
//! original window; is written back with every field so that it reads the same; and bad input is an error
//! naming the field.

use std::path::PathBuf;

use autosp_models::{Error, LlamaConfig, ModelType, RopeScaling};
use serde_json::{json, Value};

fn cases() -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/rope/frequencies.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (regenerate with tests/fixtures/make_rope_golden.py)", path.display()));
    serde_json::from_str::<Vec<Value>>(&text).unwrap()
}

fn parse(v: &Value) -> Result<LlamaConfig, Error> {
    LlamaConfig::from_json_str(&v.to_string(), "config.json")
}

/// transformers computes in f32: its values are ours rounded once, up to a few f32 ulps of the power.
const F32_TOL: f64 = 4e-7;

#[test]
fn every_type_gives_transformers_frequencies_and_attention_factor() {
    let cases = cases();
    let mut types = std::collections::BTreeSet::new();
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let seq_len = case["seq_len"].as_u64().unwrap() as usize;
        let c = parse(&case["config"]).unwrap_or_else(|e| panic!("{name}: {e}"));
        types.insert(c.rope_scaling.as_ref().map_or("default", RopeScaling::rope_type));
        let f = c.rope_frequencies(seq_len);
        let want: Vec<f64> = case["inv_freq"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert_eq!(f.inv_freq.len(), want.len(), "{name}");
        for (i, (got, want)) in f.inv_freq.iter().zip(&want).enumerate() {
            assert!((got - want).abs() <= F32_TOL * want.abs(), "{name} len {seq_len}: pair {i}: {got} vs {want}");
        }
        let want = case["attention_factor"].as_f64().unwrap();
        assert!(
            (f.attention_factor - want).abs() <= 1e-12 * want,
            "{name}: attention factor {} vs {want}",
            f.attention_factor
        );

        // Written back and read again: the same scaling and the same numbers.
        let again = LlamaConfig::from_json_str(&c.to_json(), "saved/config.json").unwrap();
        assert_eq!(again.rope_scaling, c.rope_scaling, "{name}: the scaling survives to_json");
        assert_eq!(again.rope_frequencies(seq_len), f, "{name}");
    }
    let all: Vec<_> = types.into_iter().collect();
    assert_eq!(all, ["default", "dynamic", "linear", "llama3", "longrope", "yarn"]);
}

/// The fixture cases' frequencies differ from the default ones where the scaling acts (so the comparison
/// above does test each scaling), and the length-dependent types change at the window.
#[test]
fn the_cases_exercise_each_scaling() {
    let cases = cases();
    let freqs = |name: &str, len: u64| {
        let case = cases.iter().find(|c| c["name"] == name && c["seq_len"] == len).unwrap();
        parse(&case["config"]).unwrap().rope_frequencies(len as usize)
    };
    // dynamic: the default inside its window of 32, another base past it.
    assert_eq!(freqs("dynamic", 32).inv_freq, freqs("dynamic", 8).inv_freq);
    assert_ne!(freqs("dynamic", 33).inv_freq, freqs("dynamic", 32).inv_freq);
    // longrope: short factors up to the window, long ones past it; the same attention factor.
    assert_ne!(freqs("longrope_llama", 33).inv_freq, freqs("longrope_llama", 32).inv_freq);
    assert_eq!(freqs("longrope_llama", 33).attention_factor, freqs("longrope_llama", 32).attention_factor);
    // yarn: an attention factor above 1, and frequencies that do not depend on the length.
    assert!(freqs("yarn", 8).attention_factor > 1.0);
    assert_eq!(freqs("yarn", 96), freqs("yarn", 8));
}

/// A llama config with `rope_scaling` = `scaling` (head_dim 16, window 128).
fn llama(scaling: Value) -> Value {
    json!({"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 128,
           "rope_scaling": scaling})
}

fn field_of(e: &Error) -> &str {
    match e {
        Error::InvalidField { field, .. } | Error::MissingField { field, .. } | Error::Unsupported { field, .. } => {
            field
        }
        Error::UnknownRopeType { field, .. } => field,
        other => panic!("unexpected error: {other}"),
    }
}

#[test]
fn bad_scalings_are_errors_naming_the_field() {
    let e = parse(&llama(json!({"rope_type": "ntk", "factor": 2.0}))).unwrap_err();
    assert!(matches!(&e, Error::UnknownRopeType { rope_type, .. } if rope_type == "ntk"), "{e}");
    assert!(e.to_string().contains("yarn, dynamic"), "{e}");
    for ty in ["linear", "dynamic", "yarn", "llama3"] {
        let e = parse(&llama(json!({"rope_type": ty, "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0})))
            .unwrap_err();
        assert_eq!(field_of(&e), "rope_scaling.factor", "{ty}: {e}");
        assert!(e.to_string().contains("1 or more"), "{e}");
        let e = parse(&llama(json!({"rope_type": ty}))).unwrap_err();
        assert!(matches!(&e, Error::MissingField { field, .. } if field == "rope_scaling.factor"), "{ty}: {e}");
    }
    let (short, seven) = (vec![1.0; 8], vec![2.0; 7]);
    let e = parse(&llama(json!({"rope_type": "longrope", "short_factor": short, "long_factor": seven}))).unwrap_err();
    assert_eq!(field_of(&e), "rope_scaling.long_factor", "{e}");
    assert!(e.to_string().contains("head_dim / 2 = 8"), "{e}");
    let e = parse(&llama(json!({"rope_type": "longrope", "long_factor": short}))).unwrap_err();
    assert!(matches!(&e, Error::MissingField { field, .. } if field == "rope_scaling.short_factor"), "{e}");
    let e = parse(&llama(json!({"rope_type": "yarn", "factor": 2.0, "truncate": "no"}))).unwrap_err();
    assert_eq!(field_of(&e), "rope_scaling.truncate", "{e}");
    let e =
        parse(&llama(json!({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 0}))).unwrap_err();
    assert_eq!(field_of(&e), "rope_scaling.original_max_position_embeddings", "{e}");
}

/// Phi-3: `su` and `yarn` are LongRoPE, the window is the top-level field (default 4096) and one inside that
/// differs is an error; other scalings are refused (as transformers' Phi3Config refuses them); the window is
/// written back top-level too.
#[test]
fn phi3_longrope_window_and_refusals() {
    let phi3 = |extra: Value| {
        let mut v = json!({"model_type": "phi3", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
                           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 131072});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        parse(&v)
    };
    let (short, long) = (vec![1.0; 8], vec![2.0; 8]);
    let factors = json!({"short_factor": short, "long_factor": long});
    let with = |ty: &str, top: Option<u64>, inside: Option<u64>| {
        let mut s = factors.clone();
        s["type"] = json!(ty);
        if let Some(i) = inside {
            s["original_max_position_embeddings"] = json!(i);
        }
        let mut extra = json!({"rope_scaling": s});
        if let Some(t) = top {
            extra["original_max_position_embeddings"] = json!(t);
        }
        phi3(extra)
    };
    for ty in ["su", "yarn", "longrope"] {
        let c = with(ty, Some(4096), None).unwrap();
        let Some(RopeScaling::LongRope(l)) = &c.rope_scaling else { panic!("{ty}: {:?}", c.rope_scaling) };
        assert_eq!((l.original_max_position_embeddings, l.factor(c.max_position_embeddings)), (4096, 32.0));
    }
    assert_eq!(with("su", None, None).unwrap().rope_scaling.unwrap().original_max_position_embeddings(), Some(4096));
    assert_eq!(
        with("su", Some(2048), Some(2048)).unwrap().rope_scaling.unwrap().original_max_position_embeddings(),
        Some(2048)
    );
    let e = with("su", Some(4096), Some(2048)).unwrap_err();
    assert_eq!(field_of(&e), "rope_scaling.original_max_position_embeddings", "{e}");
    let e = phi3(json!({"rope_scaling": {"type": "linear", "factor": 2.0}})).unwrap_err();
    assert!(matches!(&e, Error::Unsupported { field, .. } if field == "rope_scaling.rope_type"), "{e}");

    let c = with("su", Some(2048), None).unwrap();
    assert_eq!(c.model_type, ModelType::Phi3);
    let saved: Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(saved["original_max_position_embeddings"], json!(2048));
    assert_eq!(saved["rope_scaling"]["rope_type"], json!("longrope"));
    assert_eq!(saved["rope_scaling"]["long_factor"], json!(long));
}

/// The written scaling carries `rope_type` and every field a loader needs, explicitly.
#[test]
fn saved_yarn_carries_every_field_given() {
    let c = parse(&llama(json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                "beta_fast": 16, "mscale": 0.9, "mscale_all_dim": 0.4, "truncate": false})))
    .unwrap();
    let saved: Value = serde_json::from_str(&c.to_json()).unwrap();
    assert_eq!(
        saved["rope_scaling"],
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
               "mscale": 0.9, "mscale_all_dim": 0.4, "truncate": false})
    );
    assert_eq!(saved["rope_theta"], json!(10000.0));
    assert_eq!(saved["max_position_embeddings"], json!(128));
}

/// Gemma 3's new spelling: the scaling of the global layers under `full_attention`.
#[test]
fn gemma3_per_layer_type_yarn() {
    let v = json!({"model_type": "gemma3_text", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16, "max_position_embeddings": 128,
                   "layer_types": ["sliding_attention", "full_attention"],
                   "rope_parameters": {
                       "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                          "original_max_position_embeddings": 32},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}});
    let c = parse(&v).unwrap();
    assert_eq!(c.rope_scaling, Some(RopeScaling::Yarn(autosp_models::Yarn::new(4.0, 32))));
    assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, Some(1e4)));
    let again = LlamaConfig::from_json_str(&c.to_json(), "saved/config.json").unwrap();
    assert_eq!(again, c);
}
