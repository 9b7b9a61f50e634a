//! The data × sequence mesh and sharded model states against one rank training the whole batch: at D × S =
//! 2 × 1, 1 × 2 and 2 × 2 thread ranks and every sharding level, the loss and every parameter gradient of
//! one step, and the parameters after 3 AdamW steps, in f32 and in bf16 with f32 masters; tied and untied
//! embeddings; sequence-aware and no checkpointing (gathered weights are dropped and gathered again in
//! backward under both).
//!
//! Tolerances (max |a - b| over max |b|, per tensor):
//! - f32 loss and gradients: 1e-5. The ranks compute the same products; the world's reduction adds the
//!   replicas' and shards' partial sums in another order than one rank's matmuls do (a few f32 ulps).
//! - f32 parameters after 3 AdamW steps (lr 1e-3, eps 1e-6): 1e-4, a tenth of one step. AdamW's step is
//!   `lr · m / (sqrt(v) + eps)`, nearly `lr · sign(g)` at first, so an element whose gradient changed sign
//!   would be off by `2 · lr`: the bound says no gradient sign changed and every step agrees.
//! - bf16 loss and gradients: 2.5e-2, the bar of the bf16 sequence-parallel tests (`mixed_precision.rs`):
//!   bf16 rounds each activation to 8 bits, and the mesh splits the sums differently, so roundings fall
//!   differently. Gradients that small move sign, so the f32 masters after 3 steps are held by what AdamW
//!   makes of it: at most 1% of the elements off by more than half a step (`lr / 2`), none by more than the
//!   3 steps could move them apart (`6 · lr`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use autosp::compile::{
    build_sharded, compile, Checkpointing, CompileConfig, CompileError, Mesh, ModelStateBytes, Strategy,
};
use autosp::core::comm::run_ranks;
use autosp::core::module::all_params;
use autosp::core::optim::{AdamW, AdamWConfig, Optimizer};
use autosp::core::{CausalLm, CheckpointPolicy, ShardLevel};
use autosp::models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};
use common::rel;

const STEPS: usize = 3;
const LR: f64 = 1e-3;

fn adamw() -> AdamW {
    AdamW::new(AdamWConfig { eps: 1e-6, ..AdamWConfig::default() }).unwrap()
}

/// Two sequences of 32 tokens (so two replicas take one each), with ignored labels spread unevenly.
fn batch(vocab: usize, step: usize) -> (Tensor, Tensor) {
    let (b, n) = (2, 32);
    let ids: Vec<u32> = (0..(b * n) as u32).map(|i| (i * 17 + 5 + 3 * step as u32) % vocab as u32).collect();
    let labels: Vec<i64> =
        ids.iter().enumerate().map(|(i, &x)| if i % n < 3 || i % 7 == 3 { -100 } else { x as i64 }).collect();
    (Tensor::from_vec(ids, (b, n), &Device::Cpu).unwrap(), Tensor::from_vec(labels, (b, n), &Device::Cpu).unwrap())
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

/// The first step's loss and whole gradients, and the whole parameters (f32 masters of bf16 ones) after
/// `STEPS` AdamW steps (model order).
#[derive(Debug, PartialEq)]
struct Run {
    loss: f64,
    grads: Vec<Vec<f32>>,
    params: Vec<Vec<f32>>,
}

/// `mesh` (None: one rank) at `level`, the model built from `spec` in `dtype` under `policy`.
fn run(spec: TinySpec, dtype: DType, mesh: Option<Mesh>, level: ShardLevel, policy: CheckpointPolicy) -> Run {
    let config = spec.config();
    let weights = random_weights(&config, 3, dtype, &Device::Cpu).unwrap();
    let world = mesh.map_or(1, |m| m.world());
    let (config, weights) = (Arc::new(config), Arc::new(weights));
    let out = run_ranks(world, Duration::from_secs(120), move |pg| -> Result<Run, String> {
        let model = LlamaModel::from_weights(&config, (*weights).clone()).map_err(|e| e.to_string())?;
        let mut cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(policy))
            .with_dtype(dtype)
            .with_sharding(level);
        if let Some(m) = mesh {
            cfg = cfg.with_mesh(m);
        }
        let c = compile(model, cfg).map_err(|e| e.to_string())?;
        assert_eq!(c.sharding(), if world == 1 { ShardLevel::None } else { level });
        let params = c.params();
        let mut opt = adamw();
        let mut first = None;
        for step in 0..STEPS {
            let (ids, labels) = batch(c.model().dims().vocab, step);
            let out = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
            if step == 0 {
                let whole = c.whole_grads(&out.grads).map_err(|e| e.to_string())?;
                first = Some((out.loss, params.iter().map(|p| flat(whole.get(p).unwrap())).collect()));
            }
            opt.step(&params, &out.grads, LR).map_err(|e| e.to_string())?;
        }
        let (loss, grads) = first.unwrap();
        let whole: Vec<Vec<f32>> = params
            .iter()
            .map(|p| match (opt.master(p), p.shard()) {
                (Some(m), Some(s)) => flat(&s.gather(m).unwrap()),
                (Some(m), None) => flat(m),
                (None, _) => flat(&p.whole().unwrap()),
            })
            .collect();
        Ok(Run { loss, grads, params: whole })
    });
    let mut runs: Vec<Run> = out.into_iter().map(|r| r.expect("rank failed").expect("step failed")).collect();
    let first = runs.remove(0);
    for other in &runs {
        assert_eq!(other, &first, "every rank holds the same loss, gradients and parameters");
    }
    first
}

