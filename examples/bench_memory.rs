//! Memory and step time of a compiled Llama training step: one JSON line per (N, run) with the tape's bytes
//! after the forward pass and at its peak, the process heap peak (a tracking global allocator), the step
//! time and throughput, and the plan's predictions for the same run (from two short probe steps).
//!
//! `cargo run --release --example bench_memory -- --preset bench --n 2048,8192 --checkpoint none,sequence-aware`
//!
//! By default ranks are threads of this process (`--launcher threads`), so the process peak covers every
//! rank: the JSON says so in `process_peak_scope`. With `--launcher mpi` (feature `mpi`) each rank is its own
//! process under `mpirun`, so each rank's process peak is its own: rank 0 gathers them and prints one line
//! per run with `rank_process_peak_bytes` (each rank's) and `process_peak_bytes` (the largest of them).
//! A step is the compiled forward + backward + gradient all-reduce and one AdamW update (its moment buffers
//! are allocated on the first step, before the measured one).
//!
//! `--dp D` splits the ranks into D data-parallel replicas (each trains its own sequence of N tokens, so a
//! step is D·N tokens) and `--shard` shards the model states over all of them (ZeRO-style; see
//! `autosp::compile::sharding`): each line carries `model_state_bytes_per_rank` (the accounting: parameters,
//! gradients, AdamW's moments, f32 masters and the weights gathered at once) and `model_state_bytes_held` (the
//! same, measured from this rank's tensors after the step). With `--shard` the model is built one rank at a
//! time and sharded as it is built (`build_sharded`), so ranks on one machine never hold a whole model each.
//! `--preset llama-3.2-1b` is a Llama-3.2-1B-shaped model with random weights.
//!
//! `--capacity` adds, per checkpoint configuration, one JSON line (`"bench":"capacity"`) after its runs: the
//! least-squares line of the process peak vs N through the `--n` runs, its error, the longest N predicted to
//! fit `--budget`, and with `--confirm` one step at that N (see `autosp::capacity`). With thread ranks it
//! needs `--sp 1`; under MPI it fits the largest rank's peak.
//!
//! ```text
//! cargo build --release --features mpi --example bench_memory
//! mpirun -np 2 target/release/examples/bench_memory --launcher mpi --strategy ulysses --n 10240,12288,14336 \
//!     --checkpoint none --capacity --no-plan
//! ```

#![recursion_limit = "256"]

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use autosp::capacity;
use autosp::compile::{
    build_sharded, compile, model_state_bytes_with, Checkpointing, CompileConfig, Mesh, ModelStateBytes, ParamCounts,
    Strategy,
};
use autosp::core::comm::{run_ranks, ProcessGroup};
use autosp::core::optim::{AdamW, AdamWConfig, Optimizer};
use autosp::core::{CausalLm, CheckpointPolicy, ShardLevel, TrackingAllocator};
use autosp::models::{random_weights, LlamaConfig, LlamaModel};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use serde_json::json;

#[path = "common/measure.rs"]
mod measure;
#[path = "common/presets.rs"]
mod presets;

use measure::{loadavg, median};

#[global_allocator]
static ALLOC: TrackingAllocator = TrackingAllocator::new();

