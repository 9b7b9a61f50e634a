//! Decode speed against its memory-bandwidth bound: `Compiled::generate` on random weights of a preset shape
//! (SmolLM2-135M's by default), one JSON line per prompt length with the decode tokens/s and the bound a token
//! cannot beat on this machine: it reads every weight once (the tied LM head included; an untied embedding
//! only its one row) and every cached key and value once, so `bound = read bandwidth / (weight bytes + cache
//! bytes)`. The read bandwidth is measured in the same run (a sum over a 1 GiB buffer, on one thread and on
//! `--threads` threads, best of 3), and the line carries `/proc/loadavg` before and after.
//!
//! With `--attention-only`, only the decode attention of one token over every layer's cache of random rows
//! (no prefill): the CPU kernel against the tensor-op path it replaced, in turn in one run, as a ratio.
//!
//! With `--profile`, the decode forwards of rank 0 are timed per op (`autosp::core::profile`): the linear
//! layers by weight shape, the LM head, the decode attention, and what is left (per-token overheads).
//!
//! `cargo run --release --example bench_decode -- --lengths 4096,16384 --new 32 --threads 2 --profile`

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp::core::comm::run_ranks;
use autosp::core::module::all_params;
use autosp::core::CheckpointPolicy;
use autosp::infer::{GenerateConfig, Sampling};
use autosp::models::{random_weights, LlamaConfig, LlamaModel};
use candle_core::{DType, Device};
use clap::Parser;
use serde_json::json;

#[path = "common/measure.rs"]
mod measure;
#[path = "common/presets.rs"]
mod presets;

use measure::{loadavg, median};