/// f32: loss and gradients within 1e-5, parameters within 1e-4 (see the module doc).
fn assert_close_f32(what: &str, got: &Run, want: &Run) {
    assert_loss_and_grads(what, got, want, 1e-5);
    for (i, (g, w)) in got.params.iter().zip(&want.params).enumerate() {
        let e = rel(g, w);
        assert!(e <= 1e-4, "{what}: parameter {i} after {STEPS} AdamW steps off by {e:e}");
    }
}

/// bf16: loss and gradients within 2.5e-2; masters off by more than `lr / 2` on at most 1% of the elements
/// and by at most `6 · lr` anywhere (see the module doc).
fn assert_close_bf16(what: &str, got: &Run, want: &Run) {
    assert_loss_and_grads(what, got, want, 2.5e-2);
    let (mut off, mut total) = (0usize, 0usize);
    for (i, (g, w)) in got.params.iter().zip(&want.params).enumerate() {
        for (a, b) in g.iter().zip(w) {
            let d = (a - b).abs() as f64;
            assert!(d <= 6.0 * LR, "{what}: master {i} moved {d:e} away, more than {STEPS} steps can");
            off += usize::from(d > LR / 2.0);
        }
        total += g.len();
    }
    assert!(off * 100 <= total, "{what}: {off} of {total} master elements off by more than half a step");
}

fn assert_loss_and_grads(what: &str, got: &Run, want: &Run, tol: f64) {
    assert!((got.loss - want.loss).abs() <= tol * want.loss.abs(), "{what}: loss {} vs {}", got.loss, want.loss);
    assert_eq!(got.grads.len(), want.grads.len());
    for (i, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
        let e = rel(g, w);
        assert!(e <= tol, "{what}: gradient {i} off by {e:e}");
    }
}

const MESHES: [(usize, usize); 3] = [(2, 1), (1, 2), (2, 2)];

#[test]
fn every_mesh_and_sharding_level_trains_like_one_rank_f32() {
    for tied in [false, true] {
        let spec = TinySpec { tied, ..TinySpec::default() };
        let want = run(spec.clone(), DType::F32, None, ShardLevel::None, CheckpointPolicy::SequenceAware);
        for (d, s) in MESHES {
            for level in ShardLevel::ALL {
                let what = format!("{d} × {s}, {level}, tied {tied}");
                let got = run(spec.clone(), DType::F32, Some(Mesh::new(d, s)), level, CheckpointPolicy::SequenceAware);
                assert_close_f32(&what, &got, &want);
            }
        }
    }
}

#[test]
fn sharded_parameters_without_checkpointing_and_in_bf16_train_like_one_rank() {
    let spec = TinySpec::default();
    let want = run(spec.clone(), DType::F32, None, ShardLevel::None, CheckpointPolicy::None);
    let got = run(spec.clone(), DType::F32, Some(Mesh::new(2, 2)), ShardLevel::Parameters, CheckpointPolicy::None);
    assert_close_f32("2 × 2, parameters, no checkpointing", &got, &want);
    let want = run(spec.clone(), DType::BF16, None, ShardLevel::None, CheckpointPolicy::SequenceAware);
    for level in [ShardLevel::Optimizer, ShardLevel::Parameters] {
        let got = run(spec.clone(), DType::BF16, Some(Mesh::new(2, 2)), level, CheckpointPolicy::SequenceAware);
        assert_close_bf16(&format!("bf16 2 × 2, {level}"), &got, &want);
    }
}

/// A batch the replicas cannot split is refused, on every rank, saying what would work.
#[test]
fn a_batch_the_replicas_cannot_split_is_refused() {
    let config = TinySpec::default().config();
    let weights = random_weights(&config, 3, DType::F32, &Device::Cpu).unwrap();
    let out = run_ranks(2, Duration::from_secs(60), move |pg| {
        let model = LlamaModel::from_weights(&config, weights.clone()).unwrap();
        let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::SequenceAware))
            .with_mesh(Mesh::new(2, 1));
        let c = compile(model, cfg).unwrap();
        let ids = Tensor::from_vec((0..48u32).collect::<Vec<_>>(), (3, 16), &Device::Cpu).unwrap();
        c.train_step(&ids, None).unwrap_err().to_string()
    });
    for r in out {
        let e = r.unwrap();
        assert!(e.contains("does not split over 2 data-parallel replicas") && e.contains("2 or 4"), "{e}");
    }
}

