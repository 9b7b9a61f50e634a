//! The embedding's backward: the old `index_add` into a zero-filled accumulation table
//! (`ops::embedding::index_add_reference`) against the row-sum kernel the op runs now
//! (`ops::embedding::embedding_backward`). Prints one JSON line per (shape, dtype, variant, round) with the
//! seconds of the call (median of `--repeats`), the heap bytes it allocated and its large allocations (the
//! tracking allocator), and whether the two results are bit for bit equal. Variants alternate within a round.
//!
//! `cargo run --release --example bench_embedding -- --tables 32000x512,49152x576 --n 8192 --dtype f32,bf16`
//!
//! Token ids are skewed as text is (id = vocab * u^3, u uniform): frequent ids repeat, most rows are never
//! touched. `AUTOSP_KERNELS=generic` times the device-generic kernel (a one-hot GEMM) on the CPU.

use std::time::Instant;

use autosp::core::gradcheck::probe;
use autosp::core::ops::embedding::{embedding_backward, index_add_reference};
use autosp::core::TrackingAllocator;
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[global_allocator]
static ALLOC: TrackingAllocator = TrackingAllocator::new();

#[derive(Parser, Debug)]
#[command(about = "The embedding's backward: index_add into zeros against the row-sum kernel")]
struct Args {
    /// Tables as VOCABxHIDDEN, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "32000x512,49152x576")]
    tables: Vec<String>,
    /// Tokens per call.
    #[arg(long, default_value_t = 8192)]
    n: usize,
    /// Dtypes of the gradient (and table): f32, bf16, f16, f64; comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "f32,bf16")]
    dtype: Vec<DType>,
    /// Timed calls per variant and round (the median is reported), after one untimed call.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Rounds; each runs every variant in turn.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
}

/// The load average, as /proc/loadavg gives it.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.trim().to_string()).unwrap_or_default()
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let dev = Device::Cpu;
    for table in &a.tables {
        let (vocab, hidden) = table
            .split_once('x')
            .and_then(|(v, h)| Some((v.parse::<usize>().ok()?, h.parse::<usize>().ok()?)))
            .ok_or_else(|| anyhow::anyhow!("--tables {table:?}: give VOCABxHIDDEN, e.g. 32000x512"))?;
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let ids: Vec<u32> = (0..a.n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                ((vocab as f64 * u * u * u) as usize).min(vocab - 1) as u32
            })
            .collect();
        let distinct = {
            let mut s = ids.clone();
            s.sort_unstable();
            s.dedup();
            s.len()
        };
        let ids = Tensor::from_vec(ids, a.n, &dev)?;
        for &dtype in &a.dtype {
            let g = probe(&[a.n, hidden], 3, &dev)?.to_dtype(dtype)?;
            let old = index_add_reference(&ids, &g, vocab, None)?;
            let new = embedding_backward(&ids, &g, vocab, None)?;
            let equal = old.to_dtype(DType::F64)?.eq(&new.to_dtype(DType::F64)?)?.to_dtype(DType::U32)?;
            let bit_equal = equal.sum_all()?.to_scalar::<u32>()? as usize == vocab * hidden;
            drop((old, new));
            for round in 0..a.rounds {
                for variant in ["index_add", "row_sums"] {
                    let call = || match variant {
                        "index_add" => index_add_reference(&ids, &g, vocab, None),
                        _ => embedding_backward(&ids, &g, vocab, None),
                    };
                    drop(call()?);
                    let mut secs = Vec::with_capacity(a.repeats);
                    let (bytes0, large0) = (ALLOC.allocated_bytes(), ALLOC.large_allocations());
                    for _ in 0..a.repeats {
                        let t0 = Instant::now();
                        let r = call()?;
                        secs.push(t0.elapsed().as_secs_f64());
                        drop(r);
                    }
                    secs.sort_by(f64::total_cmp);
                    let line = serde_json::json!({
                        "bench": "embedding_backward",
                        "variant": variant,
                        "round": round,
                        "vocab": vocab,
                        "hidden": hidden,
                        "n": a.n,
                        "distinct_ids": distinct,
                        "dtype": format!("{dtype:?}").to_lowercase(),
                        "kernels": format!("{:?}", autosp::core::dispatch::kernels()),
                        "median_s": secs[secs.len() / 2],
                        "min_s": secs[0],
                        "allocated_bytes_per_call": (ALLOC.allocated_bytes() - bytes0) / a.repeats,
                        "large_allocations_per_call": (ALLOC.large_allocations() - large0) as f64 / a.repeats as f64,
                        "bit_equal": bit_equal,
                        "loadavg": loadavg(),
                    });
                    println!("{line}");
                }
            }
        }
    }
    Ok(())
}
