//! Per-tensor gradients of one training step on a device against the CPU: the `bench` model shape (vocab 32000,
//! hidden 512, intermediate 1376, 4 layers, 8 heads, 4 kv heads; bench_memory's `--preset bench`) with the
//! same random weights everywhere, one sequence of N tokens, one rank.
//!
//! For each `--n` and `--dtype`: the reference is the CPU in f32 with the device-generic kernels forced
//! (`autosp_core::dispatch`, the kernels a GPU runs, so that a difference is the device's arithmetic, not
//! another algorithm), on the weights rounded to the dtype (so bf16's weight rounding is not counted as an
//! error); the run under test is `--device` in the dtype, its kernels chosen as in training (on the CPU the
//! fast CPU kernels: a CPU dry run of gpu_check compares those against the generic ones). Each gradient's
//! error is its largest element difference relative to the reference gradient's largest magnitude (as
//! scripts/compare_safetensors.py and the Rust gradient tests judge them); a dtype passes when every tensor is
//! within its tolerance (`--rtol-f32`, `--rtol-bf16`, `--rtol-f16`).
//!
//! `cargo run --release --features cuda --example grad_compare -- --device cuda --n 2048,4096 --dtype f32,bf16`
//!
//! Prints one JSON line per (N, dtype) (`"bench":"grad_compare"`: the loss of both runs, every tensor's
//! error, the worst one, pass) and exits 1 when any fails.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp::core::comm::{run_ranks, ProcessGroup};
use autosp::core::dispatch::{with_kernels, Kernels};
use autosp::core::CheckpointPolicy;
use autosp::models::{random_weights, LlamaConfig, LlamaModel};
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[allow(dead_code)]
#[path = "common/presets.rs"]
mod presets;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "Per-tensor gradients of one bench-preset training step on a device against the CPU's")]
struct Args {
    /// The device under test: cuda, cuda:N, or cpu (a dry run: the fast CPU kernels against the generic ones).
    #[arg(long, default_value = "cuda")]
    device: autosp::DeviceSpec,
    /// Sequence lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    n: Vec<usize>,
    /// Dtypes of the run under test, comma separated (f32, bf16, f16).
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    dtype: Vec<String>,
    /// Layers of the bench shape (4 by default; fewer for a quick check).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Tolerance of f32 runs (largest difference relative to the tensor's largest magnitude).
    #[arg(long, default_value_t = 1e-4)]
    rtol_f32: f64,
    /// Tolerance of bf16 runs.
    #[arg(long, default_value_t = 3e-2)]
    rtol_bf16: f64,
    /// Tolerance of f16 runs.
    #[arg(long, default_value_t = 1e-2)]
    rtol_f16: f64,
    /// Checkpointing of both runs: none, full or sequence-aware (the training default).
    #[arg(long, default_value = "sequence-aware")]
    checkpoint: String,
}

const TIMEOUT: Duration = Duration::from_secs(600);

/// The `bench` preset (examples/common/presets.rs) with `layers` layers and room for `n` positions.
fn bench_config(layers: usize, n: usize) -> Result<LlamaConfig> {
    let mut cfg = presets::preset_config("bench", n)?;
    cfg.num_hidden_layers = layers;
    Ok(cfg)
}

fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => bail!("--dtype {s:?}: use f32, bf16 or f16"),
    })
}

fn checkpointing(s: &str) -> Result<Checkpointing> {
    Ok(Checkpointing::Policy(match s {
        "none" => CheckpointPolicy::None,
        "full" => CheckpointPolicy::Full,
        "sequence-aware" => CheckpointPolicy::SequenceAware,
        _ => bail!("--checkpoint {s:?}: use none, full or sequence-aware"),
    }))
}

/// One step's loss, its gradients by parameter name (f32, on the CPU), and its wall time (seconds).
struct Step {
    loss: f64,
    grads: BTreeMap<String, Tensor>,
    seconds: f64,
}