#[derive(Parser, Debug)]
#[command(about = "Tape and process memory, step time and the plan's predictions of a compiled Llama step")]
struct Args {
    /// A named model shape with random weights: `bench` (vocab 32000, hidden 512, intermediate 1376,
    /// 4 layers, 8 heads, 4 kv heads, untied, rope_theta 10000) or `llama-3.2-1b` (vocab 128256, hidden 2048,
    /// intermediate 8192, 16 layers, 32 heads, 8 kv heads, tied embeddings, rope_theta 500000: 1.24 B
    /// parameters), or the other benches' `tiny` and `smollm2-135m` (examples/common/presets.rs).
    #[arg(long, default_value = "bench", conflicts_with = "model")]
    preset: String,
    /// A local directory or hub repo id of a Llama-family checkpoint (instead of the preset).
    #[arg(long)]
    model: Option<String>,
    /// Global sequence lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2048")]
    n: Vec<usize>,
    /// Sequence-parallel degree S: the ranks of each replica (default 1; thread ranks: --dp × --sp threads).
    /// With `--launcher mpi`, --dp × --sp is mpirun's `-np` (--sp defaults to -np / --dp).
    #[arg(long)]
    sp: Option<usize>,
    /// Data-parallel replicas D: each trains its own sequence of N tokens per step.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// How model states are sharded over all D·S ranks: none | optimizer | gradients | parameters (default:
    /// compile's choice by size, which the JSON names).
    #[arg(long)]
    shard: Option<autosp::core::ShardLevel>,
    /// ulysses | ring | auto | hybrid:U (U = the Ulysses degree).
    #[arg(long, default_value = "auto")]
    strategy: String,
    /// none | full | sequence-aware | a tape byte budget per rank (e.g. 800000000, 750M, 1.5G); a comma
    /// list runs each in turn (in one process, back to back: compare step times within one invocation).
    #[arg(long, value_delimiter = ',', default_value = "sequence-aware")]
    checkpoint: Vec<String>,
    /// Measured steps per length (after one warm-up step that also allocates AdamW's moments).
    #[arg(long, default_value_t = 1)]
    steps: usize,
    /// The warm-up step's sequence length (default: the measured length). A short one (e.g. 2048) still
    /// allocates AdamW's moments before the measured step, so that step's heap peak is the same, and it
    /// halves the time of a long confirmation run.
    #[arg(long)]
    warmup_n: Option<usize>,
    /// threads (ranks are threads of this process, sharing one heap) or mpi (one process per rank under
    /// mpirun, each with its own heap and peak; needs the `mpi` feature).
    #[arg(long, default_value = "threads", value_parser = ["threads", "mpi"])]
    launcher: String,
    /// Skip the plan's probe steps (no predictions in the JSON).
    #[arg(long)]
    no_plan: bool,
    /// After each checkpoint configuration's runs, fit the process peak vs N and predict the longest N that
    /// fits `--budget` (one extra JSON line, `"bench":"capacity"`). With thread ranks only at `--sp 1` (the
    /// process peak is all ranks' together); under MPI the largest rank's own process peak is fitted.
    #[arg(long)]
    capacity: bool,
    /// The per-rank byte budget of `--capacity` (e.g. 4G, 4294967296; K/M/G are powers of ten, Gi/Mi powers
    /// of two).
    #[arg(long, default_value = "4Gi")]
    budget: String,
    /// The predicted longest N is rounded down to a multiple of this.
    #[arg(long, default_value_t = 512)]
    capacity_multiple: usize,
    /// Run one step at the predicted longest N to confirm its peak fits the budget (slow: the step is long).
    #[arg(long)]
    confirm: bool,
    /// Print rank 0's `explain()` (the rewritten module tree and the plan) to stderr before each run.
    #[arg(long)]
    explain: bool,
    /// Time every op of the last measured step (forward, replay, backward; the gradient reduction and the
    /// optimizer) and add `"profile"` to the JSON: seconds per op and role, grouped by kind (rank 0's thread;
    /// wall time, exact on the CPU, queueing time only on a GPU).
    #[arg(long)]
    profile: bool,
    /// Print only the model-state accounting at these world sizes (e.g. 1,2,4), every sharding level: one
    /// `"bench":"model_state_accounting"` line each, from the model's parameter counts (built once in this
    /// process, nothing run). For meshes that do not fit this machine; runs report it measured beside.
    #[arg(long, value_delimiter = ',')]
    account_worlds: Vec<usize>,
    /// cpu | cuda | cuda:N | metal (default: the first CUDA device when built with `cuda` and one exists, else
    /// the CPU). Thread ranks share it; under MPI plain `cuda` gives rank r its node-local GPU.
    #[arg(long)]
    device: Option<autosp::DeviceSpec>,
    /// The compute dtype: bf16 | f16 | f32 (default: f32 on the CPU, bf16 on a GPU).
    #[arg(long, value_parser = autosp::precision::parse_dtype)]
    dtype: Option<DType>,
    /// Train LoRA adapters of rank R (`R[:ALPHA]`, every projection) on the frozen model instead of the whole
    /// model: the base weights have no gradients, moments or masters.
    #[arg(long, value_name = "R[:ALPHA]")]
    lora: Option<String>,
}

impl Args {
    fn device_spec(&self) -> autosp::DeviceSpec {
        self.device.unwrap_or_else(autosp::DeviceSpec::default_for_build)
    }

    fn dtype(&self) -> DType {
        self.dtype.unwrap_or_else(|| autosp::precision::default_dtype(&self.device_spec()))
    }
}

fn parse_strategy(s: &str) -> Result<Strategy> {
    Ok(match s {
        "ulysses" => Strategy::Ulysses,
        "ring" => Strategy::Ring,
        "auto" => Strategy::Auto,
        _ => match s.strip_prefix("hybrid:") {
            Some(u) => Strategy::Hybrid { ulysses: u.parse().context("hybrid:U needs an integer U")? },
            None => bail!("unknown strategy {s:?}: use ulysses, ring, auto or hybrid:U"),
        },
    })
}

fn parse_checkpoint(s: &str) -> Result<Checkpointing> {
    Ok(match s {
        "none" => Checkpointing::Policy(CheckpointPolicy::None),
        "full" => Checkpointing::Policy(CheckpointPolicy::Full),
        "sequence-aware" | "sa" => Checkpointing::Policy(CheckpointPolicy::SequenceAware),
        _ => Checkpointing::Budget(
            parse_bytes(s)
                .map_err(|_| anyhow!("--checkpoint {s:?}: use none, full, sequence-aware or a byte budget like 750M"))?
                as usize,
        ),
    })
}