/// What each rank holds at each level: parameters whole but at `Parameters`, gradients and optimizer state
/// slices at every sharded level; the accounting says the same.
#[test]
fn each_level_holds_what_it_says() {
    let config = TinySpec::default().config();
    let weights = random_weights(&config, 3, DType::BF16, &Device::Cpu).unwrap();
    for level in ShardLevel::ALL {
        let (config, weights) = (config.clone(), weights.clone());
        let out = run_ranks(2, Duration::from_secs(60), move |pg| -> Result<(), String> {
            let model = LlamaModel::from_weights(&config, weights.clone()).unwrap();
            let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::SequenceAware))
                .with_dtype(DType::BF16)
                .with_sharding(level);
            let c = compile(model, cfg).map_err(|e| e.to_string())?;
            let (ids, labels) = batch(128, 0);
            let out = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
            let mut opt = adamw();
            opt.step(&c.params(), &out.grads, LR).map_err(|e| e.to_string())?;
            for p in all_params(c.model()) {
                let whole = p.shape().elem_count();
                let slice = whole.div_ceil(2);
                let want_state = if level == ShardLevel::None { whole } else { slice };
                assert_eq!(out.grads.get(&p).unwrap().elem_count(), want_state, "{level}: {}", p.name());
                let want_stored = if level == ShardLevel::Parameters { slice } else { whole };
                assert_eq!(p.tensor().elem_count(), want_stored, "{level}: {}", p.name());
            }
            let (acct, held) = (c.model_state_bytes(), ModelStateBytes::held(&c.params(), &out.grads, &opt));
            assert_eq!((acct.params, acct.moments, acct.masters), (held.params, held.moments, held.masters));
            // The optimizer gets slices at every sharded level; below `gradients` the tape held them whole first.
            let whole_grads: usize = all_params(c.model()).iter().map(|p| p.shape().elem_count() * 4).sum();
            let want_grads = if level == ShardLevel::Optimizer { whole_grads } else { held.grads };
            assert_eq!(acct.grads, want_grads, "{level}");
            assert_eq!(acct.gathered > 0, level == ShardLevel::Parameters);
            Ok(())
        });
        for r in out {
            r.unwrap().unwrap();
        }
    }
}

/// A model built one rank at a time and sharded as it is built (`build_sharded`) compiles at its own level and
/// trains exactly like the same model sharded by `compile` (the same slices, the same collectives); a level
/// asked for that differs is refused; a rank whose build fails stops every rank, the others naming it.
#[test]
fn a_model_built_sharded_in_turn_trains_like_one_sharded_by_compile() {
    let spec = TinySpec::default();
    let want =
        run(spec.clone(), DType::F32, Some(Mesh::new(1, 2)), ShardLevel::Parameters, CheckpointPolicy::SequenceAware);
    let config = spec.config();
    let weights = random_weights(&config, 3, DType::F32, &Device::Cpu).unwrap();
    let (c2, w2) = (config.clone(), weights.clone());
    let out = run_ranks(2, Duration::from_secs(60), move |pg| -> Result<(f64, Vec<Vec<f32>>), String> {
        let build = || LlamaModel::from_weights(&c2, w2.clone()).map_err(|e| CompileError::Input(e.to_string()));
        let model = build_sharded(&pg, ShardLevel::Parameters, build).map_err(|e| e.to_string())?;
        assert!(all_params(&model).iter().all(|p| p.tensor().elem_count() == p.shape().elem_count().div_ceil(2)));
        let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
        let c = compile(model, CompileConfig::new(pg.clone(), Strategy::Auto, policy)).map_err(|e| e.to_string())?;
        assert_eq!(c.sharding(), ShardLevel::Parameters);
        assert!(c.sharding_reason().contains("built sharded"), "{}", c.sharding_reason());
        let (ids, labels) = batch(c.model().dims().vocab, 0);
        let out = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
        let whole = c.whole_grads(&out.grads).map_err(|e| e.to_string())?;
        // Asking compile for another level than the model was built at is refused.
        let again = build_sharded(&pg, ShardLevel::Parameters, build).map_err(|e| e.to_string())?;
        let cfg = CompileConfig::new(pg, Strategy::Auto, policy).with_sharding(ShardLevel::Optimizer);
        let e = compile(again, cfg).err().expect("a mismatched level must be refused").to_string();
        assert!(e.contains("built sharded at `parameters`") && e.contains("`optimizer`"), "{e}");
        Ok((out.loss, c.params().iter().map(|p| flat(whole.get(p).unwrap())).collect()))
    });
    for r in out {
        let (loss, grads) = r.unwrap().unwrap();
        assert_eq!(loss, want.loss, "the same slices and collectives give the same loss");
        assert_eq!(grads, want.grads, "and the same gradients");
    }

    // Rank 1's build fails: rank 1 returns its own error, rank 0 (built already) one naming rank 1.
    let out = run_ranks(2, Duration::from_secs(60), move |pg| {
        let rank = pg.rank();
        build_sharded(&pg, ShardLevel::Parameters, || {
            if rank == 1 {
                return Err(CompileError::Input("rank 1 cannot read its weights".into()));
            }
            LlamaModel::from_weights(&config, weights.clone()).map_err(|e| CompileError::Input(e.to_string()))
        })
        .err()
        .map(|e| e.to_string())
    });
    let errors: Vec<String> = out.into_iter().map(|r| r.unwrap().expect("every rank must fail")).collect();
    assert!(errors[0].contains("rank 1 of 2 failed building"), "{}", errors[0]);
    assert!(errors[1].contains("cannot read its weights"), "{}", errors[1]);
}

