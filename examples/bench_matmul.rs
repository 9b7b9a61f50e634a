//! candle's matmul (`Tensor::matmul`, the linear layers' and the LM head's product on the CPU) in GFLOP/s:
//! one JSON line per shape with the median time after a warm-up. It shows which micro-kernels candle's `gemm`
//! runs here: the workspace turns on gemm's `x86-v4` feature, so an AVX-512 CPU takes its 512-bit kernels
//! (`"avx512f": true` in the line) and other x86 CPUs its AVX2 ones.
//!
//! `cargo run --release --example bench_matmul -- --shape 2048x2048x2048,8192x2048x512 --threads 2`

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "candle's CPU matmul: GFLOP/s per shape")]
struct Args {
    /// Products `MxNxK` (`[M, K] x [K, N]`), comma-separated.
    #[arg(long, default_value = "2048x2048x2048,8192x2048x512,8192x512x2048")]
    shape: String,
    /// Threads for candle's CPU ops (sets RAYON_NUM_THREADS before anything starts); default: all cores.
    #[arg(long)]
    threads: Option<usize>,
    /// Timed repeats after one warm-up; the median is printed.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Element type: f32 or f64.
    #[arg(long, default_value = "f32")]
    dtype: String,
}

/// `MxNxK` as `(m, n, k)`.
fn parse_shape(s: &str) -> Result<(usize, usize, usize)> {
    let dims: Vec<usize> = s
        .split('x')
        .map(|d| d.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("shape `{s}`: give MxNxK with whole numbers, e.g. 2048x2048x2048"))?;
    match dims[..] {
        [m, n, k] if m > 0 && n > 0 && k > 0 => Ok((m, n, k)),
        _ => bail!("shape `{s}`: give MxNxK with three positive whole numbers, e.g. 2048x2048x2048"),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(t) = args.threads {
        // Read by rayon's global pool (gemm's threads) and candle's thread count when they first start.
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
    }
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "f64" => DType::F64,
        d => bail!("--dtype {d}: candle's CPU matmul is timed in f32 or f64"),
    };
    let shapes: Vec<_> = args.shape.split(',').map(parse_shape).collect::<Result<_>>()?;
    #[cfg(target_arch = "x86_64")]
    let avx512f = Some(std::arch::is_x86_feature_detected!("avx512f"));
    #[cfg(not(target_arch = "x86_64"))]
    let avx512f: Option<bool> = None;
    for (m, n, k) in shapes {
        let a = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?.to_dtype(dtype)?;
        let b = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu)?.to_dtype(dtype)?;
        a.matmul(&b)?;
        let mut times = Vec::with_capacity(args.repeats);
        for _ in 0..args.repeats.max(1) {
            let t = Instant::now();
            a.matmul(&b)?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let s = times[times.len() / 2];
        let line = serde_json::json!({
            "bench": "matmul", "m": m, "n": n, "k": k, "dtype": args.dtype,
            "threads": candle_core::utils::get_num_threads(), "avx512f": avx512f,
            "matmul_kernels": autosp::cpu_matmul::kernels(),
            "s": s, "gflops": 2.0 * (m * n * k) as f64 / s / 1e9, "repeats": times.len(),
        });
        println!("{line}");
    }
    Ok(())
}