/// A byte count: a number with an optional suffix K/M/G (powers of ten) or Ki/Mi/Gi (powers of two).
fn parse_bytes(s: &str) -> Result<u64> {
    let (num, mult) = [("Ki", 1024.0), ("Mi", 1048576.0), ("Gi", 1073741824.0), ("K", 1e3), ("M", 1e6), ("G", 1e9)]
        .iter()
        .find_map(|(suf, m)| s.strip_suffix(suf).or_else(|| s.strip_suffix(&suf.to_lowercase())).map(|n| (n, *m)))
        .unwrap_or((s, 1.0));
    let v: f64 = num.parse().map_err(|_| anyhow!("{s:?} is not a byte count: use e.g. 4294967296, 750M or 4Gi"))?;
    Ok((v * mult) as u64)
}

fn load_model(args: &Args, max_n: usize, device: &Device) -> Result<LlamaModel> {
    let dtype = args.dtype();
    let mut model = match &args.model {
        Some(m) => LlamaModel::load_on(m, dtype, device)?,
        None => {
            let cfg = presets::preset_config(&args.preset, max_n)?;
            LlamaModel::from_weights(&cfg, random_weights(&cfg, 1234, dtype, device)?)?
        }
    };
    if let Some(spec) = &args.lora {
        model.add_lora(&autosp::core::lora::LoraConfig::parse(spec)?)?;
    }
    Ok(model)
}

/// CPU seconds (user + system) this process has used, from /proc/self/stat (100 ticks a second): on a
/// shared machine the step's CPU time moves far less with the load than its wall time.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime and stime are the 12th and 13th.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<f64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
    if f.len() > 12 {
        (f[11] + f[12]) / 100.0
    } else {
        f64::NAN
    }
}

