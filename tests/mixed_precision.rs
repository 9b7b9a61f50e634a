//! Mixed precision (bf16 compute, f32 master weights, moments, statistics and gradient reduction) on a tiny
//! Llama on the CPU: bf16 training tracks the f32 run's loss; bf16 sequence parallelism at P = 2 (Ulysses,
//! Ring) gives the bf16 P = 1 gradients; master weights stay f32 while the parameters are bf16; bf16 halves
//! the tape's bytes under every policy and the plan predicts it; resuming a bf16 run from its master weights
//! continues it bit for bit. "max relative error" below is `max_i |x_i - y_i| / max_i |y_i|` per tensor.

mod common;

use std::collections::HashMap;

use autosp::compile::{compile, Checkpointing, CompileConfig, CompileError, Compiled, Strategy};
use autosp_core::comm::{run_ranks, ProcessGroup};
use autosp_core::optim::{AdamW, AdamWConfig, Optimizer};
use autosp_core::{CheckpointPolicy, Param};
use autosp_models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};

const POLICIES: [CheckpointPolicy; 3] =
    [CheckpointPolicy::None, CheckpointPolicy::Full, CheckpointPolicy::SequenceAware];

/// The f32 weights of the tiny model: 2 layers, hidden 32, 4 heads, 2 kv heads, vocab 128.
fn weights() -> (autosp_models::LlamaConfig, HashMap<String, Tensor>) {
    weights_of(TinySpec { hidden: 32, intermediate: 64, ..TinySpec::default() })
}

/// The f32 weights of `spec`'s model (seed 7), with room for 2048 positions.
fn weights_of(spec: TinySpec) -> (autosp_models::LlamaConfig, HashMap<String, Tensor>) {
    let mut cfg = spec.config();
    cfg.max_position_embeddings = 2048;
    let w = random_weights(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
    (cfg, w)
}

/// The tiny model with the f32 weights converted to `dtype` (the same init in every dtype).
fn tiny(dtype: DType) -> LlamaModel {
    in_dtype(weights(), dtype)
}

fn in_dtype((cfg, w): (autosp_models::LlamaConfig, HashMap<String, Tensor>), dtype: DType) -> LlamaModel {
    let w = w.into_iter().map(|(k, t)| (k, t.to_dtype(dtype).unwrap())).collect();
    LlamaModel::from_weights(&cfg, w).unwrap()
}

/// A fresh AdamW for `params`; bf16/f16 parameters start their f32 masters from the exact f32 init (as the
/// example does for an f32 checkpoint trained in bf16).
fn optimizer(params: &[Param]) -> AdamW {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let (_, w) = weights();
    for p in params {
        if p.tensor().dtype() != DType::F32 {
            opt.set_master(p, &w[p.name()]).unwrap();
        }
    }
    opt
}

/// Step `s`'s sequence of `n` ids: a learnable rule (each id is the previous plus 17, mod 128) from a start
/// that changes with the step.
fn ids(s: usize, n: usize) -> Tensor {
    let v: Vec<u32> = (0..n).map(|i| ((i * 17 + s * 29 + 5) % 128) as u32).collect();
    Tensor::from_vec(v, (1, n), &Device::Cpu).unwrap()
}

fn compiled(
    pg: std::sync::Arc<dyn ProcessGroup>,
    dtype: DType,
    strategy: Strategy,
    policy: CheckpointPolicy,
) -> Result<Compiled<LlamaModel>, CompileError> {
    compile(tiny(dtype), CompileConfig::new(pg, strategy, Checkpointing::Policy(policy)).with_dtype(dtype))
}

/// `steps` AdamW steps (lr 3e-3) of the tiny model in `dtype` on one rank: the loss of every step.
fn train(dtype: DType, steps: usize) -> Vec<f64> {
    let out = run_ranks(1, std::time::Duration::from_secs(120), move |pg| {
        let c = compiled(pg, dtype, Strategy::Auto, CheckpointPolicy::SequenceAware)?;
        let params = c.params();
        let mut opt = optimizer(&params);
        let mut losses = Vec::new();
        for s in 0..steps {
            let out = c.train_step(&ids(s, 64), None)?;
            opt.step(&params, &out.grads, 3e-3)?;
            losses.push(out.loss);
        }
        Ok::<_, CompileError>(losses)
    });
    out.into_iter().next().unwrap().unwrap().unwrap()
}

#[test]
fn bf16_training_tracks_the_f32_loss() {
    let (f32_losses, bf16_losses) = (train(DType::F32, 50), train(DType::BF16, 50));
    eprintln!("f32 losses: {f32_losses:.4?}\nbf16 losses: {bf16_losses:.4?}");
    // The run must learn for the comparison to mean anything: the loss falls by more than half.
    assert!(f32_losses[49] < 0.5 * f32_losses[0], "f32 did not learn: {f32_losses:?}");
    let mut worst = 0f64;
    for (s, (a, b)) in f32_losses.iter().zip(&bf16_losses).enumerate() {
        let r = (b - a).abs() / a.abs();
        worst = worst.max(r);
        // The bar: within 2% of the f32 loss at every step (bf16 keeps 8 bits of mantissa, 0.4% per
        // rounding; the f32 masters keep the small updates from being rounded away).
        assert!(r <= 0.02, "step {}: bf16 loss {b} vs f32 {a} ({:.2}%)", s + 1, 100.0 * r);
    }
    eprintln!("bf16 vs f32 loss over 50 steps: worst {:.3}%", 100.0 * worst);
}

#[test]
fn bf16_sequence_parallel_gradients_equal_bf16_single_rank() {
    let n = 50;
    let want = common::compiled_in(|| tiny(DType::BF16), 1, n, Strategy::Ulysses, CheckpointPolicy::None, DType::BF16);
    for s in [Strategy::Ulysses, Strategy::Ring] {
        for policy in [CheckpointPolicy::None, CheckpointPolicy::SequenceAware] {
            let got = common::compiled_in(|| tiny(DType::BF16), 2, n, s, policy, DType::BF16);
            // bf16 rounds each activation to 8 mantissa bits (relative 2^-9 = 0.2%); P = 2 splits the
            // attention and the loss sums differently, so each rounding can fall the other way and the
            // differences add up over 2 layers forward and backward: the 2.5e-2 bar.
            assert!((got.0 - want.0).abs() <= 2.5e-2 * want.0.abs(), "{s:?} {policy:?}: loss {} vs {}", got.0, want.0);
            let mut worst = 0f64;
            for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
                let r = common::rel(g, w);
                worst = worst.max(r);
                assert!(r <= 2.5e-2, "{s:?} {policy:?}: gradient {i} max relative error {r:e}");
            }
            eprintln!("bf16 P=2 {s:?} {policy:?} vs P=1: worst gradient max relative error {worst:.2e}");
        }
    }
}

