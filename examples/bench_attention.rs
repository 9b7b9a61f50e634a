//! Benchmark of the CPU flash attention (forward, and forward + backward) against the naive attention
//! that materialises the scores, in the same run. Prints one JSON line per sequence length.
//!
//! `--kernel` takes a comma-separated list: `cpu` (the fast CPU kernel), `generic` (the device-generic
//! attention, `autosp_kernels::attention`'s generic kernel, candle tensor ops), `flash-attn` (the inference output,
//! `attention_output`: candle-flash-attn on CUDA in a build with feature `flash-attn` when its kernel
//! takes the inputs, forward only); `both` is `cpu,generic`. With two of them the line adds their ratios
//! (`generic_over_cpu_fwd`, `generic_over_cpu_fwd_bwd`, `generic_over_flash_attn_fwd`: generic time / the
//! other's). `--device cuda` runs everything on the GPU (times after a device synchronize).
//!
//! Memory: `*_fwd_bwd_peak_bytes` is the process heap peak during one forward + backward (the tracking global
//! allocator of `autosp_core::alloc`) above the live bytes before it (inputs excluded), and
//! `scores_bytes_per_head` the size one N × N f32 score matrix would have. `--peak-only` skips the timing and
//! the naive attention and runs each kernel's forward + backward once, for the peak alone (long sequences).
//!
//! FLOP convention (the issue's, PyTorch's usual one): forward = 4 · batch · heads · N² · head_dim, halved
//! when causal; forward + backward = 3.5 × forward. GFLOP/s are these counts over the measured time. Under a
//! sliding window (`--max-distance`) the counts are scaled by `window_pair_fraction`, the fraction of the
//! (query, key) pairs the mask leaves visible that the window keeps.
//!
//! `--max-distance` takes a comma-separated list of windows (`none` for no window): one line per window,
//! and, when `none` comes first, each windowed line adds `{kernel}fwd_over_no_window` and
//! `{kernel}fwd_bwd_over_no_window` (its time / the unwindowed time of the same run).
//!
//! ```text
//! cargo run --release --example bench_attention -- --n 4096,8192 --causal
//! cargo run --release --example bench_attention -- --n 8192 --causal --simd all --naive-max-gib 0
//! cargo run --release --example bench_attention -- --n 8192 --causal --kernel both --naive-max-gib 0
//! cargo run --release --example bench_attention -- --n 16384,65536 --causal --kernel generic --peak-only
//! cargo run --release --example bench_attention -- --n 8192 --causal --max-distance none,2048,512 --naive-max-gib 0
//! ```
//!
//! `fwd_cpu_s` / `fwd_bwd_cpu_s` are the process CPU seconds per call (all threads; Linux only): on a shared
//! machine they show the work done, where the wall times also include waiting for the cores.
//!
//! `--simd avx2,avx512` (or `all`) runs the CPU kernel on each vector path in turn, one line each, with
//! `"simd"` naming the path; without it the line names the path in force (`AUTOSP_SIMD`, else the best).
//!
//! `--sink-norm F` multiplies key 0 of every batch and kv head by F (a high-norm sink key, as the BOS keys of
//! real checkpoints have); the other inputs stay standard normal.
//!
//! `--threads` sets RAYON_NUM_THREADS before anything starts, so both our kernels and candle's CPU ops
//! (which size their pools from that variable) use that many threads.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{bail, Result};
use autosp_core::ops::attention::{naive_attention_backward, naive_attention_forward, AttentionSpec};
use autosp_core::TrackingAllocator;
use autosp_kernels::attention::{generic_backward_with_block, generic_forward_with_block, TileSize};
use autosp_kernels::simd::{self, SimdPath};
use autosp_kernels::{attention_backward, attention_forward, attention_output, with_kernels, Kernels};
use candle_core::{Device, Tensor};
use clap::Parser;

#[global_allocator]
static ALLOC: TrackingAllocator = TrackingAllocator::new();

