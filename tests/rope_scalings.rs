//! Every RoPE scaling against transformers, on sequences past the original window: tiny checkpoints that
//! transformers made and saved (`tests/fixtures/rope`, by `tests/fixtures/make_rope_golden.py`), one step's
//! loss and every parameter gradient on 96 ids (three times the original window of 32) equal what
//! transformers computed, at P = 1 and under 2 and 4 sequence-parallel thread ranks (Ulysses, Ring). The
//! fixtures:
//! - `llama_yarn`: YaRN by 4 from 32, `beta_fast` 16, `truncate` false (attention factor 0.1 ln 4 + 1);
//! - `qwen3_yarn_mscale`: YaRN with `mscale` / `mscale_all_dim` (the attention factor is their ratio), in the
//!   new spelling (`rope_parameters`);
//! - `llama_dynamic`: dynamic NTK by 2 over a window of 32: the base grows with the whole sequence's length,
//!   which a rank's shard does not see (the step hands it over on the tape);
//! - `phi3_longrope`: Phi-3's `su` (LongRoPE), its window top-level, the long factors past it;
//! - `gemma3_yarn`: Gemma 3 per layer type, YaRN on the global layer, the sliding one (window 8) unscaled
//!   with its own base.
//!
//! And the other way round: the unscaled frequencies, a wrong attention factor, the shard's length instead
//! of the sequence's, or the short factors each miss transformers' numbers by more than the tolerance, so
//! the fixtures do test the scaling. Each checkpoint saved again and reloaded has the same config and loss.
//!
//! Tolerance: 1e-4 relative (the loss; each gradient's largest difference over its largest element).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp::core::comm::run_ranks;
use autosp::core::{CheckpointPolicy, Tape};
use autosp::models::{LlamaModel, RopeScaling, SaveOptions};
use candle_core::{DType, Device, Tensor};

const TOL: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rope").join(name)
}

/// transformers' ids, loss and gradients (by HF name) for a fixture.
struct Golden {
    ids: Tensor,
    loss: f64,
    grads: HashMap<String, Vec<f32>>,
}

fn golden(name: &str) -> Golden {
    let path = fixture(name).join("golden.safetensors");
    let mut g = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{name}: {e} (regenerate with tests/fixtures/make_rope_golden.py)"));
    let ids = g.remove("input_ids").unwrap().to_dtype(DType::U32).unwrap();
    let loss = g.remove("loss").unwrap().to_vec1::<f64>().unwrap()[0];
    let grads = g
        .into_iter()
        .filter_map(|(k, t)| {
            k.strip_prefix("grad.").map(|n| (n.to_string(), t.flatten_all().unwrap().to_vec1().unwrap()))
        })
        .collect();
    Golden { ids, loss, grads }
}

fn load(name: &str) -> LlamaModel {
    LlamaModel::load(fixture(name).to_str().unwrap(), DType::F32).unwrap()
}

