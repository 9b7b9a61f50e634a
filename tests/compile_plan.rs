//! The compiled model's memory plan against measurement: `plan(n)` at an `n` several times the probe lengths
//! predicts the tape's after-forward bytes and peak of a real step within 10% (P = 1 and 2 thread ranks, every
//! policy); a byte budget between the Full and None peaks gives a per-block mix whose measured peak fits the
//! budget and whose gradients are bit-identical to the None policy's; `explain()` names what it must.

mod common;

use autosp::compile::{compile, Checkpointing, CompileConfig, CompileError, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::CheckpointPolicy;
use autosp_models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};

/// `layers` layers, hidden 32, 4 heads, 2 kv heads, vocab 128, room for 2048 positions.
fn tiny_with(layers: usize) -> LlamaModel {
    let spec = TinySpec { layers, hidden: 32, intermediate: 64, ..TinySpec::default() };
    let mut cfg = spec.config();
    cfg.max_position_embeddings = 2048;
    LlamaModel::from_weights(&cfg, random_weights(&cfg, 11, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

/// 4 layers, so that a budget can mix policies.
fn tiny() -> LlamaModel {
    tiny_with(4)
}

fn ids(n: usize) -> Tensor {
    let v: Vec<u32> = (0..n as u32).map(|i| (i * 31 + 7) % 128).collect();
    Tensor::from_vec(v, (1, n), &Device::Cpu).unwrap()
}

const POLICIES: [CheckpointPolicy; 3] =
    [CheckpointPolicy::None, CheckpointPolicy::Full, CheckpointPolicy::SequenceAware];

/// Predicted vs measured `(after forward, peak)` tape bytes of every rank at `n` tokens.
fn predicted_and_measured(p: usize, strategy: Strategy, policy: CheckpointPolicy, n: usize) -> Vec<[f64; 4]> {
    let out = run_ranks(p, std::time::Duration::from_secs(60), move |pg| {
        let mut c = compile(tiny_with(2), CompileConfig::new(pg, strategy, Checkpointing::Policy(policy)))?;
        let plan = c.plan(n)?;
        assert!(4 * plan.probes.1 <= n, "the prediction must extrapolate: probes {:?} for n = {n}", plan.probes);
        let step = c.train_step(&ids(n), None)?;
        Ok::<_, CompileError>([
            plan.predicted_after_forward,
            step.after_forward.held_bytes as f64,
            plan.predicted_peak,
            step.peak_bytes as f64,
        ])
    });
    out.into_iter().map(|r| r.unwrap().unwrap()).collect()
}

#[test]
fn plan_predicts_measured_tape_within_ten_percent() {
    let n = 2048;
    for (p, strategy) in [(1, Strategy::Auto), (2, Strategy::Ulysses), (2, Strategy::Ring)] {
        for policy in POLICIES {
            for (rank, [pa, ma, pp, mp]) in predicted_and_measured(p, strategy, policy, n).into_iter().enumerate() {
                let what = format!("P={p} {strategy:?} {policy:?} rank {rank}");
                eprintln!(
                    "{what}: after forward {:+.2}%, peak {:+.2}%",
                    100.0 * (pa / ma - 1.0),
                    100.0 * (pp / mp - 1.0)
                );
                // The bar: the prediction within 10% of the measured tape.
                assert!((pa / ma - 1.0).abs() <= 0.10, "{what}: after forward predicted {pa} measured {ma}");
                assert!((pp / mp - 1.0).abs() <= 0.10, "{what}: peak predicted {pp} measured {mp}");
            }
        }
    }
}

/// One step at `n` on one rank under `checkpoint`: the block policies, the tape peak, loss and gradients.
fn step_under(checkpoint: Checkpointing, n: usize) -> (Vec<CheckpointPolicy>, usize, f64, Vec<Vec<f32>>) {
    let out = run_ranks(1, std::time::Duration::from_secs(60), move |pg| {
        let mut cfg = CompileConfig::new(pg, Strategy::Auto, checkpoint);
        cfg.seq_len = Some(n);
        let mut c = compile(tiny(), cfg)?;
        let policies = c.plan(n)?.policies;
        let step = c.train_step(&ids(n), None)?;
        let grads = c
            .params()
            .iter()
            .map(|p| step.grads.get(p).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect();
        Ok::<_, CompileError>((policies, step.peak_bytes, step.loss, grads))
    });
    out.into_iter().next().unwrap().unwrap().unwrap()
}

#[test]
fn byte_budget_mixes_policies_fits_and_keeps_gradients() {
    let n = 256;
    let (_, none_peak, none_loss, none_grads) = step_under(Checkpointing::Policy(CheckpointPolicy::None), n);
    let (_, full_peak, _, _) = step_under(Checkpointing::Policy(CheckpointPolicy::Full), n);
    let (_, sa_peak, _, _) = step_under(Checkpointing::Policy(CheckpointPolicy::SequenceAware), n);
    assert!(full_peak < sa_peak && sa_peak < none_peak, "peaks: Full {full_peak}, SA {sa_peak}, None {none_peak}");
    // Between Full and all-SequenceAware (nine tenths of the way), so not every block can keep more than
    // Full. (A block's backward replays lazily, so one SequenceAware block already costs most of the gap:
    // its held attention outputs plus its own backward transient; the planner's estimate from the uniform
    // policies is conservative and needs the room.)
    let budget = full_peak + (sa_peak - full_peak) * 9 / 10;
    let (policies, peak, loss, grads) = step_under(Checkpointing::Budget(budget), n);
    eprintln!("peaks: Full {full_peak}, SA {sa_peak}, None {none_peak}; budget {budget}: {policies:?} peaks at {peak}");
    assert!(policies.contains(&CheckpointPolicy::Full), "budget {budget}: {policies:?} has no Full block");
    assert!(
        policies.iter().any(|p| *p != CheckpointPolicy::Full),
        "budget {budget} (Full peaks at {full_peak}): {policies:?} keeps nothing more than Full"
    );
    assert!(peak <= budget, "budget {budget}: measured peak {peak} under {policies:?}");
    // The tape replays the same ops on the same inputs: gradients are bit-identical under every policy mix.
    assert_eq!(loss, none_loss);
    assert_eq!(grads, none_grads, "gradients under {policies:?} differ from the None policy's");
}

#[test]
fn budget_below_full_is_a_typed_error_before_any_step() {
    let out = run_ranks(1, std::time::Duration::from_secs(60), |pg| {
        let mut cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Budget(1 << 10));
        cfg.seq_len = Some(256);
        compile(tiny(), cfg).err()
    });
    match out.into_iter().next().unwrap().unwrap() {
        Some(CompileError::BudgetTooSmall { budget, smallest, n }) => {
            assert_eq!((budget, n), (1 << 10, 256));
            assert!(smallest > budget);
        }
        other => panic!("expected BudgetTooSmall, got {other:?}"),
    }
}

#[test]
fn explain_names_strategy_reason_policies_tree_and_peak() {
    let out = run_ranks(2, std::time::Duration::from_secs(60), |pg| {
        let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::SequenceAware));
        let mut c = compile(tiny(), cfg).unwrap();
        let (strategy, reason) = (format!("strategy {:?}", c.resolved().strategy), c.resolved().reason.clone());
        (c.explain(256).unwrap(), strategy, reason)
    });
    let (text, strategy, reason) = out.into_iter().next().unwrap().unwrap();
    assert!(!reason.is_empty());
    for want in [
        strategy.as_str(),
        reason.as_str(),
        "policy per block: 0: SequenceAware, 1: SequenceAware, 2: SequenceAware, 3: SequenceAware",
        "LlamaDecoderLayer [checkpoint region]",
        "self_attn: LlamaAttention [attention: ",
        "q_proj: Linear",
        "GiB peak",
        "bytes per token per layer",
    ] {
        assert!(text.contains(want), "explain() lacks {want:?}:\n{text}");
    }
}
