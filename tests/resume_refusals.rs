//! A run is refused in `Job::prepare`, before any rank allocates the model (#41), when the checkpoint it
//! resumes cannot go on it: its model states exceed the memory budget on this mesh (the message names the
//! bytes, the budget's source and the `--shard` level or rank count that fits), or it belongs to another model
//! (an adapter trained on a base of another architecture, or optimizer state of parameters this run does not
//! have). The budget's decision is the accounting's (`model_state_bytes`) at the run's level.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use autosp::compile::sharding::{model_state_bytes, ParamCounts};
use autosp::core::comm::run_ranks;
use autosp::core::{CausalLm, ShardLevel};
use autosp::models::{random_weights, save_model, SaveOptions, TinySpec};
use autosp::train::checkpoint::check_state;
use autosp::train::checkpoint::model_slices::skeleton;
use autosp::train::checkpoint::resume_fit::{check_fits, Budget};
use autosp::train::{Job, RunOptions};
use candle_core::{DType, Device};

/// A tiny model of `hidden` written into `dir`.
fn write_model(dir: &Path, hidden: usize) -> String {
    let config = TinySpec { hidden, intermediate: 2 * hidden, ..TinySpec::default() }.config();
    let weights = random_weights(&config, 3, DType::F32, &Device::Cpu).unwrap();
    save_model(dir, &config, &weights, &SaveOptions::default()).unwrap();
    dir.to_str().unwrap().to_string()
}

fn options(model: &str, save: &Path) -> RunOptions {
    RunOptions { model: Some(model.into()), ..common::quick_run(save) }
}

/// Runs `o` on one thread rank to the end; the checkpoint it saved.
fn train(o: RunOptions) -> PathBuf {
    let save = o.save.clone().unwrap();
    let steps = o.steps;
    common::run_job(&Job::prepare(o, 1, true).unwrap(), 1);
    save.join(format!("step-{steps}"))
}

fn refused(o: RunOptions, p: usize) -> String {
    Job::prepare(o, p, true).err().expect("the run must be refused").to_string()
}

#[test]
fn a_resume_whose_states_exceed_the_budget_is_refused_naming_what_fits() {
    let tmp = tempfile::tempdir().unwrap();
    let model = write_model(&tmp.path().join("model"), 64);
    let ckpt = train(options(&model, &tmp.path().join("run")));
    let resume = |budget: Option<u64>, shard: Option<ShardLevel>| RunOptions {
        resume: Some(ckpt.clone()),
        steps: 2,
        allow_changes: true,
        memory_budget: budget,
        shard,
        ..options(&model, &tmp.path().join("run"))
    };
    // Over 2 thread ranks at `none` the states of both ranks live in this process.
    let e = refused(resume(Some(1_000_000), Some(ShardLevel::None)), 2);
    assert!(e.contains(&format!("--resume {}", ckpt.display())), "{e}");
    assert!(e.contains("--shard none over 2 rank(s)") && e.contains("--memory-budget is 1.0 MiB"), "{e}");
    assert!(e.contains("resume with --shard parameters over") && e.contains("ranks or more"), "{e}");
    // The same resume within a budget that holds it is prepared (and nothing was allocated by the refusal).
    Job::prepare(resume(Some(1 << 30), Some(ShardLevel::None)), 2, true).unwrap();
    // Without --memory-budget the host's available memory is the budget: a tiny model fits.
    Job::prepare(resume(None, Some(ShardLevel::Parameters)), 2, true).unwrap();
}

/// The level named is the first above the run's that fits, by the accounting.
#[test]
fn the_level_named_is_the_first_that_fits_by_the_accounting() {
    let config = TinySpec::default().config();
    let mut model = skeleton(&config, DType::F32, &Device::Cpu).unwrap();
    let dims = model.dims();
    let counts = ParamCounts::of(&mut model, &dims);
    let at = |level| model_state_bytes(&counts, DType::F32, level, 4).total() as u64;
    // One process per rank (no launcher variables here): one rank's states against the budget.
    let mut fits = |bytes, level| {
        check_fits("x", &mut model, DType::F32, Some(level), 4, false, false, &Budget { bytes, source: "b" })
    };
    assert!(fits(at(ShardLevel::None), ShardLevel::None).is_ok());
    let e = fits(at(ShardLevel::None) - 1, ShardLevel::None).unwrap_err().to_string();
    assert!(e.contains("resume with --shard optimizer"), "{e}");
    let e = fits(at(ShardLevel::Parameters), ShardLevel::Optimizer).unwrap_err().to_string();
    assert!(e.contains("resume with --shard parameters"), "{e}");
    let e = fits(at(ShardLevel::Parameters) - 1, ShardLevel::Parameters).unwrap_err().to_string();
    assert!(e.contains("resume with --shard parameters over ") && e.contains(" ranks or more"), "{e}");
}

