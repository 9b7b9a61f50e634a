//! f16 training with dynamic loss scaling, on the CPU (candle's CPU has f16): the scaled step's gradients
//! against f32's where unscaled f16 ones lose their precision near f16's subnormals; `llama_longctx --dtype f16`
//! tracking the f32 run; a scale too large for f16 overflowing, skipping steps and backing off; the scaler's
//! state surviving a resume.

mod common;
mod longctx_cli;

use autosp::compile::{compile, Checkpointing, CompileConfig, CompileError, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::CheckpointPolicy;
use autosp_models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};
use longctx_cli::{losses, metrics_summary, run_ok, s};

/// The gradients (f32, in parameter order) and loss of one step of the tiny model in `dtype` on `n` tokens,
/// the loss scaled by `scale` for backward.
fn step(dtype: DType, n: usize, scale: f64) -> (f64, Vec<Vec<f32>>) {
    let out = run_ranks(1, std::time::Duration::from_secs(120), move |pg| {
        let mut cfg = TinySpec { hidden: 32, intermediate: 64, ..TinySpec::default() }.config();
        cfg.max_position_embeddings = n;
        let w = random_weights(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
        let w = w.into_iter().map(|(k, t)| (k, t.to_dtype(dtype).unwrap())).collect();
        let model = LlamaModel::from_weights(&cfg, w).unwrap();
        let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
        let c = compile(model, CompileConfig::new(pg, Strategy::Auto, policy).with_dtype(dtype))?;
        let ids: Vec<u32> = (0..n).map(|i| ((i * 17 + 5) % 128) as u32).collect();
        let out = c.train_step_scaled(&Tensor::from_vec(ids, (1, n), &Device::Cpu)?, None, scale)?;
        let grads = c
            .params()
            .iter()
            .map(|p| out.grads.get(p).unwrap().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok::<_, CompileError>((out.loss, grads))
    });
    out.into_iter().next().unwrap().unwrap().unwrap()
}

/// `|x - y| / |y|` (L2 norms).
fn norm_rel(x: &[f32], y: &[f32]) -> f64 {
    let d: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let n: f64 = y.iter().map(|b| (*b as f64).powi(2)).sum();
    (d / n.max(1e-300)).sqrt()
}

/// At 16384 tokens each token's share of a gradient is 1/16384 of its own: the logits' gradients of the
/// classes a token does not predict are about 5e-7, and the hidden states' gradients about 1e-5, under f16's
/// smallest normal number (6.1e-5), where f16 keeps only a few bits. Scaled by 2^16 they are normal numbers
/// again. Measured (norm-relative error of the worst parameter, `|g - g32| / |g32|`): 2.0e-3 scaled, 4.1e-3
/// unscaled (at 4096 tokens 1.7e-3 and 1.8e-3: the loss of precision grows with the length). The bars: scaled
/// within 1e-2 (f16's 2^-11 rounding per operation over two layers), and unscaled at least 1.5 times further
/// off than scaled.
#[test]
fn scaled_f16_gradients_keep_the_precision_unscaled_ones_lose() {
    let n = 16384;
    let (loss32, want) = step(DType::F32, n, 1.0);
    let (loss_scaled, scaled) = step(DType::F16, n, 65536.0);
    let (loss_plain, plain) = step(DType::F16, n, 1.0);
    // The loss returned is the unscaled one, and the scale does not change the forward pass.
    assert_eq!(loss_scaled, loss_plain);
    assert!((loss_scaled - loss32).abs() <= 1e-2 * loss32, "loss {loss_scaled} vs f32 {loss32}");
    let worst = |got: &[Vec<f32>]| got.iter().zip(&want).map(|(g, w)| norm_rel(g, w)).fold(0.0, f64::max);
    let (with, without) = (worst(&scaled), worst(&plain));
    eprintln!("f16 gradients vs f32 at {n} tokens: worst norm-relative error {with:.2e} scaled by 2^16, {without:.2e} unscaled");
    assert!(with <= 1e-2, "scaled f16 gradients off by {with:e}");
    assert!(without > 1.5 * with, "unscaled f16 should lose precision: {without:e} vs {with:e} scaled");
}

/// `--dtype f16` (dynamic scaling from 2^16, the default) trains as f32 does: every step's loss within 2% of
/// the f32 run's, no overflow, the scale reported on every step line and in the summary.
#[test]
fn f16_training_tracks_the_f32_run() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |dtype: &str| {
        let m = tmp.path().join(format!("{dtype}.jsonl"));
        let save = tmp.path().join(dtype);
        let out = run_ok(tmp.path(), &["--quick", "--dtype", dtype, "--save", s(&save), "--metrics", s(&m)]);
        (out, m)
    };
    let (_, m32) = run("f32");
    let (out16, m16) = run("f16");
    let (l32, l16) = (losses(&m32), losses(&m16));
    assert_eq!(l32.len(), 12);
    assert_eq!(l16.len(), 12, "every f16 step applied");
    for ((step, a), (_, b)) in l32.iter().zip(&l16) {
        assert!((b - a).abs() <= 0.02 * a, "step {step}: f16 loss {b} vs f32 {a}");
    }
    assert!(out16.contains("loss-scale 65536") && out16.contains("| loss scale (f16)"), "{out16}");
    let summary = metrics_summary(&m16);
    assert_eq!((summary["loss_scale"].as_f64(), summary["overflow_skips"].as_u64()), (Some(65536.0), Some(0)));
    assert!(metrics_summary(&m32)["loss_scale"].is_null(), "f32 runs do not scale");
}

/// Starting at 2^24, f16's gradients overflow: those steps are skipped (no update, a line saying so, the
/// skip in the metrics) and the scale halves until they fit; training goes on and learns.
#[test]
fn an_overflowing_scale_skips_steps_and_backs_off() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m.jsonl");
    let save = tmp.path().join("ck");
    let args = ["--quick", "--steps", "24", "--dtype", "f16", "--loss-scale", "16777216:1000"];
    let out = run_ok(tmp.path(), &[&args[..], &["--save", s(&save), "--metrics", s(&m)]].concat());
    assert!(out.contains("f16 gradients overflowed at loss scale 16777216"), "{out}");
    let summary = metrics_summary(&m);
    let (scale, skips) = (summary["loss_scale"].as_f64().unwrap(), summary["overflow_skips"].as_u64().unwrap());
    assert!(skips >= 1 && scale < 16777216.0, "scale {scale}, {skips} skips");
    assert_eq!(scale, 16777216.0 / 2f64.powi(skips as i32), "each overflow halves the scale once");
    let applied = losses(&m);
    assert_eq!(applied.len() as u64 + skips, 24, "every step is applied or skipped");
    let (first, last) = (applied[0].1, applied[applied.len() - 1].1);
    assert!(last.is_finite() && last < first, "the run goes on learning: {first} -> {last}");
}

