//! Time of building LoRA's dropout masks on the host: one JSON line per shape with the milliseconds of one
//! dropout forward (the mask built a token row at a time over the host's threads, then multiplied in) and the
//! nanoseconds per element, best of `--reps`, beside the mask as it was built before (one element at a time
//! on one thread, indexed by the local element: `mix(mix(seed) ^ i)`) and multiplied in the same way.
//!
//! `cargo run --release --example bench_dropout -- --tokens 2048,8192 --features 2048`

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use autosp::core::rng::SplitMix64;
use autosp::core::{ops, CheckpointPolicy, Tape, TokenCoordinates};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "Time of LoRA's dropout masks on the host")]
struct Args {
    /// Tokens of the forward (comma-separated list).
    #[arg(long, value_delimiter = ',', default_value = "2048,8192")]
    tokens: Vec<usize>,
    /// Features per token (the adapted layer's input width).
    #[arg(long, default_value_t = 2048)]
    features: usize,
    /// Repetitions; the best is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for &n in &args.tokens {
        let x = Tensor::ones((1, n, args.features), DType::F32, &Device::Cpu)?;
        let mut best = f64::INFINITY;
        for _ in 0..args.reps {
            let tape = Tape::new(CheckpointPolicy::None);
            let positions = (0..n as u64).collect();
            tape.set_token_coordinates(Some(Arc::new(TokenCoordinates { sequences: vec![0], positions })));
            let v = tape.leaf(x.clone());
            let t = Instant::now();
            let y = ops::dropout(&tape, &v, 0.05, 7, 0)?;
            best = best.min(t.elapsed().as_secs_f64());
            drop(y);
        }
        let elems = n * args.features;
        // Before: one element at a time, one thread.
        let mut before = f64::INFINITY;
        for _ in 0..args.reps {
            let t = Instant::now();
            let (keep, threshold, base) = (1.0 / 0.95f32, (0.05 * (1u64 << 53) as f64) as u64, SplitMix64::at(7, 0));
            let m: Vec<f32> = (0..elems as u64)
                .map(|i| if SplitMix64::at(base ^ i, 0) >> 11 >= threshold { keep } else { 0.0 })
                .collect();
            let y = (&x * Tensor::from_vec(m, x.shape(), &Device::Cpu)?)?;
            before = before.min(t.elapsed().as_secs_f64());
            drop(y);
        }
        println!(
            "{}",
            json!({
                "bench": "dropout_mask", "tokens": n, "features": args.features, "threads": threads,
                "ms": best * 1e3, "ns_per_element": best * 1e9 / elems as f64,
                "before_ms": before * 1e3, "speedup": before / best,
            })
        );
    }
    Ok(())
}
