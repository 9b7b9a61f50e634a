//! LoRA on the Llama model, in f64: the adapters' gradients equal central finite differences and the
//! merged-model path (`dB = s·G·Aᵀ`, `dA = s·Bᵀ·G` with `G` the gradient of the merged weight); a frozen base
//! gets no gradient; a new adapter leaves the outputs unchanged; an adapter saved in PEFT's layout loads back
//! exactly; dropout masks replay identically under checkpointing.
//!
//! Tolerances: f64 throughout. Central differences with eps = 1e-6 have truncation error ~1e-12 and round-off
//! ~1e-10 on losses of order 10, so analytic and numeric gradients must agree within 1e-6 · max(1, |g|). The
//! merged path computes the same sums in another order: 1e-9 relative.

use std::collections::HashMap;

use autosp_core::lora::LoraConfig;
use autosp_core::module::{all_params, trainable_params};
use autosp_core::{CheckpointPolicy, Gradients, Param, Tape};
use autosp_models::{load_adapter, random_weights, save_adapter, LlamaModel, ModelType, TinySpec};
use candle_core::{DType, Device, Tensor};

fn tiny(spec: &TinySpec, seed: u64) -> LlamaModel {
    let cfg = spec.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, seed, DType::F64, &Device::Cpu).unwrap()).unwrap()
}

fn batch(vocab: usize, n: usize) -> (Tensor, Vec<usize>, Tensor) {
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % vocab as u32).collect();
    let targets: Vec<i64> = (0..n).map(|i| if i + 1 == n { -100 } else { ids[i + 1] as i64 }).collect();
    (
        Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap(),
        (0..n).collect(),
        Tensor::new(targets, &Device::Cpu).unwrap(),
    )
}

fn loss_and_grads(model: &LlamaModel, policy: CheckpointPolicy, region: bool) -> (f64, Gradients) {
    let (ids, pos, targets) = batch(model.config.vocab_size, 10);
    let tape = Tape::new(policy);
    let (loss, _) = if region {
        tape.checkpoint("all", |t| Ok(model.loss(t, &ids, &pos, &targets).unwrap())).unwrap()
    } else {
        model.loss(&tape, &ids, &pos, &targets).unwrap()
    };
    let value = loss.tensor().to_scalar::<f64>().unwrap();
    tape.backward(&loss).unwrap();
    (value, tape.param_grads())
}

fn loss_of(model: &LlamaModel) -> f64 {
    let (ids, pos, targets) = batch(model.config.vocab_size, 10);
    let tape = Tape::inference();
    model.loss(&tape, &ids, &pos, &targets).unwrap().0.tensor().to_scalar::<f64>().unwrap()
}

/// Gives every `lora_B` deterministic non-zero values (a fresh B is zero, which would leave A's gradient zero).
fn perturb_b(model: &LlamaModel) {
    for (i, p) in all_params(model).iter().filter(|p| p.name().contains("lora_B")).enumerate() {
        let t = autosp_core::gradcheck::probe(p.shape().dims(), 100 + i as u64, &Device::Cpu).unwrap();
        p.set((t * 0.05).unwrap().to_dtype(DType::F64).unwrap()).unwrap();
    }
}

fn lora_model(spec: &TinySpec, config: &LoraConfig) -> LlamaModel {
    let mut m = tiny(spec, 3);
    m.add_lora(config).unwrap();
    perturb_b(&m);
    m
}