#[test]
fn master_weights_and_gradients_stay_f32_while_parameters_are_bf16() {
    let out = run_ranks(1, std::time::Duration::from_secs(60), |pg| {
        let c = compiled(pg, DType::BF16, Strategy::Auto, CheckpointPolicy::SequenceAware)?;
        let params = c.params();
        let mut opt = AdamW::new(AdamWConfig::default())?;
        for s in 0..3 {
            let out = c.train_step(&ids(s, 48), None)?;
            for p in &params {
                assert_eq!(out.grads.get(p).unwrap().dtype(), DType::F32, "{}: gradients reach AdamW in f32", p.name());
            }
            opt.step(&params, &out.grads, 1e-2)?;
        }
        for p in &params {
            let w = p.tensor();
            assert_eq!(w.dtype(), DType::BF16, "{}", p.name());
            let master = opt.master(p).unwrap_or_else(|| panic!("{} has no master", p.name()));
            assert_eq!(master.dtype(), DType::F32, "{}", p.name());
            let (m, v) = opt.moments(p).unwrap();
            assert_eq!((m.dtype(), v.dtype()), (DType::F32, DType::F32));
            // The parameter is the master rounded to bf16, and the master holds more than bf16 does.
            let rounded = master.to_dtype(DType::BF16)?;
            let diff = (rounded.to_dtype(DType::F32)? - w.to_dtype(DType::F32)?)?.abs()?.max_all()?;
            assert_eq!(diff.to_scalar::<f32>()?, 0.0, "{}", p.name());
            let lost = (rounded.to_dtype(DType::F32)? - master)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(lost > 0.0, "{}: the master should hold bits bf16 cannot", p.name());
        }
        Ok::<_, CompileError>(())
    });
    out.into_iter().next().unwrap().unwrap().unwrap();
}