/// The scaler's state is in the checkpoint: a run resumed mid-way (the scale having doubled since the start)
/// goes on with the same scales and the same losses, bit for bit, as the run that was not interrupted.
#[test]
fn the_loss_scale_survives_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let base = ["--quick", "--dtype", "f16", "--loss-scale", "1024:2"];
    let (a, b, ma, mb) = (t.join("a"), t.join("b"), t.join("a.jsonl"), t.join("b.jsonl"));
    run_ok(t, &[&base[..], &["--save", s(&a), "--save-every", "6", "--metrics", s(&ma)]].concat());
    let out =
        run_ok(t, &[&base[..], &["--resume", s(&a.join("step-6")), "--save", s(&b), "--metrics", s(&mb)]].concat());
    assert!(out.contains("resumed from"), "{out}");
    let steps = |m: &std::path::Path| -> Vec<(u64, f64, f64)> {
        std::fs::read_to_string(m)
            .unwrap()
            .lines()
            .filter_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                Some((v["step"].as_u64()?, v.get("loss")?.as_f64()?, v.get("loss_scale")?.as_f64()?))
            })
            .collect()
    };
    let (whole, resumed) = (steps(&ma), steps(&mb));
    assert_eq!(whole.len(), 12);
    assert_eq!(whole[6..], resumed[..], "the resumed steps' losses and scales must be the uninterrupted run's");
    assert!(whole[5].2 > 1024.0, "the scale must have grown by step 6 for the test to mean anything: {whole:?}");
}
