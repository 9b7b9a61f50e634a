//! The kernel switch end to end: the tape ops and the composite kernels (the chunked SwiGLU MLP, the chunked
//! loss, Ring attention's LSE merge) run once with the fast CPU kernels, then with the generic kernels forced
//! (`set_kernels(Kernels::Generic)`), through their public functions only; results must agree. The switch is
//! process-wide, so this binary holds exactly ONE test, which flips it once, after computing every reference.
//!
//! Tolerances are those of `generic_ops.rs` (max relative error `max_i |x_i - y_i| / max_i |y_i|`): f32 1e-5
//! and f64 1e-10 (the same expressions summed in another order: a few ulps of the largest element). The
//! chunked MLP also runs its matmuls through candle on both sides, so only the SwiGLU inside differs. bf16:
//! 2^-7 (one bf16 ulp of the largest element: both sides compute in f32 and round once), except where the
//! generic kernels' GEMMs run in bf16. Ring attention's o and lse: 3e-2 (`attention_tol`: the generic
//! attention rounds its scores to bf16). Downstream of the loss: the generic loss runs its GEMMs in bf16 (the
//! fast kernel widens to f32 first), so each logit is rounded to bf16 (unit roundoff u = 2^-8) and so is
//! `dlogits` before the gradient GEMMs. The loss (f32) is held to 2^-10 = u/4: a row's `lse - logit[target]`
//! moves by at most 2u·max|logit|, but independent roundings cancel in the sum (measured 2.96e-4 = 0.08u, a
//! third of the bound). The gradients, all downstream of the loss, are held to 2^-6, two bf16 ulps of the
//! largest element (their own rounding plus the loss's; measured at most 7.75e-3, half of it).

use std::sync::Arc;
use std::time::Duration;

use autosp_core::comm::run_ranks;
use autosp_core::gradcheck::probe;
use autosp_core::ops::attention::AttentionSpec;
use autosp_core::ops::rope::{default_inv_freq, rope_tables};
use autosp_core::{Attention, CheckpointPolicy, Tape, Value};
use autosp_kernels::sp::{shard, SeqLayout};
use autosp_kernels::{
    chunked_cross_entropy, chunked_mlp, kernels, rms_norm, rope, set_kernels, Kernels, RingAttention, RingLayout,
};
use candle_core::{DType, Device, Tensor};

fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// The max relative error `max_i |a_i - b_i| / max_i |b_i|` (b the fast CPU kernels' result).
fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!((a.dims(), a.dtype()), (b.dims(), b.dtype()));
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert!(a.iter().all(|v| v.is_finite()));
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::BF16 => 2f64.powi(-7),
        _ => 1e-5,
    }
}

/// The tolerance of the block's output `name` run in `dtype`: [`tol`], but for bf16 the loss (f32) is held to
/// 2^-10 and the gradients to 2^-6 (see the module doc).
fn block_tol(name: &str, dtype: DType) -> f64 {
    match (dtype, name) {
        (DType::BF16, "loss") => 2f64.powi(-10),
        (DType::BF16, _) => 2f64.powi(-6),
        (dtype, _) => tol(dtype),
    }
}

/// The tolerance of Ring attention's o and lse for inputs in `dtype`: [`tol`], except bf16 3e-2, the generic
/// attention's (its tile products are bf16 GEMMs, so its scores, and with them the f32 LSE, carry bf16
/// rounding; `generic_attention.rs` measured 1.45e-2 at worst).
fn attention_tol(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 3e-2,
        _ => tol(dtype),
    }
}

/// A small Llama-like block on the tape: RMSNorm -> RoPE on a head view -> chunked SwiGLU MLP -> chunked loss;
/// returns every output and input gradient (the loss, its count as a 0-d tensor, then gradients).
fn block(dtype: DType) -> Vec<Tensor> {
    let (b, n, h, hd) = (1, 7, 2, 8);
    let (d, f, vocab) = (h * hd, 24, 19);
    let tape = Tape::new(CheckpointPolicy::None);
    let x = tape.leaf(rand(&[b * n, d], 1, dtype));
    let w_norm = tape.leaf(rand(&[d], 2, dtype).affine(0.5, 1.0).unwrap());
    let wg = tape.leaf(rand(&[f, d], 3, dtype).affine(0.3, 0.0).unwrap());
    let wu = tape.leaf(rand(&[f, d], 4, dtype).affine(0.3, 0.0).unwrap());
    let wd = tape.leaf(rand(&[d, f], 5, dtype).affine(0.3, 0.0).unwrap());
    let head = tape.leaf(rand(&[vocab, d], 6, dtype));
    let positions: Vec<usize> = (0..n).collect();
    let (cos, sin) = rope_tables(&positions, &default_inv_freq(hd, 10000.0), dtype, &Device::Cpu).unwrap();
    let (cos, sin) = (tape.constant(cos), tape.constant(sin));
    let y = rms_norm::rms_norm(&tape, &x, &w_norm, 1e-5).unwrap();
    let heads = autosp_core::ops::reshape(&tape, &y, (b, n, h, hd)).unwrap();
    let r = rope::rope(&tape, &heads, &cos, &sin).unwrap();
    let r = autosp_core::ops::reshape(&tape, &r, (b * n, d)).unwrap();
    // 7 rows in chunks of 3: the last chunk is short.
    let m = chunked_mlp(&tape, &r, &wg, &wu, &wd, 3).unwrap();
    let targets = Tensor::new(&[3i64, -100, 0, 18, 7, -100, 11], &Device::Cpu).unwrap();
    let (loss, count) = chunked_cross_entropy(&tape, &m, &head, &tape.constant(targets), 3).unwrap();
    tape.backward(&loss).unwrap();
    let grad = |v: &Value| tape.grad(v).unwrap().expect("a gradient");
    let mut out = vec![loss.tensor().clone(), Tensor::new(count as u32, &Device::Cpu).unwrap()];
    out.extend([&x, &w_norm, &wg, &wu, &wd, &head].into_iter().map(grad));
    out
}

