//! The harness the compile tests share: the uncompiled model trained one step on one rank its own way, the
//! same model compiled on P thread ranks, and the comparison of loss, every gradient and the parameters after
//! one AdamW step; and a tiny Llama on thread ranks with a recording process group, for tests of a step's
//! collectives; the options of a short training run and a job run on thread ranks, for the tests of `Job`.
#![allow(dead_code)]

use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::module::all_params;
use autosp_core::ops;
use autosp_core::optim::{AdamW, AdamWConfig, Optimizer};
use autosp_core::{CausalLm, CheckpointPolicy, Tape};
use candle_core::{DType, Device, Tensor};

/// Ids `[1, n]` and labels `[1, n]` with ignored labels spread unevenly (a block at the start, a few
/// scattered), so shards hold different numbers of valid targets.
pub fn batch(n: usize, vocab: usize) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 17 + 5) % vocab as u32).collect();
    let labels: Vec<i64> =
        ids.iter().enumerate().map(|(i, &x)| if i < 5 || i % 7 == 3 { -100 } else { x as i64 }).collect();
    (Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap(), Tensor::from_vec(labels, (1, n), &Device::Cpu).unwrap())
}

/// Loss, gradients (model order) and parameters after one AdamW step.
pub type Outcome = (f64, Vec<Vec<f32>>, Vec<Vec<f32>>);

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

/// A function making the batch `(ids [1, n], labels [1, n])` of `n` tokens for a vocabulary.
pub type MakeBatch = fn(usize, usize) -> (Tensor, Tensor);

/// The uncompiled model trained one step on one rank.
pub fn reference<M: CausalLm>(model: M, n: usize) -> Outcome {
    reference_on(model, n, batch)
}

/// [`reference`] on the batch `make_batch` makes.
pub fn reference_on<M: CausalLm>(model: M, n: usize, make_batch: MakeBatch) -> Outcome {
    let (ids, labels) = make_batch(n, model.dims().vocab);
    let labels = labels.to_vec2::<i64>().unwrap().remove(0);
    let mut targets: Vec<i64> = labels[1..].to_vec();
    targets.push(-100);
    let targets = Tensor::from_vec(targets, n, &Device::Cpu).unwrap();
    let tape = Tape::new(CheckpointPolicy::None);
    let positions: Vec<usize> = (0..n).collect();
    let (sum, count) = model.loss(&tape, &ids, &positions, &targets).unwrap();
    let loss = ops::scale(&tape, &sum, 1.0 / count as f64).unwrap();
    tape.backward(&loss).unwrap();
    let grads = tape.param_grads();
    let params = all_params(&model);
    let g: Vec<Vec<f32>> = params.iter().map(|p| flat(grads.get(p).unwrap())).collect();
    AdamW::new(AdamWConfig::default()).unwrap().step(&params, &grads, 1e-2).unwrap();
    let l = loss.tensor().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
    (l, g, params.iter().map(|p| flat(&p.tensor())).collect())
}

/// The model built by `make` (once per rank) compiled on `p` thread ranks, trained one step.
pub fn compiled<M, F>(make: F, p: usize, n: usize, strategy: Strategy, policy: CheckpointPolicy) -> Outcome
where
    M: CausalLm + 'static,
    F: Fn() -> M + Send + Sync + 'static,
{
    compiled_in(make, p, n, strategy, policy, DType::F32)
}

/// [`compiled`] with the compute dtype `dtype` (the model `make` builds must be in it).
pub fn compiled_in<M, F>(
    make: F,
    p: usize,
    n: usize,
    strategy: Strategy,
    policy: CheckpointPolicy,
    dtype: DType,
) -> Outcome
where
    M: CausalLm + 'static,
    F: Fn() -> M + Send + Sync + 'static,
{
    compiled_on(make, p, n, strategy, policy, dtype, batch)
}

/// [`compiled_in`] on the batch `make_batch` makes.
pub fn compiled_on<M, F>(
    make: F,
    p: usize,
    n: usize,
    strategy: Strategy,
    policy: CheckpointPolicy,
    dtype: DType,
    make_batch: MakeBatch,
) -> Outcome
where
    M: CausalLm + 'static,
    F: Fn() -> M + Send + Sync + 'static,
{
    let make = std::sync::Arc::new(make);
    let out = run_ranks(p, std::time::Duration::from_secs(60), move |pg| {
        let cfg = CompileConfig::new(pg, strategy, Checkpointing::Policy(policy)).with_dtype(dtype);
        let c = compile(make(), cfg).map_err(|e| e.to_string())?;
        let (ids, labels) = make_batch(n, c.model().dims().vocab);
        let step = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
        let params = c.params();
        // Thread ranks shard the optimizer state by default: the step hands out slices; compare whole ones.
        let whole = c.whole_grads(&step.grads).map_err(|e| e.to_string())?;
        let g: Vec<Vec<f32>> = params.iter().map(|p| flat(whole.get(p).unwrap())).collect();
        AdamW::new(AdamWConfig::default()).unwrap().step(&params, &step.grads, 1e-2).unwrap();
        Ok::<Outcome, String>((step.loss, g, params.iter().map(|p| flat(&p.tensor())).collect()))
    });
    let mut results: Vec<Outcome> = out.into_iter().map(|r| r.expect("rank failed").expect("step failed")).collect();
    let first = results.remove(0);
    for other in results {
        assert_eq!(other.1, first.1, "every rank must hold the same gradients");
        assert_eq!(other.2, first.2, "every rank must hold the same parameters");
    }
    first
}