/// One training step of the bench shape on `device`: weights `weights` (CPU, f32, already rounded as wanted)
/// cast to `dtype`, the ids `ids` (`[1, n]` u32); the kernels `kernels` on this rank's thread.
fn step(
    cfg: &LlamaConfig,
    weights: &std::collections::HashMap<String, Tensor>,
    ids: &Tensor,
    dtype: DType,
    device: &Device,
    kernels: Kernels,
    checkpoint: &str,
) -> Result<Step> {
    let run = |pg: Arc<dyn ProcessGroup>| -> Result<Step> {
        with_kernels(kernels, || {
            let on_device = weights
                .iter()
                .map(|(k, w)| Ok((k.clone(), w.to_dtype(dtype)?.to_device(device)?)))
                .collect::<Result<_>>()?;
            let model = LlamaModel::from_weights(cfg, on_device)?;
            let mut c = CompileConfig::new(pg, Strategy::Auto, checkpointing(checkpoint)?);
            c.seq_len = Some(ids.dims()[1]);
            c.dtype = dtype;
            let compiled = compile(model, c)?;
            let t0 = Instant::now();
            let out = compiled.train_step(ids, None)?;
            let mut grads = BTreeMap::new();
            for p in compiled.params() {
                if let Some(g) = out.grads.get(&p) {
                    grads.insert(p.name().to_string(), g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
                }
            }
            Ok(Step { loss: out.loss, grads, seconds: t0.elapsed().as_secs_f64() })
        })
    };
    run_ranks(1, TIMEOUT, run).pop().ok_or_else(|| anyhow!("no rank ran"))?.map_err(|e| anyhow!("rank failed: {e}"))?
}

/// Largest |a - b| over the largest |a| (0 when both are zero).
fn relative_error(reference: &Tensor, other: &Tensor) -> Result<f64> {
    let scale = reference.abs()?.max_all()?.to_scalar::<f32>()? as f64;
    let diff = (reference - other)?.abs()?.max_all()?.to_scalar::<f32>()? as f64;
    Ok(if scale > 0.0 { diff / scale } else { diff })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = args.device.open(None)?;
    let mut failed = Vec::new();
    for &n in &args.n {
        let cfg = bench_config(args.layers, n)?;
        let weights = random_weights(&cfg, 1234, DType::F32, &Device::Cpu)?;
        let vocab = cfg.vocab_size as u32;
        let ids: Vec<u32> = (0..n as u32).map(|i| (i.wrapping_mul(2654435761) >> 7) % vocab).collect();
        let ids = Tensor::from_vec(ids, (1, n), &Device::Cpu)?;
        for name in &args.dtype {
            let dtype = parse_dtype(name)?;
            let rtol = match dtype {
                DType::BF16 => args.rtol_bf16,
                DType::F16 => args.rtol_f16,
                _ => args.rtol_f32,
            };
            // The weights rounded to the dtype, held in f32 for the reference.
            let rounded = weights
                .iter()
                .map(|(k, w)| Ok((k.clone(), w.to_dtype(dtype)?.to_dtype(DType::F32)?)))
                .collect::<Result<std::collections::HashMap<_, _>>>()?;
            let reference = step(&cfg, &rounded, &ids, DType::F32, &Device::Cpu, Kernels::Generic, &args.checkpoint)?;
            let under_test = step(&cfg, &rounded, &ids, dtype, &device, Kernels::Auto, &args.checkpoint)?;
            if reference.grads.keys().ne(under_test.grads.keys()) {
                bail!("the two runs have gradients for different parameters");
            }
            let mut errors = BTreeMap::new();
            for (k, g) in &reference.grads {
                errors.insert(k.clone(), relative_error(g, &under_test.grads[k])?);
            }
            let (worst, worst_rel) =
                errors.iter().max_by(|a, b| a.1.total_cmp(b.1)).map(|(k, &v)| (k.clone(), v)).unwrap_or_default();
            let loss_rel = (under_test.loss - reference.loss).abs() / reference.loss.abs();
            let pass = worst_rel <= rtol && loss_rel <= rtol && errors.values().all(|e| e.is_finite());
            if !pass {
                failed.push(format!("n {n} {name}: {worst} off by {worst_rel:.2e} (tolerance {rtol:e})"));
            }
            println!(
                "{}",
                json!({
                    "bench": "grad_compare", "n": n, "dtype": name, "device": args.device.to_string(),
                    "layers": args.layers, "checkpoint": args.checkpoint,
                    "reference": "cpu f32, generic kernels, weights rounded to the dtype",
                    "loss_reference": reference.loss, "loss": under_test.loss, "loss_rel": loss_rel,
                    "tensors": errors.len(), "worst": worst, "worst_rel": worst_rel, "rtol": rtol, "pass": pass,
                    "seconds_reference": reference.seconds, "seconds": under_test.seconds,
                    "per_tensor": errors,
                })
            );
        }
    }
    if !failed.is_empty() {
        bail!("gradients out of tolerance: {}", failed.join("; "));
    }
    Ok(())
}