/// The refusal's figures are in the accounting's unit (MiB), past a GiB too: the need and the budget read as
/// the per-rank accounting beside them does.
#[test]
fn the_figures_of_a_refusal_are_in_the_accountings_unit() {
    let spec = TinySpec {
        layers: 8,
        hidden: 4096,
        intermediate: 11008,
        heads: 32,
        kv_heads: 8,
        vocab: 32000,
        ..TinySpec::default()
    };
    let mut model = skeleton(&spec.config(), DType::F32, &Device::Cpu).unwrap();
    let budget = Budget { bytes: 2 << 30, source: "the budget" };
    let e = check_fits("x", &mut model, DType::F32, Some(ShardLevel::None), 1, false, false, &budget)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the budget is 2048.0 MiB"), "{e}");
    assert!(!e.contains("GiB"), "{e}");
}

#[test]
fn an_adapter_resumed_on_another_model_is_refused_naming_the_difference() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let model = write_model(&dir, 64);
    let ckpt = train(RunOptions { lora: Some("2".into()), ..options(&model, &tmp.path().join("lora")) });
    // The base's directory now holds another model (a new download, a hub revision moved on).
    std::fs::remove_dir_all(&dir).unwrap();
    write_model(&dir, 96);
    for shard in [None, Some(ShardLevel::Parameters)] {
        let o = RunOptions {
            resume: Some(ckpt.clone()),
            steps: 2,
            allow_changes: true,
            shard,
            ..options(&model, &tmp.path().join("lora"))
        };
        let e = refused(o, 2);
        assert!(e.contains("the adapter was trained on another model"), "{e}");
        assert!(e.contains("hidden_size 64 -> 96") && e.contains("--model"), "{e}");
    }
}

/// The optimizer state's headers are checked against the parameters a run trains, on a skeleton (nothing
/// but headers read): another model's parameters are refused naming one.
#[test]
fn optimizer_state_of_other_parameters_is_refused_from_the_headers() {
    let tmp = tempfile::tempdir().unwrap();
    let model = write_model(&tmp.path().join("model"), 64);
    let ckpt = train(options(&model, &tmp.path().join("full")));
    let state = autosp::train::checkpoint::verify(&ckpt).unwrap();
    let params = |hidden: usize| {
        let config = TinySpec { hidden, intermediate: 2 * hidden, ..TinySpec::default() }.config();
        (skeleton(&config, DType::F32, &Device::Cpu).unwrap().params(), config)
    };
    let (same, config) = params(64);
    check_state(&ckpt, &state, &config, &same).unwrap();
    let (other, config) = params(96);
    let e = check_state(&ckpt, &state, &config, &other).unwrap_err().to_string();
    assert!(e.contains("model.embed_tokens.weight") && e.contains("belongs to another model"), "{e}");
}

/// One process per rank checks alone (its own host's memory), so one may refuse what the others accept:
/// `Job::prepare_on` agrees over the group, and every rank stops at once (the refusing one with its reason,
/// the others naming a refusal), not at a collective's timeout.
#[test]
fn a_rank_that_refuses_while_preparing_stops_every_rank_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = write_model(&tmp.path().join("model"), 64);
    let started = std::time::Instant::now();
    let out = run_ranks(2, Duration::from_secs(120), |pg| {
        // Rank 1's budget cannot hold the model states; rank 0 has none to hold to.
        let budget = (pg.rank() == 1).then_some(1_000_000);
        let o = RunOptions { memory_budget: budget, ..options(&model, &tmp.path().join(format!("run{}", pg.rank()))) };
        Ok::<_, String>(Job::prepare_on(o, pg.as_ref()).err().map(|e| e.to_string()))
    });
    let errors: Vec<String> = out.into_iter().map(|r| r.unwrap().unwrap().expect("every rank must stop")).collect();
    assert!(errors[1].contains("--memory-budget is 1.0 MiB"), "{}", errors[1]);
    assert!(errors[0].contains("another rank refused the run while preparing it"), "{}", errors[0]);
    assert!(started.elapsed() < Duration::from_secs(60), "the ranks stopped after {:?}", started.elapsed());
}

/// A model without a skeleton (Phi-3's fused files; a GGUF file likewise) is read whole, and checked as the
/// others are: a budget its states exceed is refused.
#[test]
fn a_model_read_whole_is_checked_against_the_budget_too() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("phi3");
    let spec =
        TinySpec { model_type: autosp::models::ModelType::Phi3, hidden: 64, intermediate: 128, ..TinySpec::default() };
    let config = spec.config();
    let weights = random_weights(&config, 3, DType::F32, &Device::Cpu).unwrap();
    save_model(&dir, &config, &weights, &SaveOptions::default()).unwrap();
    let o = RunOptions { memory_budget: Some(1_000_000), ..options(dir.to_str().unwrap(), &tmp.path().join("run")) };
    let e = refused(o, 1);
    assert!(e.contains("--memory-budget is 1.0 MiB"), "{e}");
}