/// Resets the kernel's peak resident set size of this process (VmHWM) to its current RSS (Linux: writing
/// 5 to /proc/self/clear_refs). False where the kernel refuses.
fn reset_maxrss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The kernel's peak resident set size of this process (VmHWM of /proc/self/status) in bytes, since start or
/// the last [`reset_maxrss`]; None where /proc has no such line.
fn maxrss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// One run on one rank: a warm-up step, then `--steps` measured steps; its JSON line. `own_heap`: this rank is
/// its own process (MPI), so it resets and reads its own peaks; with thread ranks rank 0 does it for all.
fn run_rank(
    args: &Args,
    pg: Arc<dyn ProcessGroup>,
    n: usize,
    checkpoint_arg: &str,
    own_heap: bool,
    device: &Device,
) -> Result<serde_json::Value> {
    let strategy = parse_strategy(&args.strategy)?;
    let checkpoint = parse_checkpoint(checkpoint_arg)?;
    // With a sharding level, one rank at a time builds the model and keeps its share.
    let model = match args.shard {
        Some(level) => build_sharded(&pg, level, || load_model(args, n, device))?,
        None => load_model(args, n, device)?,
    };
    let vocab = model.config.vocab_size as u32;
    let elems: usize = param_elems(&model);
    let mesh = Mesh::new(args.dp, pg.size() / args.dp);
    let mut cfg = CompileConfig::new(pg.clone(), strategy, checkpoint).with_mesh(mesh);
    if let Some(level) = args.shard {
        cfg = cfg.with_sharding(level);
    }
    cfg.seq_len = Some(n);
    cfg.dtype = args.dtype();
    let mut c = compile(model, cfg)?;
    if args.explain {
        let text = c.explain(n)?;
        if pg.rank() == 0 {
            eprintln!("{text}");
        }
    }
    let plan = if args.no_plan { None } else { Some(c.plan(n)?) };
    // One sequence per replica: [D, n].
    let make_ids = |n: usize| -> Result<Tensor> {
        let rows = args.dp as u32;
        let ids: Vec<u32> = (0..rows * n as u32).map(|i| (i.wrapping_mul(2654435761) >> 7) % vocab).collect();
        Ok(Tensor::from_vec(ids, (args.dp, n), &Device::Cpu)?)
    };
    let ids = make_ids(n)?;
    let warmup_ids = match args.warmup_n {
        Some(w) if w != n => Some(make_ids(w)?),
        _ => None,
    };
    let mut opt = AdamW::new(AdamWConfig::default())?;
    let params = c.params();
    let (mut times, mut fb_times, mut cpu_times) = (Vec::new(), Vec::new(), Vec::new());
    let mut last = None;
    let mut held = None;
    let mut process_peak = 0;
    let mut peak_phase = None;
    let mut baseline = 0;
    let mut maxrss = None;
    let mut maxrss_reset = false;
    let (mut profile, mut allocations, mut allocated_by_op) = (None, None, None);
    for step in 0..=args.steps {
        pg.barrier()?;
        if step > 0 && (own_heap || pg.rank() == 0) {
            ALLOC.reset_peak();
        }
        if step > 0 {
            // Every rank, so each knows whether it worked (thread ranks reset the same process, before the step).
            maxrss_reset = reset_maxrss();
        }
        baseline = ALLOC.live_bytes();
        pg.barrier()?;
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let step_ids = match (&warmup_ids, step) {
            (Some(w), 0) => w,
            _ => &ids,
        };
        let profiled = args.profile && step == args.steps;
        if profiled {
            autosp::core::profile::start();
        }
        let (allocated0, large0) = (ALLOC.allocated_bytes(), ALLOC.large_allocations());
        let by_phase0 = if profiled { ALLOC.allocated_by_phase() } else { Vec::new() };
        let out = c.train_step(step_ids, None)?;
        let fb = t0.elapsed().as_secs_f64();
        autosp::core::alloc::phase("step", "AdamW");
        {
            let _span = autosp::core::profile::span("step", "optimizer (AdamW)", String::new);
            opt.step(&params, &out.grads, 1e-4)?;
        }
        if step > 0 {
            allocations = Some((ALLOC.allocated_bytes() - allocated0, ALLOC.large_allocations() - large0));
        }
        if profiled {
            profile = autosp::core::profile::finish();
            let before: std::collections::HashMap<String, usize> = by_phase0.into_iter().collect();
            let mut grew: Vec<(String, usize)> = ALLOC
                .allocated_by_phase()
                .into_iter()
                .map(|(name, b)| {
                    let b0 = before.get(&name).copied().unwrap_or(0);
                    (name, b - b0)
                })
                .filter(|(_, b)| *b > 0)
                .collect();
            grew.sort_by_key(|g| std::cmp::Reverse(g.1));
            allocated_by_op = Some(grew);
        }
        if step > 0 {
            held = Some(ModelStateBytes::held(&autosp::core::module::all_params(c.model()), &out.grads, &opt));
        }
        drop(out.grads);
        let (dt, dc) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        pg.barrier()?;
        if step > 0 {
            if ALLOC.peak_bytes() > process_peak {
                process_peak = ALLOC.peak_bytes();
                peak_phase = ALLOC.peak_phase();
            }
            maxrss = maxrss.max(maxrss_bytes());
            times.push(dt);
            fb_times.push(fb);
            cpu_times.push(dc);
            last = Some((out.loss, out.after_forward.held_bytes, out.peak_bytes));
        }
    }
    let (loss, after_forward, peak) = last.ok_or_else(|| anyhow!("--steps must be at least 1"))?;
    let accounted = c.model_state_bytes();
    let step_s = median(times);
    let policies: Option<Vec<String>> = plan.as_ref().map(|p| p.policies.iter().map(|x| format!("{x:?}")).collect());
    Ok(json!({
        "bench": "memory",
        "model": args.model.clone().unwrap_or_else(|| format!("preset:{}", args.preset)),
        "n": n,
        "dp": c.mesh().data,
        "sp": c.mesh().sequence,
        "world": pg.size(),
        "rank": pg.rank(),
        "sharding": c.sharding().name(),
        "sharding_reason": c.sharding_reason(),
        "param_count": elems,
        "trainable_param_count": params.iter().map(|p| p.shape().elem_count()).sum::<usize>(),
        "lora": args.lora,
        "model_state_bytes_per_rank": state_json(&accounted),
        "model_state_bytes_per_param": accounted.total() as f64 / elems as f64,
        "model_state_bytes_held": held.as_ref().map(state_json),
        "model_state_scope": "model_state_bytes_per_rank: the accounting (gathered: the most whole weights alive at \
                              once at `parameters`); model_state_bytes_held: this rank's tensors after the measured \
                              step (parameters as stored, the step's gradients, AdamW's moments and masters)",
        "launcher": args.launcher,
        "device": format!("{:?}", device.location()),
        "simd": device.is_cpu().then(|| autosp::core::simd::simd_path().name()),
        "matmul_kernels": device.is_cpu().then(autosp::cpu_matmul::kernels),
        "dtype": args.dtype().as_str(),
        "strategy": format!("{:?}", c.resolved().strategy),
        "checkpoint": checkpoint_arg,
        "block_policies": policies,
        "steps": args.steps,
        "warmup_n": args.warmup_n.unwrap_or(n),
        "loss": loss,
        "tape_after_forward_bytes": after_forward,
        "tape_peak_bytes": peak,
        "process_peak_bytes": process_peak,
        "process_peak_phase": peak_phase,
        "device_peak_bytes": autosp::device::device_memory_peak(device),
        "device_peak_scope": "on CUDA: the high-water mark of the device's default memory pool since the process \
                              started (every tensor candle allocates; not the CUDA context or cuBLAS's workspace); \
                              null on the CPU",
        "process_baseline_bytes": baseline,
        "process_peak_scope": if own_heap {
            "this rank's own process (one process per rank)"
        } else if pg.size() > 1 {
            "the whole process, all thread ranks together (threads share one heap)"
        } else {
            "the whole process (one rank)"
        },
        "maxrss_bytes": maxrss,
        "maxrss_scope": if maxrss_reset {
            "the kernel's peak RSS (VmHWM) of the process over the measured steps (reset before them); it \
             includes memory the allocator kept from earlier runs in this process"
        } else {
            "the kernel's peak RSS (VmHWM) of the process since it started (the kernel refused a reset)"
        },
        "step_s": step_s,
        "fwd_bwd_s": median(fb_times),
        "step_cpu_s": median(cpu_times),
        "step_cpu_scope": "CPU seconds of the whole process during the step (all ranks' threads)",
        "tokens_per_s": (n * c.mesh().data) as f64 / step_s,
        "step_allocated_bytes": allocations.map(|a| a.0),
        "step_large_allocations": allocations.map(|a| a.1),
        "allocation_scope": "bytes the whole process allocated during the last measured step (all thread ranks), and \
                             how many of those allocations were 1 MiB or more (fresh pages the kernel zeroes)",
        "profile": profile.as_ref().map(|p| profile_json(p, &c.model().config, step_s)),
        "allocated_by_op": allocated_by_op.map(|v| v.into_iter().map(|(k, b)| json!({"phase": k, "bytes": b})).collect::<Vec<_>>()),
        "allocated_by_op_scope": "with --profile: bytes the process allocated during the profiled step while each op ran (the \
                                  tape's marks: pass and op; process-wide, so thread ranks' ops mix), largest first",
        "predicted_after_forward_bytes": plan.as_ref().map(|p| p.predicted_after_forward),
        "predicted_peak_bytes": plan.as_ref().map(|p| p.predicted_peak),
        "predicted_peak_error": plan.as_ref().map(|p| p.predicted_peak / peak as f64 - 1.0),
        "plan_probe_lengths": plan.as_ref().map(|p| [p.probes.0, p.probes.1]),
        "bytes_per_token_per_layer": plan.as_ref().map(|p| p.bytes_per_token_per_layer),
        "flops_attention": plan.as_ref().map(|p| p.flops.attention),
        "flops_linear": plan.as_ref().map(|p| p.flops.linear),
        "comm_bytes": plan.as_ref().map(|p| p.comm_bytes),
        "cpus": cpus(),
        "loadavg": loadavg(),
    }))
}