/// Thread ranks keep one copy of what every rank holds alike: at `optimizer` and `gradients` every rank holds
/// the very same parameter tensors (one storage, after compile and after every update) while the moments and
/// masters are split; at `none` each keeps its own copy (the level keeps everything on every rank). In f32
/// and in bf16 with masters. (Which level a compile picks on thread ranks: `compile::sharding`'s tests.)
#[test]
fn thread_ranks_share_the_parameters_they_hold_alike() {
    let config = TinySpec::default().config();
    for (dtype, level) in
        [(DType::F32, ShardLevel::Optimizer), (DType::BF16, ShardLevel::Gradients), (DType::F32, ShardLevel::None)]
    {
        let weights = random_weights(&config, 3, dtype, &Device::Cpu).unwrap();
        let config = config.clone();
        let out = run_ranks(2, Duration::from_secs(60), move |pg| -> Result<Vec<Vec<usize>>, String> {
            let model = LlamaModel::from_weights(&config, weights.clone()).unwrap();
            let cfg = CompileConfig::new(pg.clone(), Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None))
                .with_dtype(dtype)
                .with_sharding(level);
            let c = compile(model, cfg).map_err(|e| e.to_string())?;
            let keys = |c: &autosp::Compiled<LlamaModel>| -> Vec<usize> {
                c.params().iter().map(|p| autosp::core::memory::storage_key(&p.tensor())).collect()
            };
            let mut seen = vec![keys(&c)];
            let mut opt = adamw();
            for step in 0..2 {
                let (ids, labels) = batch(c.model().dims().vocab, step);
                let out = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
                opt.step(&c.params(), &out.grads, LR).map_err(|e| e.to_string())?;
                seen.push(keys(&c));
            }
            // Every rank's tensors are alive until both have read their addresses (no address reuse).
            pg.barrier().map_err(|e| e.to_string())?;
            Ok(seen)
        });
        let seen: Vec<Vec<Vec<usize>>> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
        // At `none` the f32 ranks start from the same weights (clones of one tensor) and part at the update.
        let shared = seen[0] == seen[1];
        assert_eq!(shared, level != ShardLevel::None, "{dtype:?} {level}: shared {shared}");
    }
}

/// One model cloned for two thread ranks shares its parameters (`Param` is a shared handle): sharding it is
/// refused on the ranks with an error that says to give each rank its own model, instead of one rank's slices
/// silently replacing the other's.
#[test]
fn a_model_shared_by_thread_ranks_is_refused_when_sharded() {
    let config = TinySpec::default().config();
    let model =
        LlamaModel::from_weights(&config, random_weights(&config, 3, DType::F32, &Device::Cpu).unwrap()).unwrap();
    // As the trainer runs ranks: a rank that fails tells the others (run_ranks_fallible), so none waits.
    let start = std::time::Instant::now();
    let out = autosp::core::comm::run_ranks_fallible(2, Duration::from_secs(60), move |pg| {
        let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None))
            .with_sharding(ShardLevel::Optimizer);
        compile(model.clone(), cfg).map(|_| ()).map_err(|e| e.to_string())
    });
    let errors: Vec<String> = out
        .into_iter()
        .map(|r| match r {
            Ok(Err(e)) => e,
            other => format!("{other:?}"),
        })
        .collect();
    assert!(
        errors.iter().any(|e| e.contains("give each rank its own model")),
        "a shared model must be refused, naming the fix: {errors:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(10), "the other rank must stop at once: {errors:?}");
}