/// Max relative error: `max_i |a_i - b_i| / max_i |b_i|`.
pub fn rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale
}

/// Loss and gradients within `tol`, relative to the largest element of each; parameters after AdamW within
/// `10 * tol`: Adam's first step is `lr * g / (|g| + eps)`, which turns a gradient difference `d` on an element
/// whose gradient is near `eps` into an update difference up to `lr * d / eps`.
pub fn assert_close(what: &str, got: &Outcome, want: &Outcome, tol: f64) {
    assert!((got.0 - want.0).abs() <= tol * want.0.abs(), "{what}: loss {} vs {}", got.0, want.0);
    assert_eq!(got.1.len(), want.1.len(), "{what}: parameter count");
    for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        assert!(rel(g, w) <= tol, "{what}: gradient {i} off by {:e}", rel(g, w));
    }
    for (i, (g, w)) in got.2.iter().zip(&want.2).enumerate() {
        assert!(rel(g, w) <= 10.0 * tol, "{what}: parameter {i} after AdamW off by {:e}", rel(g, w));
    }
}

/// Every strategy worth running at `p` ranks.
pub fn strategies(p: usize) -> Vec<Strategy> {
    let mut s = vec![Strategy::Ulysses, Strategy::Ring, Strategy::Auto];
    if p == 4 {
        s.push(Strategy::Hybrid { ulysses: 2 });
    }
    s
}

/// The tolerance for a strategy at `p` ranks (DESIGN.md: Ring within 1e-5 * P; Ulysses only reorders the
/// attention's sums: 1e-5 relative to the largest element).
pub fn tolerance(strategy: Strategy, p: usize) -> f64 {
    match strategy {
        Strategy::Ring | Strategy::Hybrid { .. } => 1e-5 * p as f64,
        _ => 1e-5,
    }
}

/// The bit patterns of `t`'s values widened to f32, flattened (exact for f32, bf16 and f16): compares
/// tensors bit for bit.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// A tiny Llama of `spec` (random f32 weights of `seed`, the same on every rank) on each of `world` thread
/// ranks, given to `f` with a recording process group over the world (which `f` compiles on): `f`'s results
/// in rank order; a rank that fails, or whose `f` returns an error, panics naming it.
pub fn recorded_tiny_ranks<T, F>(spec: autosp::models::TinySpec, seed: u64, world: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(autosp::models::LlamaModel, std::sync::Arc<autosp_core::comm::RecordingGroup>) -> Result<T, String> + Sync,
{
    let config = spec.config();
    let weights = autosp::models::random_weights(&config, seed, DType::F32, &Device::Cpu).unwrap();
    let out = run_ranks(world, std::time::Duration::from_secs(120), |pg| {
        let model = autosp::models::LlamaModel::from_weights(&config, weights.clone()).map_err(|e| e.to_string())?;
        f(model, autosp_core::comm::RecordingGroup::new(pg))
    });
    out.into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r} failed: {e}")).unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// The options of a short run that a test trains (or has refused): the default model (set `model` to give
/// another), sequences of 256 tokens, one a step, one step without warmup, the quick settings, checkpoints
/// saved under `save`. Change what a test needs with struct update syntax.
pub fn quick_run(save: &std::path::Path) -> autosp::train::RunOptions {
    autosp::train::RunOptions {
        seq_len: 256,
        batch_tokens: Some(256),
        quick: true,
        steps: 1,
        warmup: 0,
        save: Some(save.to_path_buf()),
        ..autosp::train::RunOptions::default()
    }
}

/// Runs every rank of `job` to its end on `world` thread ranks; panics naming a rank that fails.
pub fn run_job(job: &autosp::train::Job, world: usize) {
    let out = run_ranks(world, std::time::Duration::from_secs(120), |pg| {
        job.run_rank(pg, &|| false, &mut |_| {}).map(|_| ())
    });
    for (r, o) in out.into_iter().enumerate() {
        o.unwrap_or_else(|e| panic!("rank {r} failed: {e}")).unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}