/// Model-state bytes as JSON, by kind, with their total.
/// The kind of work an op is, for the profile's groups.
fn op_kind(op: &str) -> &'static str {
    match op {
        "linear" | "matmul" => "matmuls",
        o if o.contains("mlp") => "matmuls",
        o if o.contains("attention") => "attention",
        o if o.contains("all_to_all") || o.contains("gather") || o.contains("scatter") || o.contains("ring") => {
            "communication"
        }
        o if o.contains("cross_entropy") => "loss",
        o if o.contains("norm") || o.contains("rope") || o.contains("swiglu") || o.contains("silu") => {
            "norm, rope, swiglu"
        }
        "optimizer (AdamW)" => "optimizer",
        "gradient reduction" => "communication",
        _ => "other",
    }
}

/// The role of a linear layer from its weight's `[out, in]` (the profile's detail), by the model's dims.
fn linear_role(detail: &str, cfg: &LlamaConfig) -> Option<&'static str> {
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let hd = cfg.head_dim;
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let shape = |o: usize, n: usize| format!("{:?}", [o, n]);
    [
        (shape(q, h), if q == h { "q_proj, o_proj" } else { "q_proj" }),
        (shape(h, q), "o_proj"),
        (shape(kv, h), "k_proj, v_proj"),
        (shape(i, h), "gate_proj, up_proj"),
        (shape(h, i), "down_proj"),
        (shape(v, h), "lm_head"),
    ]
    .into_iter()
    .find(|(s, _)| s == detail)
    .map(|(_, r)| r)
}

/// The profile as JSON: every `(pass, op, role)` with its seconds and calls, the seconds per kind, and how
/// much of the step the ops cover.
fn profile_json(p: &autosp::core::profile::Profile, cfg: &LlamaConfig, step_s: f64) -> serde_json::Value {
    let mut kinds: std::collections::BTreeMap<&str, f64> = Default::default();
    let mut ops = Vec::new();
    for ((pass, op, detail), t) in p {
        let kind = op_kind(op);
        *kinds.entry(kind).or_default() += t.seconds;
        let role = if *op == "linear" { linear_role(detail, cfg) } else { None };
        ops.push(json!({"pass": pass, "op": op, "shape": detail, "role": role, "kind": kind,
                        "seconds": t.seconds, "calls": t.calls}));
    }
    let covered: f64 = kinds.values().sum();
    json!({"by_kind_s": kinds, "ops": ops, "covered_s": covered, "step_s": step_s,
           "scope": "rank 0's thread, the last measured step: wall seconds inside each op (an op inside another counts \
                     in the outer one); step_s - covered_s is the step's time outside any op (data, tape bookkeeping)"})
}