#[derive(Parser, Debug)]
#[command(about = "CPU flash attention vs naive attention: one JSON line per sequence length")]
struct Args {
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads (default: --heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Head dimensions, comma separated (one line per head dimension and length).
    #[arg(long, value_delimiter = ',', default_value = "64")]
    head_dim: Vec<usize>,
    /// Sequence lengths (queries = keys), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096")]
    n: Vec<usize>,
    #[arg(long)]
    causal: bool,
    /// Sliding windows (`AttentionSpec::max_distance`), comma separated: `none` or a whole number of positions
    /// (one line per window).
    #[arg(long, value_delimiter = ',', default_value = "none", value_parser = parse_window)]
    max_distance: Vec<Option<usize>>,
    /// f32 or bf16 (bf16 computes in f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Threads for rayon (our kernels) and candle's CPU ops; default: all cores.
    #[arg(long)]
    threads: Option<usize>,
    /// Timed repeats after one warm-up run; the median is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Skip the naive attention when its estimated peak memory is above this many GiB.
    #[arg(long, default_value_t = 6.0)]
    naive_max_gib: f64,
    /// CPU vector paths to run, comma-separated (`avx512`, `avx2`, `neon`, `scalar`), each its own JSON
    /// line with `"simd"` naming it; `all` runs every path this CPU has. Default: the path in force
    /// (`AUTOSP_SIMD`, else the best the CPU has).
    #[arg(long)]
    simd: Option<String>,
    /// The flash kernel to time: `cpu` (the fast CPU kernel), `generic` (the device-generic one on the CPU),
    /// or `both` (with their ratios).
    #[arg(long, default_value = "cpu")]
    kernel: String,
    /// Only the heap peak of one forward + backward per kernel: no timing, no naive attention.
    #[arg(long)]
    peak_only: bool,
    /// Query rows per block of the generic kernel, with `KEY_BLOCKS` times as many keys per chunk (default:
    /// the call's own tiles, `TileSize::for_call`, through the door with the generic kernels forced).
    #[arg(long)]
    block: Option<usize>,
    /// cpu | cuda | cuda:N | metal (default: the first CUDA device when built with `cuda` and one exists, else
    /// the CPU).
    #[arg(long)]
    device: Option<autosp::DeviceSpec>,
    /// Scale key 0 of every batch and kv head by this factor: a high-norm "sink" key like the BOS keys of
    /// real checkpoints (the other keys are standard normal, norm about sqrt(head_dim)).
    #[arg(long)]
    sink_norm: Option<f64>,
}

/// Which flash kernel a measurement runs (the generic one with its block size, or its default tiles).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernel {
    Cpu,
    Generic(Option<usize>),
    FlashAttn,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Kernel::Cpu => "flash_attention_cpu",
            Kernel::Generic(_) => "attention_generic",
            Kernel::FlashAttn => "flash_attn_output",
        }
    }

    /// The prefix of this kernel's fields in the JSON line ("" for the CPU kernel: the fields this bench
    /// always printed).
    fn prefix(self) -> &'static str {
        match self {
            Kernel::Cpu => "",
            Kernel::Generic(_) => "generic_",
            Kernel::FlashAttn => "flash_attn_",
        }
    }

    /// The forward; `None` for the output-only kernel.
    fn forward(self, q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<Option<(Tensor, Tensor)>> {
        Ok(match self {
            Kernel::Cpu => Some(attention_forward(q, k, v, spec)?),
            Kernel::Generic(Some(block)) => Some(generic_forward_with_block(q, k, v, spec, block)?),
            Kernel::Generic(None) => Some(with_kernels(Kernels::Generic, || attention_forward(q, k, v, spec))?),
            Kernel::FlashAttn => {
                attention_output(q, k, v, spec)?;
                None
            }
        })
    }

    fn forward_backward(self, q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, spec: &AttentionSpec) -> Result<()> {
        let Some((o, lse)) = self.forward(q, k, v, spec)? else { bail!("{} has no backward", self.name()) };
        match self {
            Kernel::Cpu => attention_backward(q, k, v, &o, &lse, d_o, None, spec)?,
            Kernel::Generic(Some(block)) => generic_backward_with_block(q, k, v, &o, &lse, d_o, None, spec, block)?,
            Kernel::Generic(None) => {
                with_kernels(Kernels::Generic, || attention_backward(q, k, v, &o, &lse, d_o, None, spec))?
            }
            Kernel::FlashAttn => unreachable!("forward returned None"),
        };
        Ok(())
    }
}

