//! The padding row against transformers: every family's transformers model builds its embedding as
//! `nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)`, whose row `pad_token_id` gets no gradient
//! from the lookup. Tiny checkpoints transformers made (`tests/fixtures/padding`, by
//! `tests/fixtures/make_padding_golden.py`), on 32 ids holding the pad id five times or more:
//! - `llama_pad`: Llama, `pad_token_id` 3, untied: the row's gradient is exactly zero here at every mesh;
//! - `gemma3_pad`: Gemma 3, tied, no `pad_token_id` in config.json (Gemma's default, 0): the row gets the
//!   tied head's gradient only.
//!
//! One step's loss and every gradient equal transformers' within 1e-4 relative (as tests/model_families.rs:
//! the same f32 maths through other kernels) at P = 1, under 2 Ulysses ranks, and with the model states
//! sharded at `Gradients` and `Parameters` over 2 ranks (the sharded lookup's own backward). The same model
//! without its padding row gives the row transformers' gradient plus the lookups' and every other row
//! bit for bit the same: the fixtures exercise the row.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp::core::comm::run_ranks;
use autosp::core::{CheckpointPolicy, ShardLevel};
use autosp::models::LlamaModel;
use candle_core::{DType, Device, Tensor};

const TOL: f64 = 1e-4;
const EMBED: &str = "model.embed_tokens.weight";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/padding").join(name)
}

/// transformers' ids, loss and gradients (by HF name, flattened) of a fixture.
fn golden(name: &str) -> (Tensor, f64, HashMap<String, Vec<f32>>) {
    let mut g = candle_core::safetensors::load(fixture(name).join("golden.safetensors"), &Device::Cpu).unwrap();
    let ids = g.remove("input_ids").unwrap().to_dtype(DType::U32).unwrap();
    let loss = g.remove("loss").unwrap().to_vec1::<f64>().unwrap()[0];
    let grads = g.into_iter().filter_map(|(k, t)| k.strip_prefix("grad.").map(|n| (n.to_string(), flat(&t)))).collect();
    (ids, loss, grads)
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

/// The loss and whole gradients (by HF name) of one step of `model` compiled on `p` thread ranks.
fn step(
    model: &LlamaModel,
    p: usize,
    strategy: Strategy,
    level: Option<ShardLevel>,
    ids: &Tensor,
) -> (f64, HashMap<String, Vec<f32>>) {
    let (model, ids) = (Arc::new(model.clone()), ids.clone());
    let out = run_ranks(p, Duration::from_secs(60), move |pg| -> Result<_, String> {
        let mut cfg = CompileConfig::new(pg, strategy, Checkpointing::Policy(CheckpointPolicy::SequenceAware));
        if let Some(level) = level {
            cfg = cfg.with_sharding(level);
        }
        // Each rank its own parameters (sharding changes them), the padding row kept as the model has it.
        let mut own = LlamaModel::from_weights(&model.config, model.to_weights()).map_err(|e| e.to_string())?;
        own.embed_tokens.padding_idx = model.embed_tokens.padding_idx;
        let c = compile(own, cfg).map_err(|e| e.to_string())?;
        let out = c.train_step(&ids, None).map_err(|e| e.to_string())?;
        let whole = c.whole_grads(&out.grads).map_err(|e| e.to_string())?;
        let grads = c.params().iter().map(|p| (p.name().to_string(), flat(whole.get(p).unwrap()))).collect();
        Ok((out.loss, grads))
    });
    out.into_iter().next().unwrap().expect("rank 0 panicked").expect("the step failed")
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale
}

/// Row `r` of a flattened `[vocab, hidden]` gradient.
fn row(g: &[f32], r: usize, hidden: usize) -> &[f32] {
    &g[r * hidden..(r + 1) * hidden]
}

/// Checks fixture `name` (padding row `pad`) against transformers at every mesh and against the same model
/// without its padding row; returns the padding row's gradient at P = 1.
fn check(name: &str, pad: usize) -> Vec<f32> {
    let (ids, loss0, want) = golden(name);
    let hidden = 32;
    let n_pad = ids.flatten_all().unwrap().to_vec1::<u32>().unwrap().iter().filter(|&&i| i as usize == pad).count();
    assert!(n_pad >= 5, "{name}: the ids hold the pad id at 5 places or more, not {n_pad}");
    let model = LlamaModel::load(fixture(name).to_str().unwrap(), DType::F32).unwrap();
    assert_eq!(model.embed_tokens.padding_idx, Some(pad), "{name}: the padding row read from config.json");
    let runs = [
        (1, Strategy::Auto, None),
        (2, Strategy::Ulysses, None),
        (2, Strategy::Auto, Some(ShardLevel::Gradients)),
        (2, Strategy::Auto, Some(ShardLevel::Parameters)),
    ];
    let mut first = None;
    for (p, strategy, level) in runs {
        let what = format!("{name} P = {p} {strategy:?} sharding {level:?}");
        let (loss, grads) = step(&model, p, strategy, level, &ids);
        assert!((loss - loss0).abs() <= TOL * loss0, "{what}: loss {loss} vs transformers' {loss0}");
        assert_eq!(grads.len(), want.len(), "{what}: parameter count");
        for (n, w) in &want {
            let e = rel(&grads[n], w);
            assert!(e <= TOL, "{what}: gradient of {n} off by {e:e}");
        }
        let r = row(&grads[EMBED], pad, hidden);
        let e = rel(r, row(&want[EMBED], pad, hidden));
        assert!(e <= TOL, "{what}: the padding row's gradient off by {e:e} of its own largest");
        first.get_or_insert(grads);
    }
    let padded = first.unwrap();

    // Without the padding row: the row's gradient gains the lookups' (far from transformers'), the other
    // rows and every other parameter the same bits.
    let mut plain = model.clone();
    plain.embed_tokens.padding_idx = None;
    let (_, grads) = step(&plain, 1, Strategy::Auto, None, &ids);
    let (r0, r1) = (row(&padded[EMBED], pad, hidden), row(&grads[EMBED], pad, hidden));
    let moved = r0.iter().zip(r1).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let largest = padded[EMBED].iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(moved > 100.0 * TOL as f32 * largest, "{name}: the lookups add {moved} to the row");
    for (n, g) in &grads {
        if n == EMBED {
            for v in (0..g.len() / hidden).filter(|&v| v != pad) {
                assert_eq!(row(g, v, hidden), row(&padded[n], v, hidden), "{name}: embedding row {v}");
            }
        } else {
            assert_eq!(g, &padded[n], "{name}: {n}");
        }
    }
    r0.to_vec()
}

#[test]
fn llama_padding_row_gets_no_gradient_as_in_transformers() {
    let r = check("llama_pad", 3);
    assert!(r.iter().all(|&v| v == 0.0), "an untied model's padding row gets nothing: {r:?}");
}

#[test]
fn gemma3_default_padding_row_gets_only_the_tied_heads_gradient() {
    let model = LlamaModel::load(fixture("gemma3_pad").to_str().unwrap(), DType::F32).unwrap();
    assert_eq!(model.config.pad_token_id, Some(0), "Gemma3TextConfig's default");
    let r = check("gemma3_pad", 0);
    assert!(r.iter().any(|&v| v != 0.0), "the tied head still trains row 0");
}