fn state_json(b: &ModelStateBytes) -> serde_json::Value {
    json!({"params": b.params, "grads": b.grads, "moments": b.moments, "masters": b.masters,
           "gathered": b.gathered, "total": b.total()})
}

/// Every distinct parameter's elements (whole, also when sharded).
fn param_elems(model: &LlamaModel) -> usize {
    autosp::core::module::all_params(model).iter().map(|p| p.shape().elem_count()).sum()
}

fn cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// How long a collective waits for the other ranks (a long step's barrier waits for the slowest rank).
const TIMEOUT: Duration = Duration::from_secs(3600);

/// How the ranks run.
enum Launch {
    /// `p` ranks as threads of this process, started anew for each run.
    Threads { p: usize },
    /// This process is one rank of an mpirun job; `world` holds every rank (keep it until the end of main).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    Mpi { world: Arc<dyn ProcessGroup> },
}

impl Launch {
    /// The ranks, all of them (D·S).
    fn p(&self) -> usize {
        match self {
            Launch::Threads { p } => *p,
            Launch::Mpi { world } => world.size(),
        }
    }

    /// Whether this process prints the JSON lines (under MPI only rank 0 does).
    fn prints(&self) -> bool {
        match self {
            Launch::Threads { .. } => true,
            Launch::Mpi { world } => world.rank() == 0,
        }
    }
}

/// This process's rank of the mpirun job, checked against `--sp`.
#[cfg(feature = "mpi")]
fn launch_mpi(args: &Args) -> Result<Launch> {
    let world: Arc<dyn ProcessGroup> = Arc::new(autosp::core::comm::MpiGroup::init(TIMEOUT)?);
    let size = world.size();
    if args.dp == 0 || !size.is_multiple_of(args.dp) || args.sp.is_some_and(|sp| sp * args.dp != size) {
        bail!(
            "--dp {}{} but mpirun started {size} processes: with --launcher mpi, --dp × --sp is mpirun's -np (--sp \
             defaults to -np / --dp)",
            args.dp,
            args.sp.map_or(String::new(), |sp| format!(" --sp {sp}"))
        );
    }
    Ok(Launch::Mpi { world })
}

#[cfg(not(feature = "mpi"))]
fn launch_mpi(_args: &Args) -> Result<Launch> {
    bail!(
        "--launcher mpi needs the MPI back end, which this binary was built without: build with \
         `cargo build --release --features mpi --example bench_memory` and start it with \
         `mpirun -np P target/release/examples/bench_memory --launcher mpi ...`"
    )
}

/// Runs one step configuration on every rank. Threads: one JSON line per rank. MPI: one line (on every
/// rank, the same numbers; rank 0 prints it): this rank's line with every rank's peaks gathered into it.
fn measure(args: &Args, launch: &Launch, n: usize, checkpoint: &str) -> Result<Vec<serde_json::Value>> {
    match launch {
        Launch::Threads { p } => {
            // Thread ranks share one device handle.
            let device = args.device_spec().open(None)?;
            let device = &device;
            let out = run_ranks(*p, TIMEOUT, move |pg| run_rank(args, pg, n, checkpoint, false, device));
            let mut jsons = Vec::new();
            for r in out {
                jsons.push(r.map_err(|e| anyhow!("rank failed: {e}"))??);
            }
            Ok(jsons)
        }
        Launch::Mpi { world } => {
            let device = args.device_spec().open(Some((autosp::device::local_rank(world.rank()), world.size())))?;
            let line = run_rank(args, world.clone(), n, checkpoint, true, &device)?;
            Ok(vec![gather_rank_peaks(world.as_ref(), line)?])
        }
    }
}

/// Rank `r`'s own numbers gathered into every rank's `line`: `rank_process_peak_bytes[r]`,
/// `rank_process_baseline_bytes[r]`, `rank_maxrss_bytes[r]`, `rank_step_cpu_s[r]`, `rank_tape_peak_bytes[r]`;
/// `process_peak_bytes` and `maxrss_bytes` become the largest rank's (the tape's numbers stay this rank's).
fn gather_rank_peaks(world: &dyn ProcessGroup, mut line: serde_json::Value) -> Result<serde_json::Value> {
    let keys = ["process_peak_bytes", "process_baseline_bytes", "maxrss_bytes", "step_cpu_s", "tape_peak_bytes"];
    // f64 holds byte counts exactly up to 2^53 (9 PB); a missing maxrss travels as NaN.
    let mine: Vec<f64> = keys.iter().map(|k| line[*k].as_f64().unwrap_or(f64::NAN)).collect();
    let all = world.all_gather(&Tensor::from_vec(mine, (1, keys.len()), &Device::Cpu)?, 0)?.to_vec2::<f64>()?;
    let column = |i: usize| all.iter().map(|r| r[i]).collect::<Vec<f64>>();
    let bytes = |i: usize| column(i).iter().map(|&b| (b.is_finite()).then_some(b as u64)).collect::<Vec<_>>();
    let peaks = bytes(0);
    let maxrss = bytes(2);
    line["rank_process_peak_bytes"] = json!(peaks);
    line["rank_process_baseline_bytes"] = json!(bytes(1));
    line["rank_maxrss_bytes"] = json!(maxrss);
    line["rank_step_cpu_s"] = json!(column(3));
    line["rank_tape_peak_bytes"] = json!(bytes(4));
    line["process_peak_bytes"] = json!(peaks.iter().flatten().max());
    line["maxrss_bytes"] = json!(maxrss.iter().flatten().max());
    line["process_peak_scope"] =
        json!("the largest rank's own process peak (one process per rank); rank_process_peak_bytes: each rank's");
    line["step_cpu_scope"] =
        json!("CPU seconds of this rank's process during the step; rank_step_cpu_s: each rank's process");
    Ok(line)
}