#[test]
fn a_new_adapter_changes_nothing_and_freezes_the_base() {
    let spec = TinySpec::default();
    let plain = tiny(&spec, 3);
    let mut m = tiny(&spec, 3);
    let n = m.add_lora(&LoraConfig::new(4)).unwrap();
    assert_eq!(n, 7 * spec.layers, "every projection of every layer");
    assert_eq!(loss_of(&m), loss_of(&plain), "B starts at zero");
    let (_, grads) = loss_and_grads(&m, CheckpointPolicy::None, false);
    for p in all_params(&m) {
        let adapter = p.name().contains("lora_");
        assert_eq!(p.is_frozen(), !adapter, "{}", p.name());
        assert_eq!(grads.get(&p).is_some(), adapter, "{}: only adapters get gradients", p.name());
    }
    // Adding twice is refused; a model with no such module is refused.
    assert!(m.add_lora(&LoraConfig::new(4)).is_err());
    let mut phi = tiny(&TinySpec { model_type: ModelType::Phi3, ..spec.clone() }, 3);
    let err = phi.add_lora(&LoraConfig::new(4)).unwrap_err().to_string();
    assert!(err.contains("fused"), "{err}");
}

#[test]
fn adapter_gradients_equal_finite_differences() {
    let spec = TinySpec { tied: true, ..TinySpec::default() };
    let config = LoraConfig::new(3).with_train("embed,norm").unwrap();
    let m = lora_model(&spec, &config);
    let (_, grads) = loss_and_grads(&m, CheckpointPolicy::None, false);
    let params = trainable_params(&m);
    assert!(params.iter().any(|p| p.name() == "model.embed_tokens.weight"));
    assert!(params.iter().any(|p| p.name().ends_with("input_layernorm.weight")));
    let eps = 1e-6;
    let mut checked = 0;
    for (k, p) in params.iter().enumerate() {
        let g = grads.get(p).unwrap_or_else(|| panic!("{} has no gradient", p.name()));
        let g = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let base = p.tensor();
        let flat = base.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        // A few elements per parameter, spread over it.
        for j in [0, flat.len() / 2 + k % 3, flat.len() - 1] {
            let bump = |d: f64| {
                let mut v = flat.clone();
                v[j] += d;
                p.set(Tensor::from_vec(v, base.shape(), &Device::Cpu).unwrap()).unwrap();
                let l = loss_of(&m);
                p.set(base.clone()).unwrap();
                l
            };
            let numeric = (bump(eps) - bump(-eps)) / (2.0 * eps);
            let err = (g[j] - numeric).abs();
            assert!(err <= 1e-6 * numeric.abs().max(1.0), "{}[{j}]: analytic {} numeric {numeric}", p.name(), g[j]);
            checked += 1;
        }
    }
    assert!(checked >= 3 * (7 * 2 * spec.layers));
}

