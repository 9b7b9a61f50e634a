//! Fused RMSNorm / RoPE / SwiGLU vs their unfused compositions from autosp-core, on the tape: prints one JSON
//! line per op with the median time of forward (inference tape) and forward + backward (recording tape), and
//! the effective bandwidth (the bytes the op must read and write at least, over the time). Also times the
//! RMSNorm backward with the reciprocal RMS recomputed vs passed in.
//!
//! `cargo run --release --example bench_fused -- --rows 8192 --dim 1376 --head-dim 64 --repeats 7`
//!
//! `--kernel generic` instead times each device-generic kernel (candle tensor ops, forced with `with_kernels`)
//! against the fast CPU kernel it mirrors, as plain functions without a tape, on the CPU: RMSNorm, RoPE, SwiGLU, the
//! chunked linear + cross-entropy and the Ring LSE merge; one JSON line per op with both medians and the ratio
//! `generic / cpu` (forward, and backward where there is one).

use std::time::Instant;

use autosp::core::gradcheck::probe;
use autosp::core::ops::{self, rope::default_inv_freq};
use autosp::core::{CheckpointPolicy, Result, Tape, Value};
use autosp::kernels::{rms_norm, rope, swiglu, with_kernels, Kernels};
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Fused vs unfused RMSNorm, RoPE and SwiGLU: time and GB/s")]
struct Args {
    /// Rows (tokens).
    #[arg(long, default_value_t = 8192)]
    rows: usize,
    /// Row width (hidden size for RMSNorm, intermediate size for SwiGLU; heads * head_dim for RoPE).
    #[arg(long, default_value_t = 1376)]
    dim: usize,
    /// Head dim for RoPE (heads = dim / head_dim).
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Timed repeats after one warm-up; the median is printed.
    #[arg(long, default_value_t = 7)]
    repeats: usize,
    /// `fused`: the fused ops vs their unfused compositions on the tape; `generic`: the device-generic ops vs
    /// the fast CPU kernels.
    #[arg(long, default_value = "fused")]
    kernel: String,
    /// Rows of the chunked loss (`--kernel generic`).
    #[arg(long, default_value_t = 1024)]
    loss_rows: usize,
    /// Hidden size of the chunked loss (`--kernel generic`).
    #[arg(long, default_value_t = 256)]
    loss_dim: usize,
    /// Vocabulary of the chunked loss (`--kernel generic`).
    #[arg(long, default_value_t = 4096)]
    vocab: usize,
    /// Rows per chunk of the chunked loss (`--kernel generic`).
    #[arg(long, default_value_t = 256)]
    loss_chunk: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median seconds of `f` over `repeats` runs after one warm-up.
fn time(repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    Ok(median(t))
}

type Graph = dyn Fn(&Tape, &[Value]) -> Result<Value>;

/// `(forward s, forward + backward s)` of `f` on `inputs`, differentiating the first `wrt` inputs.
fn bench(f: &Graph, inputs: &[Tensor], wrt: usize, repeats: usize) -> Result<(f64, f64)> {
    let fwd = time(repeats, || {
        let tape = Tape::inference();
        let v: Vec<Value> = inputs.iter().map(|t| Value::constant(t.clone())).collect();
        f(&tape, &v)?;
        Ok(())
    })?;
    let seed = probe(&[inputs[0].elem_count()], 99, &Device::Cpu)?.to_dtype(DType::F32)?;
    let both = time(repeats, || {
        let tape = Tape::new(CheckpointPolicy::None);
        let v: Vec<Value> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| if i < wrt { tape.leaf(t.clone()) } else { tape.constant(t.clone()) })
            .collect();
        let y = f(&tape, &v)?;
        tape.backward_with_grad(&y, &seed.reshape(y.dims())?, false)?;
        Ok(())
    })?;
    Ok((fwd, both))
}

fn report(op: &str, shape: &[usize], bytes_fwd: usize, bytes_bwd: usize, fused: (f64, f64), unfused: (f64, f64)) {
    let gbs = |b: usize, s: f64| b as f64 / s / 1e9;
    let line = serde_json::json!({
        "bench": "fused", "op": op, "shape": shape,
        "fused_fwd_s": fused.0, "fused_fwd_bwd_s": fused.1,
        "unfused_fwd_s": unfused.0, "unfused_fwd_bwd_s": unfused.1,
        "fused_fwd_gb_s": gbs(bytes_fwd, fused.0), "fused_fwd_bwd_gb_s": gbs(bytes_fwd + bytes_bwd, fused.1),
        "unfused_fwd_gb_s": gbs(bytes_fwd, unfused.0), "unfused_fwd_bwd_gb_s": gbs(bytes_fwd + bytes_bwd, unfused.1),
        "speedup_fwd": unfused.0 / fused.0, "speedup_fwd_bwd": unfused.1 / fused.1,
    });
    println!("{line}");
}

