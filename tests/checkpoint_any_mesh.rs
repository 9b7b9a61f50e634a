//! A checkpoint resumes on any mesh: a run sharded over W = 2 ranks, saved after 2 steps, resumed on W = 1
//! (unsharded), on W = 4 (S = 4 at `parameters`, and D = 2 × S = 2 at `optimizer`), and a D = 2 × S = 1 one on
//! S = 2: each resuming rank reads its own elements of the saved slices, and the next two steps' losses are
//! the uninterrupted run's within 1e-5 (relative: the meshes only reorder the f32 sums; the second reads the
//! restored AdamW moments), and so are the parameters after them (1e-4: a tenth of one AdamW step, as in mesh_sharding.rs). Resuming onto another
//! model, or onto a run that trains other parameters, is refused from the files' headers, before the state is
//! read, naming the parameter.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use autosp::compile::{compile, Checkpointing, CompileConfig, Compiled, Mesh, Strategy};
use autosp::core::comm::run_ranks;
use autosp::core::lora::LoraConfig;
use autosp::core::optim::{AdamW, AdamWConfig, Optimizer};
use autosp::core::{CausalLm, CheckpointPolicy, ShardLevel};
use autosp::models::{random_weights, save_model, LlamaModel, SaveOptions, TinySpec};
use autosp::train::checkpoint::{restore_state, save_sharded, verify};
use autosp::train::{Position, RunShape, TrainerState};
use candle_core::{DType, Device, Tensor};

const LR: f64 = 1e-3;

/// Step `step`'s batch: two sequences of 32 tokens.
fn batch(vocab: usize, step: usize) -> Tensor {
    let (b, n) = (2, 32);
    let ids: Vec<u32> = (0..(b * n) as u32).map(|i| (i * 29 + 3 + 7 * step as u32) % vocab as u32).collect();
    Tensor::from_vec(ids, (b, n), &Device::Cpu).unwrap()
}

fn shape() -> RunShape {
    RunShape {
        seq_len: 32,
        micro_batches: 1,
        data_parallel: 1,
        data_source: "test".into(),
        seed: 0,
        dtype: DType::F32,
        steps: 4,
        lr: LR,
        decay_all: true,
        warmup: 0,
        max_attention_distance: None,
        curriculum: "none".into(),
        base_model: None,
        rope_scaling: None,
        packing: None,
    }
}

fn adamw() -> AdamW {
    AdamW::new(AdamWConfig { eps: 1e-6, ..AdamWConfig::default() }).unwrap()
}

/// The model at `dir` (f32) compiled on `pg` at `mesh` and `level`, LoRA rank 4 when `lora`.
fn build(
    dir: &Path,
    pg: Arc<dyn autosp::core::comm::ProcessGroup>,
    mesh: Mesh,
    level: ShardLevel,
    lora: bool,
) -> Compiled<LlamaModel> {
    let mut model = LlamaModel::load(dir.to_str().unwrap(), DType::F32).unwrap();
    if lora {
        model.add_lora(&LoraConfig::new(4)).unwrap();
    }
    let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::SequenceAware))
        .with_mesh(mesh)
        .with_sharding(level);
    compile(model, cfg).unwrap()
}