#[derive(Parser, Debug)]
#[command(about = "decode tokens/s against the bound of reading the weights and the KV cache once per token")]
struct Args {
    /// Model shape: `smollm2-135m` (30 layers, hidden 576, 9 heads, 3 kv heads, vocab 49152, tied), `tiny`,
    /// `bench` or `llama-3.2-1b` (the benches' presets: examples/common/presets.rs).
    #[arg(long, default_value = "smollm2-135m")]
    preset: String,
    /// Prompt lengths (the cache a decode step reads), comma-separated.
    #[arg(long, default_value = "4096,16384")]
    lengths: String,
    /// New tokens per length (the first comes from the prefill; the rest are timed).
    #[arg(long, default_value_t = 32)]
    new: usize,
    /// Thread ranks of the sequence-parallel group (the cache split among them).
    #[arg(long, default_value_t = 1)]
    sp: usize,
    /// Weight and cache dtype: f32 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Threads for candle's CPU ops and the bandwidth measure (RAYON_NUM_THREADS); default: all cores.
    #[arg(long)]
    threads: Option<usize>,
    /// Time the decode forwards of rank 0 per op and print the totals in the line.
    #[arg(long)]
    profile: bool,
    /// Time only the decode attention of one token over every layer's cache (random rows, no prefill), the
    /// CPU kernel and the tensor-op path (the generic route) in turn, `--repeats` rounds each: one line per
    /// length with both times and their ratio.
    #[arg(long)]
    attention_only: bool,
    /// Rounds of `--attention-only`.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

/// `--attention-only`: the decode attention of one query over `layers` caches of `n` random rows each (the
/// preset's heads and dtype), kernel and tensor ops in turn; the medians of `repeats` rounds.
fn attention_only(
    cfg: &LlamaConfig,
    dtype: DType,
    n: usize,
    repeats: usize,
    bandwidth: f64,
) -> Result<serde_json::Value> {
    use autosp::core::dispatch::{with_kernels, Kernels};
    use autosp::kernels::attention::{attention_over_blocks, KvBlocks};
    use candle_core::Tensor;
    let (h, hkv, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1., (1, 1, h, d), &dev)?.to_dtype(dtype)?;
    let mut parts = Vec::with_capacity(cfg.num_hidden_layers);
    for _ in 0..cfg.num_hidden_layers {
        let mut part = KvBlocks::default();
        let k = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?.to_dtype(dtype)?;
        let v = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?.to_dtype(dtype)?;
        part.push_rows(&k, &v, &(0..n).collect::<Vec<_>>())?;
        parts.push(part);
    }
    let time = |k: Kernels| -> Result<f64> {
        let t0 = Instant::now();
        with_kernels(k, || -> Result<()> {
            for part in &parts {
                attention_over_blocks(&q, part, None, 0)?;
            }
            Ok(())
        })?;
        Ok(t0.elapsed().as_secs_f64())
    };
    let (mut kernel, mut ops) = (Vec::new(), Vec::new());
    for _ in 0..repeats.max(1) {
        kernel.push(time(Kernels::Auto)?);
        ops.push(time(Kernels::Generic)?);
    }
    let (kernel, ops) = (median(kernel), median(ops));
    let bytes = cfg.num_hidden_layers * 2 * n * hkv * d * dtype.size_in_bytes();
    Ok(json!({
        "bench": "decode_attention",
        "prompt_tokens": n,
        "layers": cfg.num_hidden_layers,
        "cache_bytes": bytes,
        "kernel_seconds": kernel,
        "tensor_ops_seconds": ops,
        "speedup": ops / kernel,
        "kernel_bytes_per_s": bytes as f64 / kernel,
        "tensor_ops_bytes_per_s": bytes as f64 / ops,
        "read_bandwidth": bandwidth,
    }))
}

/// Bytes per second of reading `buf` once on `threads` threads (a sum, so nothing is skipped), best of 3.
fn read_bandwidth(buf: &[f32], threads: usize) -> f64 {
    let mut best = 0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        let chunk = buf.len().div_ceil(threads);
        let total: f32 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(chunk)
                .map(|c| {
                    s.spawn(move || {
                        // Eight partial sums, so the adds vectorise and the loop is bound by the reads.
                        let mut acc = [0f32; 8];
                        for w in c.chunks_exact(8) {
                            for i in 0..8 {
                                acc[i] += w[i];
                            }
                        }
                        acc.iter().sum::<f32>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        std::hint::black_box(total);
        best = best.max(std::mem::size_of_val(buf) as f64 / t0.elapsed().as_secs_f64());
    }
    best
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(t) = args.threads {
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
    }
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        d => bail!("--dtype {d}: use f32 or bf16"),
    };
    let lengths: Vec<usize> = args
        .lengths
        .split(',')
        .map(|s| s.trim().parse().map_err(|_| anyhow!("--lengths {s:?}: give whole numbers, e.g. 4096,16384")))
        .collect::<Result<_>>()?;
    let max_n = lengths.iter().max().copied().unwrap_or(0) + args.new;
    let cfg = presets::preset_config(&args.preset, max_n)?;
    let buf = vec![1f32; 1 << 28];
    let (bw1, bwt) = (read_bandwidth(&buf, 1), read_bandwidth(&buf, threads));
    drop(buf);
    if args.attention_only {
        for &n in &lengths {
            let mut line = attention_only(&cfg, dtype, n, args.repeats, bwt.max(bw1))?;
            line["dtype"] = json!(args.dtype);
            line["threads"] = json!(threads);
            line["loadavg"] = json!(loadavg());
            println!("{line}");
        }
        return Ok(());
    }
    let model = LlamaModel::from_weights(&cfg, random_weights(&cfg, 7, dtype, &Device::Cpu)?)?;
    // A token reads every weight but the embedding once (all of it when the LM head is tied to it), and one
    // embedding row.
    let embed_bytes = cfg.vocab_size * cfg.hidden_size * dtype.size_in_bytes();
    let all: usize = all_params(&model).iter().map(|p| p.tensor().elem_count() * dtype.size_in_bytes()).sum();
    let weight_bytes = if cfg.tie_word_embeddings { all } else { all - embed_bytes + embed_bytes / cfg.vocab_size };
    let cache_bytes_per_row =
        cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype.size_in_bytes();
    for &n in &lengths {
        let prompt: Vec<u32> = (0..n as u64).map(|i| ((i * 2654435761) % cfg.vocab_size as u64) as u32).collect();
        let gen = GenerateConfig {
            max_new_tokens: args.new,
            sampling: Sampling::Greedy,
            seed: 0,
            stop_tokens: Some(Vec::new()),
        };
        let load_before = loadavg();
        let profile = args.profile;
        let runs = run_ranks(args.sp, Duration::from_secs(3600), |pg| -> Result<_, String> {
            let on = profile && pg.rank() == 0;
            let c = compile(
                model.clone(),
                CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None)),
            )
            .map_err(|e| e.to_string())?;
            let out = c
                .generate_streaming(&prompt, &gen, |e| {
                    if on && e.index == 0 {
                        autosp::core::profile::start();
                    }
                    true
                })
                .map_err(|e| e.to_string())?;
            let prof = if on { autosp::core::profile::finish() } else { None };
            Ok((out, prof))
        });
        let (out, prof) = runs
            .into_iter()
            .next()
            .ok_or_else(|| anyhow!("no rank ran"))?
            .map_err(|e| anyhow!("rank 0 panicked: {e:?}"))?
            .map_err(|e| anyhow!("{e}"))?;
        let s = &out.stats;
        // The cache a decode step reads on average: the prompt and half the new tokens.
        let rows = n + args.new / 2;
        let bytes = weight_bytes + rows * cache_bytes_per_row;
        let ops: Vec<_> = prof
            .iter()
            .flatten()
            .map(|((pass, op, detail), t)| {
                json!({"pass": pass, "op": op, "detail": detail, "seconds": t.seconds, "calls": t.calls})
            })
            .collect();
        let line = json!({
            "bench": "decode",
            "preset": args.preset,
            "dtype": args.dtype,
            "sp": args.sp,
            "threads": threads,
            "prompt_tokens": n,
            "new_tokens": s.new_tokens,
            "prefill_tokens_per_s": s.prefill_tokens_per_s,
            "decode_tokens_per_s": s.decode_tokens_per_s,
            "decode_seconds": s.decode_seconds,
            "weight_bytes": weight_bytes,
            "cache_bytes_per_token": rows * cache_bytes_per_row,
            "read_bandwidth_1_thread": bw1,
            "read_bandwidth_threads": bwt,
            "bound_tokens_per_s": bwt.max(bw1) / bytes as f64,
            "fraction_of_bound": s.decode_tokens_per_s / (bwt.max(bw1) / bytes as f64),
            "kv_cache_bytes_per_rank": s.kv_cache_bytes,
            "simd": autosp::core::simd::simd_path().name(),
            "matmul_kernels": autosp::cpu_matmul::kernels(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "profile": ops,
        });
        println!("{line}");
    }
    Ok(())
}