#[test]
fn adapter_gradients_equal_the_merged_models() {
    for spec in [TinySpec::default(), TinySpec { model_type: ModelType::Qwen2, bias: true, ..TinySpec::default() }] {
        let config = LoraConfig::parse("4:6").unwrap().with_targets("q,v,down").unwrap();
        let m = lora_model(&spec, &config);
        let (loss, grads) = loss_and_grads(&m, CheckpointPolicy::None, false);
        // The merged model: a copy with the same weights (clones would share parameters), s·B·A folded in.
        let mut merged = tiny(&spec, 3);
        merged.add_lora(&config).unwrap();
        let weights: HashMap<String, Tensor> =
            all_params(&m).iter().map(|p| (p.name().to_string(), p.tensor())).collect();
        for p in all_params(&merged) {
            p.set(weights[p.name()].clone()).unwrap();
        }
        assert_eq!(merged.merge_lora().unwrap(), 3 * spec.layers);
        assert!(merged.lora_config().is_none());
        let (merged_loss, merged_grads) = loss_and_grads(&merged, CheckpointPolicy::None, false);
        assert!((loss - merged_loss).abs() <= 1e-10 * loss.abs(), "{loss} vs {merged_loss}");
        let by_name: HashMap<String, Param> =
            all_params(&merged).into_iter().map(|p| (p.name().to_string(), p)).collect();
        let s = config.alpha / config.r as f64;
        let mut compared = 0;
        for a in all_params(&m).into_iter().filter(|p| p.name().ends_with("lora_A.weight")) {
            let prefix = a.name().strip_suffix(".lora_A.weight").unwrap();
            let b = all_params(&m).into_iter().find(|p| p.name() == format!("{prefix}.lora_B.weight")).unwrap();
            let g = merged_grads.get(&by_name[&format!("{prefix}.weight")]).unwrap();
            let want_db = (g.matmul(&a.tensor().t().unwrap()).unwrap() * s).unwrap();
            let want_da = (b.tensor().t().unwrap().matmul(g).unwrap() * s).unwrap();
            for (got, want, what) in [(grads.get(&b).unwrap(), want_db, "B"), (grads.get(&a).unwrap(), want_da, "A")] {
                let diff = (got - &want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
                let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap().max(1e-12);
                assert!(diff <= 1e-9 * scale, "{prefix} d{what}: {diff} of {scale}");
            }
            compared += 1;
        }
        assert_eq!(compared, 3 * spec.layers);
    }
}

#[test]
fn dropout_masks_replay_identically_under_checkpointing() {
    let spec = TinySpec::default();
    let config = LoraConfig::new(4).with_dropout(0.3).unwrap();
    // Fresh models (same seed: same adapters, same mask sequence) under keep-everything and full recompute.
    let (l1, _) = loss_and_grads(&lora_model(&spec, &config), CheckpointPolicy::None, false);
    let m2 = lora_model(&spec, &config);
    let (l2, g2) = loss_and_grads(&m2, CheckpointPolicy::Full, true);
    assert_eq!(l1, l2);
    // Same adapters in both models (same seed): compare gradients by parameter name.
    let m1 = lora_model(&spec, &config);
    let (_, g1) = loss_and_grads(&m1, CheckpointPolicy::None, false);
    let named = |m: &LlamaModel, g: &Gradients| -> Vec<(String, Vec<f64>)> {
        trainable_params(m)
            .iter()
            .map(|p| (p.name().to_string(), g.get(p).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()))
            .collect()
    };
    assert_eq!(named(&m1, &g1), named(&m2, &g2), "a replayed dropout draws the same mask");
    // Dropout changes the loss (it is on), and an inference tape has none.
    let plain = lora_model(&spec, &LoraConfig::new(4));
    assert_ne!(l1, loss_and_grads(&plain, CheckpointPolicy::None, false).0);
    assert_eq!(loss_of(&lora_model(&spec, &config)), loss_of(&plain));
}

#[test]
fn a_saved_adapter_loads_back_exactly() {
    let spec = TinySpec { tied: true, ..TinySpec::default() };
    let config = LoraConfig::parse("2:5").unwrap().with_targets("q,k,o,up").unwrap().with_train("embed,norm").unwrap();
    let m = lora_model(&spec, &config);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adapter");
    save_adapter(&path, &config, &m.adapter_weights(), "tiny-base", true, None).unwrap();
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(doc["peft_type"], "LORA");
    assert_eq!(doc["r"], 2);
    assert_eq!(doc["modules_to_save"], serde_json::json!(["embed_tokens", "lm_head", "norm"]));
    let file = candle_core::safetensors::load(path.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    assert!(file.contains_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
    assert!(file.contains_key("base_model.model.lm_head.weight"), "PEFT's untied copy of a tied head");
    let adapter = load_adapter(&path).unwrap();
    assert_eq!(adapter.base_model.as_deref(), Some("tiny-base"));
    let mut want = config.clone();
    want.seed = 0;
    assert_eq!(adapter.config, want);
    let mut fresh = tiny(&spec, 3);
    fresh.add_lora(&adapter.config).unwrap();
    fresh.set_adapter_weights(&adapter.weights).unwrap();
    assert_eq!(loss_of(&fresh), loss_of(&m));
    // An adapter of other settings is refused, naming what is missing.
    let mut other = tiny(&spec, 3);
    other.add_lora(&LoraConfig::new(2)).unwrap();
    let err = other.set_adapter_weights(&adapter.weights).unwrap_err().to_string();
    assert!(err.contains("other LoRA settings"), "{err}");
}