/// Steps `from..to` of the model at `model_dir` on `mesh` at `level`, resuming the checkpoint `resume` when
/// given, saving at `to` into `save` when given. Returns the losses and the whole parameters at the end, or the
/// resume's error.
fn run(
    model_dir: &Path,
    mesh: Mesh,
    level: ShardLevel,
    (from, to): (usize, usize),
    resume: Option<&Path>,
    save: Option<&Path>,
) -> Result<(Vec<f64>, Vec<Vec<f32>>), String> {
    let (model_dir, resume, save) =
        (model_dir.to_path_buf(), resume.map(Path::to_path_buf), save.map(Path::to_path_buf));
    let out = run_ranks(mesh.world(), Duration::from_secs(120), move |pg| -> Result<_, String> {
        let c = build(resume.as_deref().unwrap_or(&model_dir), pg.clone(), mesh, level, false);
        let params = c.params();
        let mut opt = adamw();
        if let Some(dir) = &resume {
            let state = verify(dir).map_err(|e| e.to_string())?;
            restore_state(dir, &state, &c.model().config, pg.as_ref(), &mut opt, &params).map_err(|e| e.to_string())?;
        }
        let mut losses = Vec::new();
        for step in from..to {
            let out = c.train_step(&batch(c.model().dims().vocab, step), None).map_err(|e| e.to_string())?;
            losses.push(out.loss);
            opt.step(&params, &out.grads, LR).map_err(|e| e.to_string())?;
        }
        if let Some(root) = &save {
            let state = TrainerState::new(to, opt.steps(), Position { drawn: 0, rng: 0 }, &shape());
            save_sharded(&pg, root, c.model(), &opt, &params, &state, &[]).map_err(|e| e.to_string())?;
        }
        let whole =
            params.iter().map(|p| p.whole().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
        Ok((losses, whole))
    });
    let mut out: Vec<_> = out.into_iter().map(|r| r.expect("rank failed")).collect();
    out.remove(0)
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    a.iter().zip(b).map(|(p, q)| (p - q).abs() as f64).fold(0.0, f64::max) / scale.max(1e-30)
}

#[test]
fn a_sharded_checkpoint_resumes_on_any_world_and_mesh() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    let config = TinySpec::default().config();
    let weights = random_weights(&config, 7, DType::F32, &Device::Cpu).unwrap();
    save_model(&base, &config, &weights, &SaveOptions::default()).unwrap();
    let (want, want_params) = run(&base, Mesh::new(1, 2), ShardLevel::Parameters, (0, 4), None, None).unwrap();
    let saved = [(Mesh::new(1, 2), ShardLevel::Parameters, "s2"), (Mesh::new(2, 1), ShardLevel::Optimizer, "d2")];
    for (mesh, level, name) in saved {
        let root = tmp.path().join(name);
        let (first, _) = run(&base, mesh, level, (0, 2), None, Some(&root)).unwrap();
        assert!((first[1] - want[1]).abs() <= 1e-5 * want[1].abs(), "{name}: step 1 {} vs {}", first[1], want[1]);
        let ckpt = root.join("step-2");
        let resumes: &[(Mesh, ShardLevel)] = match name {
            "s2" => &[
                (Mesh::new(1, 1), ShardLevel::None),
                (Mesh::new(1, 4), ShardLevel::Parameters),
                (Mesh::new(2, 2), ShardLevel::Optimizer),
            ],
            _ => &[(Mesh::new(1, 2), ShardLevel::Gradients)],
        };
        for &(to, level) in resumes {
            let (next, params) = run(&base, to, level, (2, 4), Some(&ckpt), None).unwrap();
            let what = format!("{name} resumed on {} x {} at {level}", to.data, to.sequence);
            // The second resumed step's loss reads the restored moments (the first only the weights).
            for (k, (got, want)) in next.iter().zip(&want[2..]).enumerate() {
                assert!((got - want).abs() <= 1e-5 * want.abs(), "{what}: step {} loss {got} vs {want}", k + 2);
            }
            for (i, (p, w)) in params.iter().zip(&want_params).enumerate() {
                assert!(rel(p, w) <= 1e-4, "{what}: parameter {i} off by {:e}", rel(p, w));
            }
        }
    }
}

#[test]
fn resuming_onto_another_model_or_other_trained_parameters_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    let config = TinySpec::default().config();
    save_model(&base, &config, &random_weights(&config, 7, DType::F32, &Device::Cpu).unwrap(), &SaveOptions::default())
        .unwrap();
    let root = tmp.path().join("s2");
    run(&base, Mesh::new(1, 2), ShardLevel::Parameters, (0, 1), None, Some(&root)).unwrap();
    let ckpt = root.join("step-1");
    // Another model: a wider MLP, same names.
    let other = tmp.path().join("other");
    let wide = TinySpec { intermediate: 96, ..TinySpec::default() }.config();
    save_model(&other, &wide, &random_weights(&wide, 7, DType::F32, &Device::Cpu).unwrap(), &SaveOptions::default())
        .unwrap();
    let out = run_ranks(2, Duration::from_secs(60), move |pg| {
        let state = verify(&ckpt).unwrap();
        let c = build(&other, pg.clone(), Mesh::new(1, 2), ShardLevel::Parameters, false);
        let e = restore_state(&ckpt, &state, &c.model().config, pg.as_ref(), &mut adamw(), &c.params()).unwrap_err();
        let lora = build(&ckpt, pg.clone(), Mesh::new(1, 2), ShardLevel::Parameters, true);
        let l =
            restore_state(&ckpt, &state, &lora.model().config, pg.as_ref(), &mut adamw(), &lora.params()).unwrap_err();
        (e.to_string(), l.to_string())
    });
    for r in out {
        let (e, l) = r.unwrap();
        assert!(e.contains("another model") && e.contains("mlp") && e.contains("stored as"), "{e}");
        assert!(l.contains("lora_A") || l.contains("does not train"), "{l}");
    }
}
