//! Chunked linear + cross-entropy vs `linear` + `cross_entropy` on the tape: prints one JSON line per variant
//! with the bytes the tape holds after forward, the tape's peak, the process heap peak, and the time of
//! forward + backward. Run once at the full size: the unchunked loss holds an `[n, vocab]` f32 logits tensor.
//!
//! `cargo run --release --example bench_loss -- --n 16384 --vocab 32000 --hidden 512 --chunk 1024`
//!
//! `--dtype bf16` (or f16) runs hidden and head in that dtype; `AUTOSP_KERNELS=generic` times the
//! device-generic kernel on the CPU.

use std::time::Instant;

use autosp::core::gradcheck::probe;
use autosp::core::{ops, CheckpointPolicy, Param, Tape, TrackingAllocator};
use autosp::kernels::chunked_cross_entropy;
use candle_core::{DType, Tensor};
use clap::Parser;

#[global_allocator]
static ALLOC: TrackingAllocator = TrackingAllocator::new();

#[derive(Parser, Debug)]
#[command(about = "Chunked vs unchunked linear + cross-entropy: tape bytes and time")]
struct Args {
    /// Tokens (rows of the hidden states).
    #[arg(long, default_value_t = 16384)]
    n: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    vocab: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Rows per chunk of the chunked loss (a comma-separated list runs each).
    #[arg(long, value_delimiter = ',', default_value = "1024")]
    chunk: Vec<usize>,
    /// Skip the unchunked baseline (it holds n * vocab * 4 bytes of logits).
    #[arg(long)]
    no_baseline: bool,
    /// cpu | cuda | cuda:N | metal (default: the first CUDA device when built with `cuda` and one exists,
    /// else the CPU).
    #[arg(long)]
    device: Option<autosp::DeviceSpec>,
    /// The dtype of hidden and head: f32, bf16, f16 or f64 (the loss is f32, f64 for f64).
    #[arg(long, default_value = "f32")]
    dtype: DType,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let dev = a.device.unwrap_or_else(autosp::DeviceSpec::default_for_build).open(None)?;
    let hidden = probe(&[a.n, a.hidden], 1, &dev)?.to_dtype(a.dtype)?;
    let w = Param::new("lm_head", (probe(&[a.vocab, a.hidden], 2, &dev)? * 0.05)?.to_dtype(a.dtype)?);
    let tg: Vec<i64> = (0..a.n).map(|i| if i % 97 == 0 { -100 } else { ((i * 7919) % a.vocab) as i64 }).collect();
    let tg = Tensor::new(tg, &dev)?;
    let mut variants: Vec<Option<usize>> = a.chunk.iter().map(|&c| Some(c)).collect();
    if !a.no_baseline {
        variants.push(None);
    }
    for chunk in variants {
        let tape = Tape::new(CheckpointPolicy::None);
        ALLOC.reset_peak();
        let base = ALLOC.live_bytes();
        let t0 = Instant::now();
        let (h, wv, t) = (tape.leaf(hidden.clone()), tape.param(&w)?, tape.constant(tg.clone()));
        let (loss, count) = match chunk {
            Some(c) => chunked_cross_entropy(&tape, &h, &wv, &t, c)?,
            None => ops::cross_entropy(&tape, &ops::linear(&tape, &h, &wv, None)?, &t)?,
        };
        let fwd_s = t0.elapsed().as_secs_f64();
        let held_after_forward = tape.memory().held_bytes;
        tape.backward(&loss)?;
        let fwd_bwd_s = t0.elapsed().as_secs_f64();
        let peak = tape.memory().peak_bytes;
        let loss_value = loss.tensor().to_dtype(DType::F64)?.to_scalar::<f64>()? / count as f64;
        let line = serde_json::json!({
            "bench": "loss",
            "variant": if chunk.is_some() { "chunked" } else { "unchunked" },
            "n": a.n, "vocab": a.vocab, "hidden": a.hidden, "chunk": chunk, "dtype": format!("{:?}", a.dtype),
            "kernels": format!("{:?}", autosp::kernels::kernels()),
            "tape_held_after_forward_bytes": held_after_forward,
            "tape_peak_bytes": peak,
            "process_heap_peak_above_start_bytes": ALLOC.peak_bytes().saturating_sub(base),
            "fwd_s": fwd_s,
            "fwd_bwd_s": fwd_bwd_s,
            "mean_loss": loss_value,
            "valid_tokens": count,
        });
        println!("{line}");
    }
    Ok(())
}