/// Measured `(after forward, peak)` tape bytes of one step and the plan's predictions `(after forward, peak)`
/// at `n` tokens on one rank, for a model with a realistic head size (64: 2 heads, 1 kv head, hidden 128).
fn tape_bytes(dtype: DType, policy: CheckpointPolicy, n: usize) -> [f64; 4] {
    let out = run_ranks(1, std::time::Duration::from_secs(60), move |pg| {
        let spec = TinySpec { hidden: 128, intermediate: 256, heads: 2, kv_heads: 1, ..TinySpec::default() };
        let model = in_dtype(weights_of(spec), dtype);
        let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(policy)).with_dtype(dtype);
        let mut c = compile(model, cfg)?;
        let plan = c.plan(n)?;
        let step = c.train_step(&ids(0, n), None)?;
        Ok::<_, CompileError>([
            step.after_forward.held_bytes as f64,
            step.peak_bytes as f64,
            plan.predicted_after_forward,
            plan.predicted_peak,
        ])
    });
    out.into_iter().next().unwrap().unwrap().unwrap()
}

#[test]
fn bf16_halves_the_tape_and_the_plan_says_so() {
    let n = 1024;
    for policy in POLICIES {
        let (a, b) = (tape_bytes(DType::F32, policy, n), tape_bytes(DType::BF16, policy, n));
        for (i, what) in
            ["measured after forward", "measured peak", "predicted after forward", "predicted peak"].iter().enumerate()
        {
            let ratio = b[i] / a[i];
            eprintln!("{policy:?} {what}: bf16 {} / f32 {} = {ratio:.4}", b[i], a[i]);
            // Everything the tape holds is bf16 but the attention LSE (f32, one value per head and token: 4
            // bytes per 64 elements of attention output), the norms' and the loss's statistics and the u32
            // ids: half, within the 5%. The f32 run's tape also holds the loss's gradients from the
            // end of the forward to the start of the backward (the CPU loss computes them in its own pass in
            // f32; bf16 recomputes them in backward): `d_hidden: [n, hidden]` and `d_lm_head: [vocab,
            // hidden]` in f32, which lowers the ratio after the forward (measured 0.40 - 0.48; the peaks, reached
            // later, stay at 0.49 - 0.50) and never raises it.
            assert!((0.35..=0.525).contains(&ratio), "{policy:?} {what}: bf16 / f32 = {ratio}");
        }
    }
}

#[test]
fn plan_counts_bf16_attention_traffic_at_two_bytes_and_gradients_at_four() {
    let n = 256;
    let plans = |dtype: DType, s: Strategy| {
        let out = run_ranks(2, std::time::Duration::from_secs(60), move |pg| {
            let mut c = compiled(pg, dtype, s, CheckpointPolicy::None)?;
            let params: usize = c.params().iter().map(|p| p.tensor().elem_count()).sum();
            let plan = c.plan(n)?;
            Ok::<_, CompileError>((plan.attention_comm_bytes, plan.comm_bytes, params))
        });
        out.into_iter().next().unwrap().unwrap().unwrap()
    };
    for s in [Strategy::Ulysses, Strategy::Ring] {
        let ((attn_f32, f, params), (attn_bf16, h, _)) = (plans(DType::F32, s), plans(DType::BF16, s));
        // The gradient all-reduce is f32 in both: ring all-reduce sends 2 (P - 1) / P of the gradients; the
        // loss's two one-element f64 all-reduces send 8 bytes each from rank 0 at P = 2.
        let grads = 2.0 * 0.5 * params as f64 * 4.0 + 16.0;
        assert_eq!(f - attn_f32, grads, "{s:?} f32");
        assert_eq!(h - attn_bf16, grads, "{s:?} bf16");
        assert!(attn_f32 > 0.0 && attn_bf16 > 0.0);
        // Ulysses sends activations (and their gradients) in the compute dtype, half of f32's, and the LSE in
        // f32 both times: under None, forward only, 4 heads x 128 local tokens x (P-1)/P x 4 bytes per layer.
        // Ring's backward also passes f32 dK/dV accumulators, P = 2 passes of blocks as large as its one
        // forward and one backward k/v pass: (2 + 2 + 2·4) / (4 + 4 + 2·4) = 3/4.
        let want = if s == Strategy::Ring {
            0.75 * attn_f32
        } else {
            let lse = 2.0 * (4.0 * 128.0 * 0.5 * 4.0);
            (attn_f32 - lse) / 2.0 + lse
        };
        assert!((attn_bf16 - want).abs() < 1e-9 * want, "{s:?}: bf16 attention traffic {attn_bf16}, expected {want}");
    }
}