/// The process peak of a run (the largest over its rank lines).
fn process_peak(lines: &[serde_json::Value]) -> Result<u64> {
    lines
        .iter()
        .map(|j| j["process_peak_bytes"].as_u64())
        .max()
        .flatten()
        .ok_or_else(|| anyhow!("a run printed no process_peak_bytes"))
}

/// The `"bench":"capacity"` line of one checkpoint configuration from its `(n, process peak)` points.
/// `strategy`, `sharding`: the resolved strategy and sharding level of the runs (as their memory lines print
/// them). Under MPI every rank
/// computes it from the same gathered peaks, and the ranks check they agree on the N to confirm.
fn capacity_line(
    args: &Args,
    launch: &Launch,
    strategy: &str,
    sharding: &str,
    checkpoint: &str,
    points: &[(usize, u64)],
) -> Result<serde_json::Value> {
    let budget = parse_bytes(&args.budget)?;
    let (floor, growing) = capacity::split_floor(points, 1e-3);
    if let Some(f) = floor.iter().map(|p| p.1).max().filter(|&f| f > budget) {
        bail!("--budget {budget} bytes is below the peak floor {f} bytes measured at short lengths: raise it");
    }
    if growing.len() < 2 {
        let ns: Vec<usize> = points.iter().map(|p| p.0).collect();
        bail!(
            "--capacity {checkpoint}: only {} of the lengths {ns:?} has a peak above the flat floor of {} bytes \
             (the optimizer update's transient, not the activations): add two or more longer --n",
            growing.len(),
            floor.iter().map(|p| p.1).max().unwrap_or(0)
        );
    }
    let fit = capacity::fit_peaks(&growing)?;
    let predicted = capacity::longest_fitting(&fit.line, budget, args.capacity_multiple)?;
    if let Launch::Mpi { world } = launch {
        let all = world.all_gather(&Tensor::new(&[predicted as i64], &Device::Cpu)?, 0)?.to_vec1::<i64>()?;
        if all.iter().any(|&n| n != predicted as i64) {
            bail!("the ranks predicted different longest N from the same gathered peaks: {all:?}");
        }
    }
    let confirmed = if args.confirm {
        let lines = measure(args, launch, predicted, checkpoint)?;
        if launch.prints() {
            for j in &lines {
                println!("{j}");
            }
        }
        let peak = process_peak(&lines)?;
        json!({"n": predicted, "process_peak_bytes": peak, "fits_budget": peak <= budget,
               "peak_vs_fit": peak as f64 / fit.line.at(predicted) - 1.0,
               "step_s": lines[0]["step_s"], "tokens_per_s": lines[0]["tokens_per_s"]})
    } else {
        serde_json::Value::Null
    };
    Ok(json!({
        "bench": "capacity",
        "model": args.model.clone().unwrap_or_else(|| format!("preset:{}", args.preset)),
        "world": launch.p(),
        "dp": args.dp,
        "sp": launch.p() / args.dp,
        "sharding": sharding,
        "launcher": args.launcher,
        "strategy": strategy,
        "checkpoint": checkpoint,
        "budget_bytes": budget,
        "peak_metric": match launch {
            Launch::Threads { .. } => "process_peak_bytes: heap peak of the measured step (tracking allocator), one rank",
            Launch::Mpi { .. } => "process_peak_bytes: heap peak of the measured step (tracking allocator) of the \
                                   largest rank, each rank its own process",
        },
        "points": growing.iter().map(|p| json!({"n": p.0, "process_peak_bytes": p.1})).collect::<Vec<_>>(),
        "floor_points": floor.iter().map(|p| json!({"n": p.0, "process_peak_bytes": p.1})).collect::<Vec<_>>(),
        "floor_note": "points within 0.1% of the smallest peak (two or more) are a flat floor, left out of the fit",
        "fit_a_bytes": fit.line.a,
        "fit_b_bytes_per_token": fit.line.b,
        "fit_rmse_bytes": fit.rmse_bytes,
        "fit_max_rel_error": fit.max_rel_error,
        "fit_r2": fit.r2,
        "capacity_multiple": args.capacity_multiple,
        "predicted_max_n": predicted,
        "predicted_peak_at_max_n": fit.line.at(predicted),
        "confirmed": confirmed,
        "confirmation": if args.confirm { "one step run at predicted_max_n" } else { "not confirmed (--confirm not given)" },
        "cpus": cpus(),
        "loadavg": loadavg(),
    }))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(w) = autosp::cpu_matmul::stand_in_warning() {
        eprintln!("bench_memory: warning: {w}");
    }
    if args.dp == 0 || args.sp == Some(0) {
        bail!("--dp and --sp must be 1 or more");
    }
    if !args.account_worlds.is_empty() {
        return account(&args);
    }
    let launch = match args.launcher.as_str() {
        "mpi" => launch_mpi(&args)?,
        _ => Launch::Threads { p: args.dp * args.sp.unwrap_or(1) },
    };
    let result = run(&args, &launch);
    if let (Err(e), Launch::Mpi { world }) = (&result, &launch) {
        // Leave without finalising MPI, so that mpirun ends the job instead of the other ranks waiting for
        // this one in a collective until the timeout.
        eprintln!("bench_memory: rank {}: error: {e:#}", world.rank());
        std::process::exit(1);
    }
    result
}