/// The loss and whole gradients (by HF name, in the file's layout) of one step of `model` compiled on `p`
/// thread ranks with `strategy`.
fn step(model: &LlamaModel, p: usize, strategy: Strategy, ids: &Tensor) -> (f64, HashMap<String, Vec<f32>>) {
    let config = model.config.clone();
    let (model, ids) = (Arc::new(model.clone()), ids.clone());
    let out = run_ranks(p, Duration::from_secs(60), move |pg| -> Result<_, String> {
        let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
        // Each rank builds its own model from the config and weights (the scaling goes with the config).
        let own = LlamaModel::from_weights(&model.config, model.to_weights()).map_err(|e| e.to_string())?;
        let c = compile(own, CompileConfig::new(pg, strategy, policy)).map_err(|e| e.to_string())?;
        let out = c.train_step(&ids, None).map_err(|e| e.to_string())?;
        let whole = c.whole_grads(&out.grads).map_err(|e| e.to_string())?;
        let by_name: HashMap<String, Tensor> =
            c.params().iter().map(|p| (p.name().to_string(), whole.get(p).unwrap().clone())).collect();
        let fused = autosp::models::fused::fuse(&config, &by_name).map_err(|e| e.to_string())?;
        let grads = fused.into_iter().map(|(n, g)| (n, g.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect();
        Ok((out.loss, grads))
    });
    let mut all: Vec<_> = out.into_iter().map(|r| r.expect("rank panicked").expect("step failed")).collect();
    all.swap_remove(0)
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale
}

/// The largest relative miss of `(loss, grads)` against transformers': the loss's and every gradient's.
fn miss(g: &Golden, loss: f64, grads: &HashMap<String, Vec<f32>>) -> f64 {
    assert_eq!(grads.len(), g.grads.len(), "parameter count");
    let mut worst = (loss - g.loss).abs() / g.loss.abs();
    for (n, want) in &g.grads {
        let got = grads.get(n).unwrap_or_else(|| panic!("no parameter `{n}`"));
        worst = worst.max(rel(got, want));
    }
    worst
}

/// The fixture at P = 1, and Ulysses and Ring at P = 2 and 4, within [`TOL`]; saved and reloaded, the same
/// config and loss. Returns the loaded model.
fn check(name: &str) -> LlamaModel {
    let g = golden(name);
    let model = load(name);
    let mut runs = vec![(1, Strategy::Auto)];
    for p in [2, 4] {
        runs.extend([Strategy::Ulysses, Strategy::Ring].map(|s| (p, s)));
    }
    for (p, strategy) in runs {
        let (loss, grads) = step(&model, p, strategy, &g.ids);
        let e = miss(&g, loss, &grads);
        eprintln!("{name} P = {p} {strategy:?}: largest relative difference {e:.2e}");
        assert!(e <= TOL, "{name} P = {p} {strategy:?}: off transformers by {e:e} (loss {loss} vs {})", g.loss);
    }
    let dir = tempfile::tempdir().unwrap();
    model.save(dir.path(), &SaveOptions::default()).unwrap();
    let again = LlamaModel::load(dir.path().to_str().unwrap(), DType::F32).unwrap();
    assert_eq!(again.config, model.config, "{name}: the scaling survives a save");
    assert_eq!(step(&again, 1, Strategy::Auto, &g.ids).0, step(&model, 1, Strategy::Auto, &g.ids).0, "{name}");
    model
}

/// `model` with `scaling` instead of its own misses transformers' numbers by more than [`TOL`] at P = 2.
fn assert_misses(name: &str, model: &LlamaModel, scaling: Option<RopeScaling>, what: &str) {
    let g = golden(name);
    let mut m = model.clone();
    m.config.rope_scaling = scaling;
    let (loss, grads) = step(&m, 2, Strategy::Ulysses, &g.ids);
    let e = miss(&g, loss, &grads);
    eprintln!("{name} with {what}: off by {e:.2e}");
    assert!(e > TOL, "{name}: {what} must miss transformers' numbers, but is off by only {e:e}");
}

#[test]
fn yarn_matches_transformers_and_its_attention_factor_matters() {
    let m = check("llama_yarn");
    let Some(RopeScaling::Yarn(y)) = m.config.rope_scaling.clone() else { panic!("{:?}", m.config.rope_scaling) };
    assert_eq!(
        (y.factor, y.original_max_position_embeddings, y.beta_fast, y.truncate),
        (4.0, 32, Some(16.0), Some(false))
    );
    assert_misses("llama_yarn", &m, None, "the unscaled frequencies");
    let wrong = autosp::models::Yarn { attention_factor: Some(1.0), ..y };
    assert_misses("llama_yarn", &m, Some(RopeScaling::Yarn(wrong)), "an attention factor of 1");
}

#[test]
fn yarn_with_deepseek_mscale_matches_transformers() {
    let m = check("qwen3_yarn_mscale");
    let Some(RopeScaling::Yarn(y)) = m.config.rope_scaling.clone() else { panic!("{:?}", m.config.rope_scaling) };
    assert_eq!((y.mscale, y.mscale_all_dim), (Some(1.0), Some(0.5)));
    // The plain 0.1 ln(factor) + 1 instead of the mscale ratio.
    let plain = autosp::models::Yarn { mscale: None, mscale_all_dim: None, ..y };
    assert_misses("qwen3_yarn_mscale", &m, Some(RopeScaling::Yarn(plain)), "the attention factor without mscale");
}

#[test]
fn gemma3_yarn_on_the_global_layers_only_matches_transformers() {
    let m = check("gemma3_yarn");
    assert_eq!(m.config.rope_scaling, Some(RopeScaling::Yarn(autosp::models::Yarn::new(4.0, 32))));
    assert_eq!((m.config.rope_theta, m.config.rope_local_theta), (1e6, Some(1e4)));
    assert_misses("gemma3_yarn", &m, None, "the unscaled frequencies");
}

#[test]
fn dynamic_ntk_matches_transformers_from_the_global_length() {
    let m = check("llama_dynamic");
    assert_eq!(m.config.rope_scaling, Some(RopeScaling::Dynamic { factor: 2.0 }));
    assert_misses("llama_dynamic", &m, None, "the unscaled frequencies");
    // A rank that took its shard's length (96 / 4 = 24 tokens, inside the window) would compute the default
    // frequencies: the forward with that length declared misses transformers' loss.
    let g = golden("llama_dynamic");
    let targets = {
        let ids = g.ids.flatten_all().unwrap().to_vec1::<u32>().unwrap();
        let t: Vec<i64> = ids[1..].iter().map(|&i| i as i64).chain([-100]).collect();
        Tensor::new(t, &Device::Cpu).unwrap()
    };
    let positions: Vec<usize> = (0..96).collect();
    let loss_at = |len: Option<usize>| {
        let tape = Tape::inference();
        if let Some(len) = len {
            tape.set_sequence_length(len);
        }
        let (sum, count) = m.loss(&tape, &g.ids, &positions, &targets).unwrap();
        sum.tensor().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap() / count as f64
    };
    // Undeclared, the model reads its positions' length (96): transformers' loss.
    assert!((loss_at(None) - g.loss).abs() <= TOL * g.loss, "{} vs {}", loss_at(None), g.loss);
    let shard = loss_at(Some(24));
    assert!((shard - g.loss).abs() > TOL * g.loss, "the shard's length must change the loss: {shard} vs {}", g.loss);
}

/// Padding does not count: 94 tokens on 4 Ring ranks are padded to 96, and the dynamic base still comes from
/// 94 real tokens (transformers' `max(position_ids) + 1` of the unpadded sequence), as one rank computes it.
#[test]
fn dynamic_ntk_reads_the_real_length_not_the_padded_one() {
    let m = load("llama_dynamic");
    let ids = golden("llama_dynamic").ids.narrow(1, 0, 94).unwrap();
    let (model, ids2) = (Arc::new(m.clone()), ids.clone());
    let sp = run_ranks(4, Duration::from_secs(60), move |pg| -> Result<f64, String> {
        let own = LlamaModel::from_weights(&model.config, model.to_weights()).map_err(|e| e.to_string())?;
        let policy = Checkpointing::Policy(CheckpointPolicy::None);
        let c = compile(own, CompileConfig::new(pg, Strategy::Ring, policy)).map_err(|e| e.to_string())?;
        assert_eq!(c.padded_len(94), 96);
        c.eval_loss(&ids2, None).map(|(l, _)| l).map_err(|e| e.to_string())
    });
    let sp = sp.into_iter().next().unwrap().unwrap().unwrap();
    let one_rank = |len: Option<usize>| {
        let tape = Tape::inference();
        if let Some(len) = len {
            tape.set_sequence_length(len);
        }
        let flat = ids.flatten_all().unwrap().to_vec1::<u32>().unwrap();
        let t: Vec<i64> = flat[1..].iter().map(|&i| i as i64).chain([-100]).collect();
        let positions: Vec<usize> = (0..94).collect();
        let (sum, count) = m.loss(&tape, &ids, &positions, &Tensor::new(t, &Device::Cpu).unwrap()).unwrap();
        sum.tensor().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap() / count as f64
    };
    let (real, padded) = (one_rank(None), one_rank(Some(96)));
    assert!((sp - real).abs() <= 1e-5 * real, "Ring P = 4 on 94 tokens: {sp} vs one rank's {real}");
    assert!((sp - padded).abs() > 1e-5 * real, "the padded length would give {padded}, {sp} must differ");
}

/// The forward-only paths hand over the length too: logits (all rows, and a few by `logits_at`) of the
/// dynamic and longrope models on 2 Ulysses ranks equal one rank's over the whole sequence.
#[test]
fn logits_over_ranks_use_the_global_length() {
    for name in ["llama_dynamic", "phi3_longrope"] {
        let m = load(name);
        let ids = golden(name).ids;
        let positions: Vec<usize> = (0..96).collect();
        let one: Vec<f32> =
            m.logits(&Tape::inference(), &ids, &positions).unwrap().tensor().flatten_all().unwrap().to_vec1().unwrap();
        let (model, ids2) = (Arc::new(m.clone()), ids.clone());
        let out = run_ranks(2, Duration::from_secs(60), move |pg| -> Result<(Vec<f32>, Vec<f32>), String> {
            let own = LlamaModel::from_weights(&model.config, model.to_weights()).map_err(|e| e.to_string())?;
            let policy = Checkpointing::Policy(CheckpointPolicy::None);
            let c = compile(own, CompileConfig::new(pg, Strategy::Ulysses, policy)).map_err(|e| e.to_string())?;
            let all = c.logits(&ids2).map_err(|e| e.to_string())?;
            let some = c.logits_at(&ids2, &[95, 3]).map_err(|e| e.to_string())?;
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            Ok((flat(all), flat(some)))
        });
        let (all, some) = out.into_iter().next().unwrap().unwrap().unwrap();
        assert!(rel(&all, &one) <= 1e-5, "{name}: logits over 2 ranks off by {:e}", rel(&all, &one));
        let vocab = one.len() / 96;
        let rows: Vec<f32> = [95, 3].iter().flat_map(|&r| one[r * vocab..(r + 1) * vocab].to_vec()).collect();
        assert!(rel(&some, &rows) <= 1e-5, "{name}: logits_at off by {:e}", rel(&some, &rows));
    }
}

#[test]
fn longrope_matches_transformers_with_the_long_factors() {
    let m = check("phi3_longrope");
    let Some(RopeScaling::LongRope(l)) = m.config.rope_scaling.clone() else { panic!("{:?}", m.config.rope_scaling) };
    assert_eq!((l.original_max_position_embeddings, l.factor, l.short_factor.len()), (32, None, 8));
    // The short factors where the sequence (96) is past the window (32).
    let short = autosp::models::LongRope { long_factor: l.short_factor.clone(), ..l };
    assert_misses("phi3_longrope", &m, Some(RopeScaling::LongRope(short)), "the short factors");
}