/// Ring attention (P = 2, zigzag, causal) forward on thread ranks: each rank's `(o, lse)`.
fn ring(dtype: DType) -> Vec<(Tensor, Tensor)> {
    let (b, n, h, d, p) = (1, 16, 2, 8, 2);
    let (q, k, v) = (rand(&[b, n, h, d], 7, dtype), rand(&[b, n, h, d], 8, dtype), rand(&[b, n, h, d], 9, dtype));
    run_ranks(p, Duration::from_secs(30), |world| {
        let r = world.rank();
        let local = |t: &Tensor| shard(t, 1, SeqLayout::Zigzag, p, r).unwrap();
        let op = RingAttention::new(Arc::clone(&world), RingLayout::Zigzag).as_op(&AttentionSpec::causal()).unwrap();
        let out = op.forward(&[&local(&q), &local(&k), &local(&v)]).unwrap();
        (out[0].clone(), out[1].clone())
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

#[test]
fn forcing_the_generic_kernels_gives_the_fast_kernels_results() {
    // The API wins over AUTOSP_KERNELS: the references are the fast kernels even under AUTOSP_KERNELS=generic.
    set_kernels(Kernels::Auto);
    assert_eq!(kernels(), Kernels::Auto);
    let dtypes = [DType::F32, DType::F64, DType::BF16];
    let fast: Vec<_> = dtypes.iter().map(|&dt| (block(dt), ring(dt))).collect();
    // An out-of-range target: the fast kernel's error (it reads the targets on the host).
    let h = rand(&[3, 4], 1, DType::F32);
    let bad = Tensor::new(&[0i64, 9, 1], &Device::Cpu).unwrap();
    let fast_err =
        autosp_kernels::chunked_cross_entropy_forward(&h, &rand(&[5, 4], 2, DType::F32), &bad, 2).unwrap_err();

    set_kernels(Kernels::Generic);
    assert_eq!(kernels(), Kernels::Generic);
    // The loss took the generic path: its error reports the count of bad targets (one scalar read back).
    let generic_err =
        autosp_kernels::chunked_cross_entropy_forward(&h, &rand(&[5, 4], 2, DType::F32), &bad, 2).unwrap_err();
    assert!(!fast_err.to_string().contains("targets are"), "{fast_err}");
    assert!(generic_err.to_string().contains("target 9 is out of range for 5 classes (1 targets are"), "{generic_err}");

    let names = ["loss", "count", "dx", "d_norm_weight", "d_w_gate", "d_w_up", "d_w_down", "d_lm_head"];
    for (&dt, (fast_block, fast_ring)) in dtypes.iter().zip(&fast) {
        let generic_block = block(dt);
        for ((name, a), b) in names.iter().zip(&generic_block).zip(fast_block) {
            let t = block_tol(name, dt);
            let e = max_rel(a, b);
            assert!(e <= t, "{name} ({dt:?}): generic vs fast max relative error {e} > {t}");
        }
        // The loss is f32 (f64 for f64) whatever the hidden dtype.
        assert_eq!(generic_block[0].dtype(), if dt == DType::F64 { DType::F64 } else { DType::F32 });
        for (rank, ((go, glse), (fo, flse))) in ring(dt).iter().zip(fast_ring).enumerate() {
            let (eo, el) = (max_rel(go, fo), max_rel(glse, flse));
            let t = attention_tol(dt);
            assert!(eo <= t && el <= t, "ring rank {rank} ({dt:?}): o {eo}, lse {el}");
        }
    }
    set_kernels(Kernels::Auto);
}
