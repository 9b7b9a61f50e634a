//! Attention on a window packed from documents (`AttentionSpec::documents`) against the same window
//! document-blind (one causal sequence), forward and forward + backward, at one rank (the CPU flash kernel)
//! and at P thread ranks (Ulysses; Ring in the zigzag layout, which skips the shard pairs wholly in different
//! documents). Document lengths are drawn uniformly from `--doc-min..=--doc-max` (seeded; the last one takes
//! what is left of the window). Every round runs every configuration once, in turn, so that a busy machine
//! slows them alike; the medians over the rounds are reported, one JSON line per (P, strategy), with
//! `visible_pair_fraction` (the (query, key) pairs the document mask leaves, over the causal window's) and
//! `blind_over_packed_*` (how many times cheaper the packed window is).
//!
//! The ranks are threads of this process sharing one rayon pool: the times are the work of the whole
//! decomposition, not a multi-device speed-up (see `bench_sp_attention`).
//!
//! `cargo run --release --example bench_packed_attention -- --n 8192 --doc-min 512 --doc-max 2048 --p 1,2`

use std::sync::Arc;
use std::time::{Duration, Instant};

use autosp::core::comm::run_ranks;
use autosp::core::ops::{self, attention::AttentionSpec, Documents};
use autosp::core::{Attention, CheckpointPolicy, Tape};
use autosp::kernels::sp::{shard, SeqLayout};
use autosp::kernels::{LocalAttention, RingAttention, RingLayout, UlyssesAttention};
use candle_core::{Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Window length (a multiple of 2P for every P given).
    #[arg(long, default_value_t = 8192)]
    n: usize,
    /// Shortest document.
    #[arg(long, default_value_t = 512)]
    doc_min: usize,
    /// Longest document.
    #[arg(long, default_value_t = 2048)]
    doc_max: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Rank counts, comma separated (1: the single-rank kernel; more: Ulysses and Ring on thread ranks).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    p: Vec<usize>,
    /// Rounds (each runs every configuration once, after one warm-up round); the median is reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Seed of the document lengths.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Document lengths in `min..=max` filling `n` (the last one takes what is left), from a splitmix64 stream.
fn lengths(n: usize, min: usize, max: usize, seed: u64) -> Vec<usize> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut out = Vec::new();
    let mut left = n;
    while left > 0 {
        let l = (min + (next() % (max - min + 1) as u64) as usize).min(left);
        out.push(l);
        left -= l;
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Strategy {
    Local,
    Ulysses,
    Ring,
}

/// One configuration: ranks, strategy, packed or not.
#[derive(Clone, Copy, Debug)]
struct Config {
    p: usize,
    strategy: Strategy,
    packed: bool,
}

struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
}

/// `(forward seconds, forward + backward seconds)` of `attn` on these shards: one forward alone, then one
/// forward and backward.
fn time(attn: &dyn Attention, x: &Inputs, spec: &AttentionSpec) -> anyhow::Result<(f64, f64)> {
    let run = |backward: bool| -> anyhow::Result<f64> {
        let t0 = Instant::now();
        let tape = Tape::new(CheckpointPolicy::None);
        let (q, k, v) = (tape.leaf(x.q.clone()), tape.leaf(x.k.clone()), tape.leaf(x.v.clone()));
        let (o, _lse) = attn.forward(&tape, &q, &k, &v, spec)?;
        if backward {
            let d_o = tape.constant(x.d_o.clone());
            tape.backward(&ops::sum_all(&tape, &ops::mul(&tape, &o, &d_o)?)?)?;
        }
        Ok(t0.elapsed().as_secs_f64())
    };
    Ok((run(false)?, run(true)?))
}

/// One measurement of `c`: the slowest rank's `(forward, forward + backward)` seconds.
fn measure(c: Config, full: &Arc<Inputs>, documents: &Arc<Documents>) -> anyhow::Result<(f64, f64)> {
    let spec = AttentionSpec::causal().with_documents(c.packed.then(|| documents.clone()));
    if c.strategy == Strategy::Local {
        return time(&LocalAttention, full, &spec);
    }
    let results = run_ranks(c.p, Duration::from_secs(600), |world| -> anyhow::Result<(f64, f64)> {
        let (attn, layout): (Arc<dyn Attention>, SeqLayout) = match c.strategy {
            Strategy::Ulysses => {
                (Arc::new(UlyssesAttention::new(world.clone(), Arc::new(LocalAttention))), SeqLayout::Contiguous)
            }
            _ => (Arc::new(RingAttention::new(world.clone(), RingLayout::Zigzag)), SeqLayout::Zigzag),
        };
        let r = world.rank();
        let sh = |t: &Tensor| shard(t, 1, layout, c.p, r);
        let x = Inputs { q: sh(&full.q)?, k: sh(&full.k)?, v: sh(&full.v)?, d_o: sh(&full.d_o)? };
        world.barrier()?;
        time(attn.as_ref(), &x, &spec)
    });
    let mut worst = (0f64, 0f64);
    for r in results {
        let (f, fb) = r??;
        worst = (worst.0.max(f), worst.1.max(fb));
    }
    Ok(worst)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    anyhow::ensure!(1 <= a.doc_min && a.doc_min <= a.doc_max, "--doc-min must be at least 1 and at most --doc-max");
    let dev = Device::Cpu;
    let (n, h, hkv, d) = (a.n, a.heads, a.kv_heads, a.head_dim);
    let full = Arc::new(Inputs {
        q: Tensor::randn(0f32, 1., (1, n, h, d), &dev)?,
        k: Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?,
        v: Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?,
        d_o: Tensor::randn(0f32, 1., (1, n, h, d), &dev)?,
    });
    let lens = lengths(n, a.doc_min, a.doc_max, a.seed);
    let documents = Arc::new(Documents::from_lengths(&lens, 0)?);
    let pairs = |l: usize| (l * (l + 1) / 2) as f64;
    let fraction = lens.iter().map(|&l| pairs(l)).sum::<f64>() / pairs(n);
    let mut configs = Vec::new();
    for &p in &a.p {
        let strategies = if p == 1 { vec![Strategy::Local] } else { vec![Strategy::Ulysses, Strategy::Ring] };
        for s in strategies {
            for packed in [false, true] {
                configs.push(Config { p, strategy: s, packed });
            }
        }
    }
    for &c in &configs {
        measure(c, &full, &documents)?;
    }
    let mut times: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); configs.len()];
    for _ in 0..a.rounds {
        for (i, &c) in configs.iter().enumerate() {
            let (f, fb) = measure(c, &full, &documents)?;
            times[i].0.push(f);
            times[i].1.push(fb);
        }
    }
    for pair in configs.chunks(2).zip(times.chunks(2)) {
        let ([blind_c, _], [blind, packed]) = (pair.0, pair.1) else { unreachable!("blind and packed in pairs") };
        let (bf, bfb) = (median(blind.0.clone()), median(blind.1.clone()));
        let (pf, pfb) = (median(packed.0.clone()), median(packed.1.clone()));
        let strategy = match blind_c.strategy {
            Strategy::Local => "single_rank",
            Strategy::Ulysses => "ulysses",
            Strategy::Ring => "ring_zigzag",
        };
        let line = serde_json::json!({
            "bench": "packed_attention",
            "strategy": strategy,
            "p": blind_c.p,
            "n": n, "heads": h, "kv_heads": hkv, "head_dim": d,
            "documents": lens.len(), "lengths": lens, "doc_min": a.doc_min, "doc_max": a.doc_max,
            "visible_pair_fraction": fraction,
            "rounds": a.rounds,
            "blind_fwd_ms": bf * 1e3, "packed_fwd_ms": pf * 1e3,
            "blind_fwd_bwd_ms": bfb * 1e3, "packed_fwd_bwd_ms": pfb * 1e3,
            "blind_over_packed_fwd": bf / pf, "blind_over_packed_fwd_bwd": bfb / pfb,
        });
        println!("{line}");
    }
    Ok(())
}