/// `--account-worlds`: the model-state bytes per rank at each world size and sharding level, from the
/// parameter counts of the model (built once, whole, in this process).
fn account(args: &Args) -> Result<()> {
    if let Some(&w) = args.account_worlds.iter().find(|&&w| w == 0) {
        bail!("--account-worlds {w}: a world has 1 rank or more");
    }
    let n = *args.n.iter().max().unwrap_or(&2048);
    let mut model = load_model(args, n, &Device::Cpu)?;
    let dims = model.dims();
    let counts = ParamCounts::of(&mut model, &dims);
    let params = counts.total();
    for &world in &args.account_worlds {
        for level in [ShardLevel::None, ShardLevel::Optimizer, ShardLevel::Gradients, ShardLevel::Parameters] {
            let bytes = model_state_bytes_with(&counts, args.dtype(), level, world, true);
            println!(
                "{}",
                json!({
                    "bench": "model_state_accounting",
                    "model": args.model.clone().unwrap_or_else(|| format!("preset:{}", args.preset)),
                    "dtype": format!("{:?}", args.dtype()).to_lowercase(),
                    "world": world,
                    "sharding": level.to_string(),
                    "param_count": params,
                    "trainable_param_count": counts.elems.iter().sum::<usize>(),
                    "lora": args.lora,
                    "model_state_bytes_per_rank": state_json(&bytes),
                    "model_state_bytes_per_param": bytes.total() as f64 / params as f64,
                    "gathered_bytes_per_param": bytes.gathered as f64 / params as f64,
                    "scope": "accounted from the parameter counts, not run (see bench_memory's runs for measured \
                              bytes); gathered: the most whole weights alive at once at `parameters`",
                })
            );
        }
    }
    Ok(())
}

/// Every configuration's runs, and with `--capacity` the fits; only the printing process prints.
fn run(args: &Args, launch: &Launch) -> Result<()> {
    if args.capacity && matches!(launch, Launch::Threads { p } if *p > 1) {
        bail!(
            "--capacity with --sp {}: thread ranks share one heap, so no per-rank peak exists; run --sp 1, or \
             one process per rank with --launcher mpi (feature mpi, under mpirun)",
            launch.p()
        );
    }
    parse_bytes(&args.budget)?;
    // points[i]: (n, process peak) of checkpoint configuration i, for --capacity.
    let mut points = vec![Vec::new(); args.checkpoint.len()];
    let mut strategy = vec![String::new(); args.checkpoint.len()];
    let mut sharding = vec![String::new(); args.checkpoint.len()];
    for &n in &args.n {
        for (i, checkpoint) in args.checkpoint.iter().enumerate() {
            let lines = measure(args, launch, n, checkpoint)?;
            points[i].push((n, process_peak(&lines)?));
            strategy[i] = lines[0]["strategy"].as_str().unwrap_or("?").to_string();
            sharding[i] = lines[0]["sharding"].as_str().unwrap_or("?").to_string();
            // Threads: one line per rank, the process numbers the same on every line (one heap). MPI: one line.
            if launch.prints() {
                for j in lines {
                    println!("{j}");
                }
            }
        }
    }
    if args.capacity {
        for (i, (checkpoint, pts)) in args.checkpoint.iter().zip(&points).enumerate() {
            let line = capacity_line(args, launch, &strategy[i], &sharding[i], checkpoint, pts)?;
            if launch.prints() {
                println!("{line}");
            }
        }
    }
    Ok(())
}