/// One JSON line: the generic op vs the CPU kernel, `(forward s, backward s)` each (backward `None` if none).
fn report_generic(op: &str, shape: &[usize], cpu: (f64, Option<f64>), generic: (f64, Option<f64>)) {
    let ratio = |g: Option<f64>, c: Option<f64>| g.zip(c).map(|(g, c)| g / c);
    let line = serde_json::json!({
        "bench": "generic", "op": op, "shape": shape,
        "cpu_fwd_s": cpu.0, "generic_fwd_s": generic.0, "generic_over_cpu_fwd": generic.0 / cpu.0,
        "cpu_bwd_s": cpu.1, "generic_bwd_s": generic.1, "generic_over_cpu_bwd": ratio(generic.1, cpu.1),
    });
    println!("{line}");
}

/// `f` with the device-generic kernels forced on this thread.
fn generic<R>(f: impl FnOnce() -> R) -> R {
    with_kernels(Kernels::Generic, f)
}

/// `--kernel generic`: each device-generic op against the fast CPU kernel, plain functions, f32.
fn bench_generic(a: &Args) -> anyhow::Result<()> {
    if autosp::kernels::kernels() != autosp::kernels::Kernels::Auto {
        anyhow::bail!("--kernel generic compares with the fast CPU kernels: unset AUTOSP_KERNELS");
    }
    let dev = Device::Cpu;
    let (m, d, r) = (a.rows, a.dim, a.repeats);
    let f32s = |shape: &[usize], seed: u64| -> Result<Tensor> { Ok(probe(shape, seed, &dev)?.to_dtype(DType::F32)?) };
    let both = |fwd: f64, bwd: f64| (fwd, Some(bwd));
    const EPS: f64 = 1e-5;

    let (x, w, g) = (f32s(&[m, d], 1)?, (f32s(&[d], 2)? + 1.0)?, f32s(&[m, d], 3)?);
    let cpu = both(
        time(r, || rms_norm::rms_norm_forward(&x, &w, EPS).map(|_| ()))?,
        time(r, || rms_norm::rms_norm_backward(&x, &w, &g, EPS, None).map(|_| ()))?,
    );
    let gen = both(
        time(r, || generic(|| rms_norm::rms_norm_forward(&x, &w, EPS)).map(|_| ()))?,
        time(r, || generic(|| rms_norm::rms_norm_backward(&x, &w, &g, EPS, None)).map(|_| ()))?,
    );
    report_generic("rms_norm", &[m, d], cpu, gen);

    let (gate, up) = ((f32s(&[m, d], 4)? * 3.0)?, f32s(&[m, d], 5)?);
    let cpu = both(
        time(r, || swiglu::swiglu_forward(&gate, &up).map(|_| ()))?,
        time(r, || swiglu::swiglu_backward(&gate, &up, &g).map(|_| ()))?,
    );
    let gen = both(
        time(r, || generic(|| swiglu::swiglu_forward(&gate, &up)).map(|_| ()))?,
        time(r, || generic(|| swiglu::swiglu_backward(&gate, &up, &g)).map(|_| ()))?,
    );
    report_generic("swiglu", &[m, d], cpu, gen);

    let (h, hd) = (d / a.head_dim, a.head_dim);
    let xr = f32s(&[1, m, h, hd], 6)?;
    let pos: Vec<usize> = (0..m).collect();
    let (cos, sin) = ops::rope_tables(&pos, &default_inv_freq(hd, 10000.0), DType::F32, &dev)?;
    let cpu = both(
        time(r, || rope::rope_forward(&xr, &cos, &sin).map(|_| ()))?,
        time(r, || rope::rope_backward(&xr, &cos, &sin).map(|_| ()))?,
    );
    let gen = both(
        time(r, || generic(|| rope::rope_forward(&xr, &cos, &sin)).map(|_| ()))?,
        time(r, || generic(|| rope::rope_backward(&xr, &cos, &sin)).map(|_| ()))?,
    );
    report_generic("rope", &[1, m, h, hd], cpu, gen);

    // The chunked loss: every 10th target ignored.
    let (lm, ld, vocab, chunk) = (a.loss_rows, a.loss_dim, a.vocab, a.loss_chunk);
    let hidden = f32s(&[lm, ld], 7)?;
    let head = f32s(&[vocab, ld], 8)?;
    let ids: Vec<i64> = (0..lm).map(|i| if i % 10 == 3 { -100 } else { ((i * 7919) % vocab) as i64 }).collect();
    let tg = Tensor::new(ids, &dev)?;
    let ce = autosp::kernels::chunked_cross_entropy_forward;
    let ce_b = autosp::kernels::chunked_cross_entropy_backward;
    let cpu = both(
        time(r, || ce(&hidden, &head, &tg, chunk).map(|_| ()))?,
        time(r, || ce_b(&hidden, &head, &tg, chunk, 1.0).map(|_| ()))?,
    );
    let gen = both(
        time(r, || generic(|| autosp::kernels::chunked_cross_entropy_forward(&hidden, &head, &tg, chunk)).map(|_| ()))?,
        time(r, || {
            generic(|| autosp::kernels::chunked_cross_entropy_backward(&hidden, &head, &tg, chunk, 1.0)).map(|_| ())
        })?,
    );
    report_generic("chunked_cross_entropy", &[lm, ld, vocab, chunk], cpu, gen);

    // The Ring LSE merge of two partial results o: [1, rows, heads, head_dim], lse: [1, heads, rows].
    let (oa, ob) = (f32s(&[1, m, h, hd], 9)?, f32s(&[1, m, h, hd], 10)?);
    let (la, lb) = ((f32s(&[1, h, m], 11)? * 3.0)?, (f32s(&[1, h, m], 12)? * 3.0)?);
    let merge_cpu = || -> Result<()> {
        let mut run = autosp::kernels::RunningAttention::new(&oa, &la)?;
        run.merge(&ob, &lb)?;
        Ok(())
    };
    // (The running state's construction is a no-op here: o and lse are f32 already.)
    let cpu = (time(r, merge_cpu)?, None);
    let gen = (time(r, || generic(merge_cpu))?, None);
    report_generic("ring_lse_merge", &[1, m, h, hd], cpu, gen);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    match a.kernel.as_str() {
        "fused" => {}
        "generic" => return bench_generic(&a),
        other => anyhow::bail!("--kernel {other:?}: use `fused` or `generic`"),
    }
    let dev = Device::Cpu;
    let (m, d, r) = (a.rows, a.dim, a.repeats);
    let f32s = |shape: &[usize], seed: u64| -> Result<Tensor> { Ok(probe(shape, seed, &dev)?.to_dtype(DType::F32)?) };
    let el = m * d * 4;

    // RMSNorm: forward reads x, writes y; backward reads x and g, writes dx.
    let x = f32s(&[m, d], 1)?;
    let w = (f32s(&[d], 2)? + 1.0)?;
    const EPS: f64 = 1e-5;
    let eps = EPS;
    let f = bench(&|t, v| rms_norm::rms_norm(t, &v[0], &v[1], EPS), &[x.clone(), w.clone()], 2, r)?;
    let u = bench(&|t, v| ops::rms_norm(t, &v[0], &v[1], EPS), &[x.clone(), w.clone()], 2, r)?;
    report("rms_norm", &[m, d], 2 * el, 3 * el, f, u);
    let g = f32s(&[m, d], 3)?;
    let recip = rms_norm::rms_norm_recip(&x, eps)?;
    let recompute = time(r, || rms_norm::rms_norm_backward(&x, &w, &g, eps, None).map(|_| ()))?;
    let saved = time(r, || rms_norm::rms_norm_backward(&x, &w, &g, eps, Some(&recip)).map(|_| ()))?;
    println!(
        "{}",
        serde_json::json!({"bench": "rms_norm_backward", "shape": [m, d],
            "recompute_recip_s": recompute, "saved_recip_s": saved, "saved_recip_bytes": m * 4})
    );

    // SwiGLU: forward reads gate and up, writes y; backward reads gate, up, g, writes two gradients.
    let gate = (f32s(&[m, d], 4)? * 3.0)?;
    let up = f32s(&[m, d], 5)?;
    let f = bench(&|t, v| swiglu::swiglu(t, &v[0], &v[1]), &[gate.clone(), up.clone()], 2, r)?;
    let u = bench(&|t, v| ops::mul(t, &ops::silu(t, &v[0])?, &v[1]), &[gate, up], 2, r)?;
    report("swiglu", &[m, d], 3 * el, 5 * el, f, u);

    // RoPE on [1, rows, dim / head_dim, head_dim]: forward reads x, writes y; backward reads g, writes dx.
    let h = d / a.head_dim;
    let x = f32s(&[1, m, h, a.head_dim], 6)?;
    let pos: Vec<usize> = (0..m).collect();
    let (cos, sin) = ops::rope_tables(&pos, &default_inv_freq(a.head_dim, 10000.0), DType::F32, &dev)?;
    let rb = m * h * a.head_dim * 4;
    let f = bench(&|t, v| rope::rope(t, &v[0], &v[1], &v[2]), &[x.clone(), cos.clone(), sin.clone()], 1, r)?;
    let u = bench(&|t, v| ops::rope(t, &v[0], &v[1], &v[2]), &[x, cos, sin], 1, r)?;
    report("rope", &[1, m, h, a.head_dim], 2 * rb, 2 * rb, f, u);
    Ok(())
}
