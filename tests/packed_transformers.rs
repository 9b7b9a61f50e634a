//! Packed documents against transformers: the fixtures of `tests/fixtures/make_packed_golden.py` (a tiny Llama
//! saved by transformers, and its loss and gradients on one window of 96 tokens packed from documents of 40, 30
//! and 26 tokens, the first going on from position 5, given as transformers takes packed data: `position_ids`
//! restarting at every document, labels -100 at every document's first token). Ours, from the same window and
//! its `cu_seqlens` (`Compiled::train_step_packed`, labels left to the ids: the step ignores the targets that
//! cross a boundary itself), at P = 1, 2 and 4 (Ulysses, Ring), within 1e-4 of transformers' loss and of
//! every gradient (relative to its largest element): f32 on both sides, other kernels and summation orders.
//! With dynamic NTK (a window of 32) the scaling reads the longest document's positions (45), not the 96 of
//! the window, as transformers' `max(position_ids) + 1`. The same window document-blind is far from it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::ops::Documents;
use autosp_core::CheckpointPolicy;
use autosp_models::LlamaModel;
use candle_core::{DType, Device, Tensor};

const TOL: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/packed").join(name)
}

struct Golden {
    ids: Tensor,
    documents: Documents,
    loss: f64,
    loss_blind: f64,
    grads: HashMap<String, Vec<f32>>,
}

fn golden(name: &str) -> Golden {
    let path = fixture(name).join("golden.safetensors");
    let mut g = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{name}: {e} (regenerate with tests/fixtures/make_packed_golden.py)"));
    let ids = g.remove("input_ids").unwrap().to_dtype(DType::U32).unwrap();
    let cu: Vec<usize> =
        g.remove("cu_seqlens").unwrap().to_vec1::<i64>().unwrap().iter().map(|&x| x as usize).collect();
    let first = g.remove("first_position").unwrap().to_vec1::<i64>().unwrap()[0] as usize;
    let documents = Documents::new(ids.dim(1).unwrap(), cu, first).unwrap();
    let loss = g.remove("loss").unwrap().to_vec1::<f64>().unwrap()[0];
    let loss_blind = g.remove("loss_blind").unwrap().to_vec1::<f64>().unwrap()[0];
    let grads = g
        .into_iter()
        .filter_map(|(k, t)| {
            k.strip_prefix("grad.").map(|n| (n.to_string(), t.flatten_all().unwrap().to_vec1().unwrap()))
        })
        .collect();
    Golden { ids, documents, loss, loss_blind, grads }
}

/// Loss and whole gradients by HF name of one packed step of the fixture `name` on `p` thread ranks.
fn packed_step(name: &str, p: usize, strategy: Strategy, g: &Golden) -> (f64, HashMap<String, Vec<f32>>) {
    let model = Arc::new(LlamaModel::load(fixture(name).to_str().unwrap(), DType::F32).unwrap());
    let (ids, documents) = (g.ids.clone(), g.documents.clone());
    let out = run_ranks(p, Duration::from_secs(60), move |pg| -> Result<_, String> {
        let own = LlamaModel::from_weights(&model.config, model.to_weights()).map_err(|e| e.to_string())?;
        let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
        let c = compile(own, CompileConfig::new(pg, strategy, policy)).map_err(|e| e.to_string())?;
        let out = c.train_step_packed(&ids, None, std::slice::from_ref(&documents)).map_err(|e| e.to_string())?;
        let whole = c.whole_grads(&out.grads).map_err(|e| e.to_string())?;
        let grads = c
            .params()
            .iter()
            .map(|p| (p.name().to_string(), whole.get(p).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect();
        Ok((out.loss, grads))
    });
    let mut all: Vec<_> = out.into_iter().map(|r| r.expect("rank panicked").expect("step failed")).collect();
    all.swap_remove(0)
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale
}

fn check(name: &str) {
    let g = golden(name);
    assert!((g.loss - g.loss_blind).abs() > 1e-2 * g.loss, "{name}: packing must change transformers' loss");
    let mut worst = 0f64;
    for (p, s) in [(1, Strategy::Auto), (2, Strategy::Ulysses), (2, Strategy::Ring), (4, Strategy::Ring)] {
        let (loss, grads) = packed_step(name, p, s, &g);
        let mut miss = (loss - g.loss).abs() / g.loss;
        assert_eq!(grads.len(), g.grads.len(), "parameter count");
        for (n, want) in &g.grads {
            miss = miss.max(rel(&grads[n], want));
        }
        assert!(miss <= TOL, "{name} P = {p} {s:?}: loss {loss} vs transformers' {}, worst miss {miss:e}", g.loss);
        worst = worst.max(miss);
    }
    eprintln!("{name}: worst relative miss against transformers {worst:e}");
}

#[test]
fn packed_window_matches_transformers_with_position_ids() {
    check("llama");
}

#[test]
fn dynamic_ntk_on_a_packed_window_reads_the_longest_document() {
    check("llama_dynamic");
}
