//! Sequence-parallel attention, forward + backward, at P thread ranks against one rank on the same total
//! sequence, for each strategy (Ulysses, Ring, hybrid); prints one JSON line per (strategy, P) with the time,
//! its ratio to one rank, and the bytes each rank sent (from `ProcessGroup::stats`).
//!
//! The ranks are threads of this process sharing one rayon pool, so the total work is what is compared: a ratio
//! near 1 means the decomposition (chunked flash calls, merges, copies, exchanges) costs little; it is not a
//! multi-device speed-up.
//!
//! `cargo run --release --example bench_sp_attention -- --n 4096 --heads 8 --kv-heads 2 --head-dim 64 --p 2,4`

use std::sync::Arc;
use std::time::{Duration, Instant};

use autosp::core::comm::{run_ranks, ProcessGroup};
use autosp::core::ops::{self, attention::AttentionSpec};
use autosp::core::{Attention, CheckpointPolicy, Tape};
use autosp::kernels::sp::{shard, SeqLayout};
use autosp::kernels::{HybridAttention, LocalAttention, RingAttention, RingLayout, UlyssesAttention};
use candle_core::Tensor;
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Total sequence length (a multiple of 2P for every P given).
    #[arg(long, default_value_t = 4096)]
    n: usize,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Rank counts, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    p: Vec<usize>,
    /// Non-causal attention (default causal; Ring then uses the zigzag layout).
    #[arg(long)]
    full: bool,
    /// Timed repetitions (the median is reported) after one warm-up.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// cpu | cuda | cuda:N | metal (default: the first CUDA device when built with `cuda` and one exists,
    /// else the CPU).
    #[arg(long)]
    device: Option<autosp::DeviceSpec>,
}

#[derive(Clone, Copy, Debug)]
enum Strategy {
    Ulysses,
    Ring,
    Hybrid(usize),
}

struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
}

/// One forward + backward of `attn` on this rank's shards; returns the seconds it took.
fn step(attn: &dyn Attention, x: &Inputs, spec: &AttentionSpec) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    let tape = Tape::new(CheckpointPolicy::None);
    let (q, k, v) = (tape.leaf(x.q.clone()), tape.leaf(x.k.clone()), tape.leaf(x.v.clone()));
    let (o, _lse) = attn.forward(&tape, &q, &k, &v, spec)?;
    let d_o = tape.constant(x.d_o.clone());
    tape.backward(&ops::sum_all(&tape, &ops::mul(&tape, &o, &d_o)?)?)?;
    Ok(t0.elapsed().as_secs_f64())
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    xs[xs.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let dev = a.device.unwrap_or_else(autosp::DeviceSpec::default_for_build).open(None)?;
    let full = Inputs {
        q: Tensor::randn(0f32, 1., (a.batch, a.n, a.heads, a.head_dim), &dev)?,
        k: Tensor::randn(0f32, 1., (a.batch, a.n, a.kv_heads, a.head_dim), &dev)?,
        v: Tensor::randn(0f32, 1., (a.batch, a.n, a.kv_heads, a.head_dim), &dev)?,
        d_o: Tensor::randn(0f32, 1., (a.batch, a.n, a.heads, a.head_dim), &dev)?,
    };
    let spec = if a.full { AttentionSpec::full() } else { AttentionSpec::causal() };
    let ring_layout = if a.full { RingLayout::Contiguous } else { RingLayout::Zigzag };
    step(&LocalAttention, &full, &spec)?;
    let single = median((0..a.reps).map(|_| step(&LocalAttention, &full, &spec)).collect::<anyhow::Result<_>>()?);
    for &p in &a.p {
        let mut strategies = vec![Strategy::Ulysses, Strategy::Ring];
        if p >= 4 && p % 2 == 0 {
            strategies.push(Strategy::Hybrid(2));
        }
        for strategy in strategies {
            let results = run_ranks(p, Duration::from_secs(600), |world| -> anyhow::Result<(f64, u64, u64)> {
                let (attn, groups): (Arc<dyn Attention>, Vec<Arc<dyn ProcessGroup>>) = match strategy {
                    Strategy::Ulysses => {
                        (Arc::new(UlyssesAttention::new(world.clone(), Arc::new(LocalAttention))), vec![world.clone()])
                    }
                    Strategy::Ring => (Arc::new(RingAttention::new(world.clone(), ring_layout)), vec![world.clone()]),
                    Strategy::Hybrid(u) => {
                        let h = HybridAttention::new(world.as_ref(), u, ring_layout)?;
                        let g = vec![h.inner_group.clone(), h.outer_group.clone()];
                        (Arc::new(h), g)
                    }
                };
                let layout = match strategy {
                    Strategy::Ulysses => SeqLayout::Contiguous,
                    Strategy::Ring if a.full => SeqLayout::Contiguous,
                    Strategy::Ring => SeqLayout::Zigzag,
                    Strategy::Hybrid(_) if a.full => SeqLayout::Contiguous,
                    Strategy::Hybrid(u) => SeqLayout::HybridZigzag { u },
                };
                let r = world.rank();
                let x = Inputs {
                    q: shard(&full.q, 1, layout, p, r)?,
                    k: shard(&full.k, 1, layout, p, r)?,
                    v: shard(&full.v, 1, layout, p, r)?,
                    d_o: shard(&full.d_o, 1, layout, p, r)?,
                };
                step(attn.as_ref(), &x, &spec)?;
                let mut times = Vec::new();
                let mut bytes = 0;
                for _ in 0..a.reps {
                    world.barrier()?;
                    groups.iter().for_each(|g| g.reset_stats());
                    times.push(step(attn.as_ref(), &x, &spec)?);
                    bytes = groups.iter().map(|g| g.stats().total_bytes_sent()).sum();
                }
                let calls = groups.iter().map(|g| g.stats().total_calls()).sum();
                Ok((median(times), bytes, calls))
            });
            let mut worst = 0f64;
            let mut bytes = Vec::new();
            let mut calls = 0;
            for res in results {
                let (t, b, c) = res??;
                worst = worst.max(t);
                bytes.push(b);
                calls = c;
            }
            let name = match strategy {
                Strategy::Ulysses => "ulysses".to_string(),
                Strategy::Ring => format!("ring_{}", if a.full { "contiguous" } else { "zigzag" }),
                Strategy::Hybrid(u) => format!("hybrid_{u}x{}", p / u),
            };
            let line = serde_json::json!({
                "bench": "sp_attention",
                "strategy": name,
                "p": p,
                "n": a.n,
                "batch": a.batch,
                "heads": a.heads,
                "kv_heads": a.kv_heads,
                "head_dim": a.head_dim,
                "causal": !a.full,
                "single_rank_fwd_bwd_ms": single * 1e3,
                "sp_fwd_bwd_ms": worst * 1e3,
                "sp_over_single": worst / single,
                "collective_calls_per_rank": calls,
                "bytes_sent_per_rank": bytes,
            });
            println!("{line}");
        }
    }
    Ok(())
}