/// The bf16 training state a checkpoint holds, through safetensors as the example writes it.
struct Saved {
    params: HashMap<String, Tensor>,
    masters: HashMap<String, Tensor>,
    moments: HashMap<String, Tensor>,
    step: u64,
}

fn save(dir: &std::path::Path, params: &[Param], opt: &AdamW, with_masters: bool) -> Saved {
    let mut p = HashMap::new();
    let mut masters = HashMap::new();
    let mut moments = HashMap::new();
    for x in params {
        p.insert(x.name().to_string(), x.tensor());
        if with_masters {
            masters.insert(x.name().to_string(), opt.master(x).unwrap().clone());
        }
        let (m, v) = opt.moments(x).unwrap();
        moments.insert(format!("{}.exp_avg", x.name()), m.clone());
        moments.insert(format!("{}.exp_avg_sq", x.name()), v.clone());
    }
    let load = |name: &str, t: &HashMap<String, Tensor>| {
        let f = dir.join(name);
        candle_core::safetensors::save(t, &f).unwrap();
        candle_core::safetensors::load(&f, &Device::Cpu).unwrap()
    };
    Saved {
        params: load("params.safetensors", &p),
        masters: if with_masters { load("masters.safetensors", &masters) } else { HashMap::new() },
        moments: load("moments.safetensors", &moments),
        step: opt.steps(),
    }
}

/// The parameters and masters (f32 bits) after `steps` bf16 steps, or after stopping at `resume_at`, saving
/// (with or without the masters), and continuing in a fresh model and optimiser.
fn run_bf16(steps: usize, resume_at: Option<(usize, bool)>) -> Vec<Vec<u32>> {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let out = run_ranks(1, std::time::Duration::from_secs(60), move |pg| {
        let mut c = compiled(pg.clone(), DType::BF16, Strategy::Auto, CheckpointPolicy::SequenceAware)?;
        let mut params = c.params();
        let mut opt = optimizer(&params);
        for s in 0..steps {
            if let Some((at, with_masters)) = resume_at {
                if s == at {
                    let saved = save(&dir, &params, &opt, with_masters);
                    drop((c, opt));
                    // A fresh model from the saved bf16 parameters, a fresh optimiser from the saved state.
                    let (cfg, _) = weights();
                    let model = LlamaModel::from_weights(&cfg, saved.params.clone()).unwrap();
                    c = compile(
                        model,
                        CompileConfig::new(
                            pg.clone(),
                            Strategy::Auto,
                            Checkpointing::Policy(CheckpointPolicy::SequenceAware),
                        )
                        .with_dtype(DType::BF16),
                    )?;
                    params = c.params();
                    opt = AdamW::new(AdamWConfig::default())?;
                    for p in &params {
                        let m = saved.moments[&format!("{}.exp_avg", p.name())].clone();
                        let v = saved.moments[&format!("{}.exp_avg_sq", p.name())].clone();
                        opt.set_state(saved.step, p, m, v)?;
                        if let Some(master) = saved.masters.get(p.name()) {
                            opt.set_master(p, master)?;
                        }
                    }
                }
            }
            let out = c.train_step(&ids(s, 48), None)?;
            opt.step(&params, &out.grads, 1e-2)?;
        }
        let mut out = Vec::new();
        for p in &params {
            out.push(common::bits(&p.tensor()));
            out.push(common::bits(opt.master(p).unwrap()));
        }
        Ok::<_, CompileError>(out)
    });
    out.into_iter().next().unwrap().unwrap().unwrap()
}

#[test]
fn resuming_a_bf16_run_from_its_master_weights_is_bit_exact() {
    let straight = run_bf16(4, None);
    assert!(run_bf16(4, Some((2, true))) == straight, "4 steps != 2 steps + resume with masters + 2 steps");
    // Without the masters the resumed run starts its masters from the bf16 parameters: it must differ
    // (this is what the masters in the checkpoint are for, and shows the comparison can fail).
    assert!(run_bf16(4, Some((2, false))) != straight, "resuming without the masters should lose their bits");
}