/// The heap peak of one run of `f` above the live bytes before it.
fn peak_of(f: impl FnOnce() -> Result<()>) -> Result<usize> {
    let before = ALLOC.live_bytes();
    ALLOC.reset_peak();
    f()?;
    Ok(ALLOC.peak_bytes().saturating_sub(before))
}

/// CPU seconds used by this process so far, all threads (Linux: /proc/self/stat, in clock ticks of 10 ms);
/// None elsewhere. On a shared machine it shows the work done, where wall time also shows the waiting.
fn process_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Median wall time of `repeats` runs of `f` after one warm-up run (each ended by a synchronize of `dev`, so
/// a GPU's queued work is counted), and the mean process CPU time per run.
fn median_time(dev: &Device, repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, Option<f64>)> {
    f()?;
    dev.synchronize()?;
    let mut times = Vec::with_capacity(repeats);
    let cpu0 = process_cpu_s();
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    let cpu = process_cpu_s().zip(cpu0).map(|(b, a)| ((b - a) / times.len() as f64 * 1e3).round() / 1e3);
    times.sort_by(|a, b| a.total_cmp(b));
    Ok((times[times.len() / 2], cpu))
}

/// `none` or a whole number of positions.
fn parse_window(s: &str) -> Result<Option<usize>, String> {
    match s.trim() {
        "none" => Ok(None),
        t => t.parse().map(Some).map_err(|_| format!("`{s}`: give `none` or a whole number of positions, 0 or more")),
    }
}

/// The fraction of the (query, key) pairs of an `n × n` attention under `spec` without its window that the
/// window keeps (1 without a window).
fn window_pair_fraction(n: usize, spec: &AttentionSpec) -> f64 {
    let Some(w) = spec.max_distance else { return 1.0 };
    // Query p sees keys max(p - w, 0) ..= p (causal) or ..= min(p + w, n - 1); without the window 0 ..= p or all.
    let (mut kept, mut all) = (0f64, 0f64);
    for p in 0..n {
        let hi = if spec.causal { p } else { (p + w).min(n - 1) };
        kept += (hi - p.saturating_sub(w) + 1) as f64;
        all += if spec.causal { p + 1 } else { n } as f64;
    }
    kept / all
}

/// A run's (head_dim, n, kernel prefix, vector path).
type RunKey = (usize, usize, &'static str, SimdPath);

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(t) = args.threads {
        // Read by rayon's global pool and candle's thread count when they first start, which is below.
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
    }
    // A typo in AUTOSP_SIMD, or a path this CPU lacks, fails here rather than running another path.
    simd::simd_from_env()?;
    let simd_paths: Vec<SimdPath> = match args.simd.as_deref() {
        None => vec![simd::simd_path()],
        Some("all") => simd::supported_paths(),
        Some(list) => list.split(',').map(|p| p.parse::<SimdPath>()?.supported()).collect::<Result<_, _>>()?,
    };
    let dtype = autosp::precision::parse_dtype(&args.dtype).map_err(anyhow::Error::msg)?;
    let dev = args.device.unwrap_or_else(autosp::DeviceSpec::default_for_build).open(None)?;
    let block = args.block;
    let mut kernels = Vec::new();
    for name in args.kernel.split(',') {
        match name.trim() {
            "cpu" if !dev.is_cpu() => bail!("--kernel cpu is the CPU kernel: use generic or flash-attn on {dev:?}"),
            "cpu" => kernels.push(Kernel::Cpu),
            "generic" => kernels.push(Kernel::Generic(block)),
            "flash-attn" => kernels.push(Kernel::FlashAttn),
            "both" => kernels.extend([Kernel::Cpu, Kernel::Generic(block)]),
            other => bail!("--kernel {other}: use cpu, generic, flash-attn or both (comma-separated)"),
        }
    }
    let (b, h) = (args.batch, args.heads);
    let hkv = args.kv_heads.unwrap_or(h);
    let threads = candle_core::utils::get_num_threads();
    let mut runs = Vec::new();
    for &d in &args.head_dim {
        for &n in &args.n {
            runs.extend(args.max_distance.iter().map(|&w| (d, n, w)));
        }
    }
    // The unwindowed times per (head_dim, n, kernel prefix, vector path): (forward, forward + backward).
    let mut no_window: HashMap<RunKey, (f64, Option<f64>)> = HashMap::new();
    for (d, n, window) in runs {
        let spec = AttentionSpec {
            causal: args.causal,
            scale: None,
            q_offset: 0,
            k_offset: 0,
            max_distance: window,
            documents: None,
        };
        let q = Tensor::randn(0f32, 1.0, (b, n, h, d), &dev)?.to_dtype(dtype)?;
        let k = Tensor::randn(0f32, 1.0, (b, n, hkv, d), &dev)?;
        let k = match args.sink_norm {
            Some(f) => Tensor::cat(&[&(k.narrow(1, 0, 1)? * f)?, &k.narrow(1, 1, n - 1)?], 1)?,
            None => k,
        }
        .to_dtype(dtype)?;
        let v = Tensor::randn(0f32, 1.0, (b, n, hkv, d), &dev)?.to_dtype(dtype)?;
        let d_o = Tensor::randn(0f32, 1.0, (b, n, h, d), &dev)?.to_dtype(dtype)?;
        let tiles = match block {
            Some(bl) => TileSize::from_block(bl),
            None => TileSize::for_call(&spec.dims("bench_attention", &q, &k, &v)?, dtype, &dev),
        };

        for (pi, &simd_path) in simd_paths.iter().enumerate() {
            simd::set_simd(Some(simd_path))?;
            if let Some(w) = autosp::cpu_matmul::stand_in_warning() {
                eprintln!("bench_attention: warning: {w}");
            }
            let fraction = window_pair_fraction(n, &spec);
            let fwd_flop =
                4.0 * (b * h) as f64 * (n as f64).powi(2) * d as f64 * if args.causal { 0.5 } else { 1.0 } * fraction;
            let fwd_bwd_flop = 3.5 * fwd_flop;
            let mut line = serde_json::json!({
                "kernel": kernels.iter().map(|k| k.name()).collect::<Vec<_>>().join(","),
                "batch": b, "heads": h, "kv_heads": hkv, "head_dim": d, "n": n,
                "causal": args.causal, "max_distance": window, "window_pair_fraction": fraction,
                "dtype": args.dtype, "threads": threads, "repeats": args.repeats,
                "generic_tiles": [tiles.rows, tiles.keys], "device": format!("{:?}", dev.location()),
                "flash_attn_feature": cfg!(feature = "flash-attn"),
                "flop_convention": "fwd = 4*b*h*N^2*d (x0.5 causal, x window_pair_fraction); fwd_bwd = 3.5*fwd",
                "scores_bytes_per_head": 4 * n * n,
                "simd": simd_path.name(),
                "sink_norm": args.sink_norm,
            });
            let mut fwd_times = HashMap::new();
            let mut fwd_bwd_times = HashMap::new();
            for &kernel in &kernels {
                let p = kernel.prefix();
                let has_backward = kernel != Kernel::FlashAttn;
                if has_backward {
                    let peak = peak_of(|| kernel.forward_backward(&q, &k, &v, &d_o, &spec))?;
                    line[format!("{p}fwd_bwd_peak_bytes")] = peak.into();
                }
                if args.peak_only {
                    continue;
                }
                let (fwd_s, fwd_cpu_s) = median_time(&dev, args.repeats, || {
                    kernel.forward(&q, &k, &v, &spec)?;
                    Ok(())
                })?;
                line[format!("{p}fwd_s")] = fwd_s.into();
                line[format!("{p}fwd_cpu_s")] = fwd_cpu_s.into();
                line[format!("{p}fwd_gflops")] = (fwd_flop / fwd_s / 1e9).into();
                fwd_times.insert(p, fwd_s);
                if has_backward {
                    let (fwd_bwd_s, fwd_bwd_cpu_s) =
                        median_time(&dev, args.repeats, || kernel.forward_backward(&q, &k, &v, &d_o, &spec))?;
                    line[format!("{p}fwd_bwd_s")] = fwd_bwd_s.into();
                    line[format!("{p}fwd_bwd_cpu_s")] = fwd_bwd_cpu_s.into();
                    line[format!("{p}fwd_bwd_gflops")] = (fwd_bwd_flop / fwd_bwd_s / 1e9).into();
                    fwd_bwd_times.insert(p, fwd_bwd_s);
                }
                match (window, no_window.get(&(d, n, p, simd_path))) {
                    (None, _) => {
                        no_window.insert((d, n, p, simd_path), (fwd_s, fwd_bwd_times.get(p).copied()));
                    }
                    (Some(_), Some(&(f, fb))) => {
                        line[format!("{p}fwd_over_no_window")] = (fwd_s / f).into();
                        if let (Some(fb), Some(t)) = (fb, fwd_bwd_times.get(p)) {
                            line[format!("{p}fwd_bwd_over_no_window")] = (t / fb).into();
                        }
                    }
                    (Some(_), None) => {}
                }
            }
            if let (Some(g), Some(c)) = (fwd_times.get("generic_"), fwd_times.get("")) {
                line["generic_over_cpu_fwd"] = (g / c).into();
                line["generic_over_cpu_fwd_bwd"] = (fwd_bwd_times["generic_"] / fwd_bwd_times[""]).into();
            }
            if let (Some(g), Some(f)) = (fwd_times.get("generic_"), fwd_times.get("flash_attn_")) {
                line["generic_over_flash_attn_fwd"] = (g / f).into();
            }
            // The naive comparison is of the first kernel with a backward.
            let first = kernels.iter().map(|k| k.prefix()).find(|p| fwd_bwd_times.contains_key(p));
            // The naive attention (no vector kernels of ours) runs with the first path only.
            let (Some(first), false, 0) = (first, args.peak_only, pi) else {
                println!("{line}");
                continue;
            };
            let (fwd_s, fwd_bwd_s) = (fwd_times[first], fwd_bwd_times[first]);

            // The naive backward holds about 8 score-sized tensors in f32 plus an f64 mask.
            let naive_bytes = 8.0 * 4.0 * (b * h) as f64 * (n as f64).powi(2) + 8.0 * (n as f64).powi(2);
            let naive_gib = naive_bytes / (1u64 << 30) as f64;
            let naive_repeats = args.repeats.min(3);
            let (naive_fwd_s, naive_fwd_bwd_s, naive_note) = if naive_gib <= args.naive_max_gib {
                let (f, _) = median_time(&dev, naive_repeats, || {
                    naive_attention_forward(&q, &k, &v, &spec)?;
                    Ok(())
                })?;
                let (fb, _) = median_time(&dev, naive_repeats, || {
                    let (o, lse) = naive_attention_forward(&q, &k, &v, &spec)?;
                    naive_attention_backward(&q, &k, &v, &o, &lse, Some(&d_o), None, &spec)?;
                    Ok(())
                })?;
                (Some(f), Some(fb), format!("median of {naive_repeats} after a warm-up"))
            } else {
                (
                    None,
                    None,
                    format!("skipped: needs about {naive_gib:.1} GiB > --naive-max-gib {}", args.naive_max_gib),
                )
            };
            // Speed-ups against the naive attention are of the first kernel measured.
            line["naive_fwd_s"] = naive_fwd_s.into();
            line["naive_fwd_bwd_s"] = naive_fwd_bwd_s.into();
            line["naive_note"] = naive_note.into();
            line["speedup_fwd"] = naive_fwd_s.map(|t| t / fwd_s).into();
            line["speedup_fwd_bwd"] = naive_fwd_bwd_s.map(|t| t / fwd_bwd_s).into();
            println!("{line}");
        }
    }
    Ok(())
}
