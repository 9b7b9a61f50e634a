//! Batches whose targets are not everywhere: a rank's shard (or a replica's rows) without a trainable target
//! adds zero to the token-weighted sums, so P = 2 gives P = 1's loss and gradients; a batch with no target at
//! all is `CompileError::NoTargets` on every rank, for training and for evaluation alike, so a caller can skip
//! it and go on. The trainer does: a chat run whose windows hold no assistant token trains to the end,
//! skipping and saying the steps that had none, and the summary counts them. And the plan's probe steps
//! (`--explain`, `--checkpoint BYTES`) work on a data × sequence mesh.

mod common;
mod longctx_cli;

use autosp::compile::{compile, Checkpointing, CompileConfig, CompileError, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::CheckpointPolicy;
use autosp_models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};
use longctx_cli::{losses, metrics_summary, run_ok, s};

fn tiny() -> LlamaModel {
    let spec = TinySpec { hidden: 32, intermediate: 64, ..TinySpec::default() };
    let cfg = spec.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, 11, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

/// `n = 48` tokens whose only trained labels are positions 1..12: the shifted targets are 0..11, all in the
/// first quarter. At P = 2 rank 1 holds the second half (Ulysses' contiguous layout) or chunks 1 and 2 of 4
/// (Ring's zigzag): either way no target of its own.
fn first_quarter(n: usize, vocab: usize) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 29 + 3) % vocab as u32).collect();
    let labels: Vec<i64> = ids.iter().enumerate().map(|(i, &x)| if i < n / 4 { x as i64 } else { -100 }).collect();
    (Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap(), Tensor::from_vec(labels, (1, n), &Device::Cpu).unwrap())
}

#[test]
fn a_rank_whose_shard_has_no_target_gives_one_ranks_gradients() {
    let n = 48;
    let want = common::reference_on(tiny(), n, first_quarter);
    for s in [Strategy::Ulysses, Strategy::Ring] {
        for policy in [CheckpointPolicy::None, CheckpointPolicy::SequenceAware] {
            let got = common::compiled_on(tiny, 2, n, s, policy, DType::F32, first_quarter);
            common::assert_close(&format!("P=2 {s:?} {policy:?}"), &got, &want, common::tolerance(s, 2));
        }
    }
}

#[test]
fn a_batch_without_any_target_is_no_targets_on_every_rank_for_training_and_evaluation() {
    for p in [1, 2] {
        let out = run_ranks(p, std::time::Duration::from_secs(30), move |pg| {
            let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
            let c = compile(tiny(), CompileConfig::new(pg, Strategy::Auto, policy)).map_err(|e| e.to_string())?;
            let ids = Tensor::from_vec((0..32u32).collect(), (1, 32), &Device::Cpu).unwrap();
            let labels = Tensor::full(-100i64, (1, 32), &Device::Cpu).unwrap();
            let train = matches!(c.train_step(&ids, Some(&labels)), Err(CompileError::NoTargets));
            let eval = matches!(c.eval_loss(&ids, Some(&labels)), Err(CompileError::NoTargets));
            // The model is still usable: the next batch, with targets, trains.
            let next = c.train_step(&ids, None).map_err(|e| e.to_string())?;
            Ok::<_, String>((train, eval, next.valid_tokens))
        });
        for r in out {
            let (train, eval, valid) = r.unwrap().unwrap();
            assert!(train && eval, "P={p}: a batch with no target must be NoTargets for the step and for eval_loss");
            assert_eq!(valid, 31, "P={p}: the next batch trains its 31 targets");
        }
    }
}

/// A tiny model in the HF layout with the chat fixture's tokenizer and chat template.
fn chat_model(dir: &std::path::Path) -> std::path::PathBuf {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let m = dir.join("model");
    autosp_models::write_tiny(&m, &TinySpec { vocab: 400, ..TinySpec::default() }, 5, DType::F32).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(f), m.join(f)).unwrap();
    }
    m
}

#[test]
fn a_chat_run_skips_and_says_the_steps_whose_windows_have_no_answer_and_trains_to_the_end() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = chat_model(t);
    // Every other conversation has no assistant turn: its window (one per conversation, truncated) has no
    // trainable token. One window per step: steps 1 and 3 have nothing to train, 2 and 4 do.
    let (question, answered) = (
        r#"{"messages": [{"role": "user", "content": "What is the capital of France?"}]}"#,
        r#"{"messages": [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Paris."}]}"#,
    );
    let data = t.join("chat.jsonl");
    std::fs::write(&data, format!("{question}\n{answered}\n").repeat(2)).unwrap();
    let metrics = t.join("m.jsonl");
    let common =
        ["--model", s(&model), "--data", s(&data), "--seq-len", "32", "--lr", "1e-3", "--chat-layout", "truncate"];
    let args = [&common[..], &["--sp", "2", "--steps", "4", "--warmup", "1"]].concat();
    let save = t.join("run");
    let args = [&args[..], &["--metrics", s(&metrics), "--save", s(&save), "--save-every", "1"]].concat();
    let out = run_ok(t, &args);
    // A skipped step is still a step: its periodic save is made.
    for step in 1..=4 {
        assert!(save.join(format!("step-{step}")).join("model.safetensors").is_file(), "step-{step} not saved\n{out}");
    }
    for step in [1, 3] {
        let line = format!("step    {step}/4: skipped, no trainable target in its 1 window(s)");
        assert!(out.contains(&line), "missing `{line}` in\n{out}");
    }
    let trained: Vec<u64> = losses(&metrics).iter().map(|l| l.0).collect();
    assert_eq!(trained, vec![2, 4], "steps 2 and 4 train\n{out}");
    let sum = metrics_summary(&metrics);
    assert_eq!(sum["untrained_windows"], 2, "{sum}");
    assert_eq!(sum["windows"], 4, "{sum}");
    assert_eq!(sum["no_target_steps"], 2, "{sum}");
    assert!(out.contains("windows without a target") && out.contains("2 of 4 (no assistant token)"), "{out}");
    // Two windows a step: each step has one with an answer, so none is skipped; the empty ones weigh nothing,
    // the same on every mesh: one rank accumulating two micro-batches (the first without a target), and two
    // data-parallel replicas taking one window each (replica 0's without a target).
    let mut runs = Vec::new();
    let meshes: [(&str, &[&str]); 2] =
        [("one", &["--sp", "1", "--batch-tokens", "64"]), ("dp", &["--dp", "2", "--sp", "1"])];
    for (name, mesh) in meshes {
        let m = t.join(format!("{name}.jsonl"));
        let args = [&common[..], mesh, &["--steps", "2", "--metrics", s(&m)]].concat();
        let out = run_ok(t, &args);
        assert!(!out.contains("skipped"), "{name}: {out}");
        runs.push(losses(&m));
    }
    assert_eq!(runs[0].len(), 2);
    for ((s1, a), (s2, b)) in runs[0].iter().zip(&runs[1]) {
        assert!(s1 == s2 && (a - b).abs() <= 1e-5 * a.abs(), "step {s1}: one rank {a}, two replicas {b}");
    }
    // Held-out scoring of the same conversations skips the windows without an answer.
    let args = [&common[..], &["--steps", "0", "--eval-data", s(&data)]].concat();
    let out = run_ok(t, &args);
    assert!(out.contains("held-out"), "{out}");
    // Held-out conversations none of which has an answer: nothing to score, said before training.
    let questions = t.join("questions.jsonl");
    std::fs::write(&questions, format!("{question}\n").repeat(2)).unwrap();
    let args = [&common[..], &["--steps", "1", "--eval-data", s(&questions)]].concat();
    let err = longctx_cli::run_err(t, &args);
    assert!(err.contains("none of its 2 window(s) holds a token to score"), "{err}");
}

#[test]
fn the_plan_and_a_byte_budget_work_on_a_data_parallel_mesh() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let out = run_ok(t, &["--quick", "--dp", "2", "--sp", "1", "--explain"]);
    assert!(out.contains("mesh: 2 data × 1 sequence"), "{out}");
    assert!(out.contains("tokens per sequence, one sequence per replica (2 replicas)"), "{out}");
    assert!(out.contains("predicted per rank"), "{out}");
    let out = run_ok(t, &["--quick", "--dp", "2", "--sp", "1", "--checkpoint", "64MiB", "--steps", "2"]);
    assert!(out.contains("step    2/2"), "{out}");
}
