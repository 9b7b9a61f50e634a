//! CUDA attention (feature `cuda`, on a machine with a CUDA GPU of compute capability >= 8.0): the inference
//! output (`attention_output`: candle-flash-attn with feature `flash-attn`, the generic kernel without)
//! against the CPU flash kernel on the same bf16 inputs (widened to f32 on the
//! CPU), for causal and full attention, MHA and GQA, and KV-cache decoding (one query after a prefix); and the
//! device-generic kernel, which serves the LSE, the backward and whatever candle-flash-attn does not take on
//! CUDA, against the CPU kernel: forward o and lse, backward dq/dk/dv with d_lse, f32 and bf16, with its
//! default tiles and with small ones (`generic_*_with_block`) so that several query blocks, several key
//! chunks, masked chunks, dK/dV summed across chunks, sliding windows, GQA/MQA and sink keys run on the GPU.
//! Run with `cargo test --release --features cuda -p autosp-kernels --test cuda_attention` (add `flash-attn`
//! for candle-flash-attn).
//!
//! Tolerances (max relative error: `max |x - y| / max |y|`): candle-flash-attn 2e-2 (the inputs are bf16, 8
//! bits of mantissa, and flash-attn keeps P in bf16 for the PV product, so each output element carries a
//! relative error of about 2^-8 per term). Generic f32 1e-4 (both accumulate in f32, in different orders;
//! cuBLAS may split the sums differently from the CPU's, and may use TF32 only if candle is told to). Generic
//! bf16 3e-2: its tile products are bf16 GEMMs whose results are rounded to bf16 before the f32 softmax, so
//! the scores carry `|S| · 2^-9` in the exponent and P, dS a relative 2^-9 as operands (about 1e-2 of the
//! largest element for scores of a few units; the CPU test `generic_attention.rs` measured 1.45e-2 at worst);
//! with sink keys, whose scores reach far higher, `|S|max · 2^-9` when that is larger.
#![cfg(feature = "cuda")]

use autosp_core::gradcheck::probe;
use autosp_core::ops::attention::AttentionDims;
use autosp_core::ops::AttentionSpec;
use autosp_kernels::attention::{generic_backward_with_block, generic_forward_with_block, TileSize, CHUNK_BUDGET_GPU};
use autosp_kernels::{attention_backward, attention_forward, attention_output};
use candle_core::{DType, Device, Tensor};

fn bf16(shape: &[usize], seed: u64) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap()
}

fn rel(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
    let d = (&a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn cuda_output_matches_the_cpu_kernel() {
    let gpu = Device::new_cuda(0).expect("this test needs a CUDA GPU");
    // (q_len, k_len, heads, kv_heads, head_dim, spec)
    let cases = [
        (300, 300, 8, 8, 64, AttentionSpec::causal()),
        (300, 300, 8, 2, 128, AttentionSpec::causal()),
        (200, 260, 4, 4, 64, AttentionSpec::full()),
        // KV-cache decoding: one query at position 259 against keys 0..260.
        (1, 260, 8, 4, 64, AttentionSpec { q_offset: 259, ..AttentionSpec::causal() }),
    ];
    for (i, (nq, nk, h, hkv, d, spec)) in cases.iter().cloned().enumerate() {
        let seed = 10 * i as u64;
        let (q, k, v) =
            (bf16(&[1, nq, h, d], seed), bf16(&[1, nk, hkv, d], seed + 1), bf16(&[1, nk, hkv, d], seed + 2));
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let (want, _) = attention_forward(&f32s(&q), &f32s(&k), &f32s(&v), &spec).unwrap();
        let on = |t: &Tensor| t.to_device(&gpu).unwrap();
        let got = attention_output(&on(&q), &on(&k), &on(&v), &spec).unwrap();
        assert_eq!(got.dims(), want.dims());
        assert_eq!(got.dtype(), DType::BF16);
        let e = rel(&got.to_device(&Device::Cpu).unwrap(), &want);
        assert!(e <= 2e-2, "case {i}: CUDA output off by {e} of the largest element (tolerance 2e-2)");
    }
}

/// The LSE and the gradients on CUDA (the generic kernel) against the CPU kernel on the same inputs; and an
/// f32 output, which candle-flash-attn does not take, from the generic kernel.
#[test]
fn generic_kernel_on_cuda_matches_the_cpu_kernel() {
    let gpu = Device::new_cuda(0).expect("this test needs a CUDA GPU");
    let cases = [
        (300, 300, 8, 8, 64, AttentionSpec::causal()),
        (300, 300, 8, 2, 128, AttentionSpec::causal()),
        (200, 260, 4, 4, 64, AttentionSpec::full()),
        // A Ring shard: queries at 128.. against keys at 64.. (no candle-flash-attn window expresses it).
        (100, 150, 4, 2, 64, AttentionSpec { q_offset: 128, k_offset: 64, ..AttentionSpec::causal() }),
    ];
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2)] {
        for (i, (nq, nk, h, hkv, d, spec)) in cases.iter().cloned().enumerate() {
            let seed = 100 + 10 * i as u64;
            let t = |shape: &[usize], s: u64| probe(shape, s, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let (q, k, v) = (t(&[1, nq, h, d], seed), t(&[1, nk, hkv, d], seed + 1), t(&[1, nk, hkv, d], seed + 2));
            let d_o = t(&[1, nq, h, d], seed + 3);
            let d_lse = probe(&[1, h, nq], seed + 4, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
            let (o, lse) = attention_forward(&q, &k, &v, &spec).unwrap();
            let want = attention_backward(&q, &k, &v, &o, &lse, &d_o, Some(&d_lse), &spec).unwrap();

            let on = |t: &Tensor| t.to_device(&gpu).unwrap();
            let back = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
            let (go, glse) = attention_forward(&on(&q), &on(&k), &on(&v), &spec).unwrap();
            assert!(go.device().is_cuda() && go.dtype() == dtype && glse.dtype() == DType::F32);
            let got =
                attention_backward(&on(&q), &on(&k), &on(&v), &on(&o), &on(&lse), &on(&d_o), Some(&on(&d_lse)), &spec)
                    .unwrap();
            let check = |name: &str, g: &Tensor, w: &Tensor| {
                let e = rel(&back(g), w);
                assert!(e <= tol, "{dtype:?} case {i}: {name} off by {e} of the largest element (tolerance {tol})");
            };
            check("o", &go, &o);
            check("lse", &glse, &lse);
            check("dq", &got.0, &want.0);
            check("dk", &got.1, &want.1);
            check("dv", &got.2, &want.2);
            if dtype == DType::F32 {
                let out = attention_output(&on(&q), &on(&k), &on(&v), &spec).unwrap();
                check("f32 output", &out, &o);
            }
        }
    }
}

/// The generic kernel on CUDA with small tiles (`block` query rows, 4 · `block` keys per chunk) against the
/// CPU kernel: several query blocks and key chunks, masked chunks on the diagonal and at a window's edges, dK
/// and dV summed across chunks, GQA and MQA, and sink keys (keys 0 and 200 scaled by 30, as the high-norm
/// BOS keys of real checkpoints). f32 against the CPU kernel in f32 on the same inputs; bf16 against the CPU
/// kernel in f32 on the same bf16 inputs widened, the generic backward reading its own forward's o and lse
/// (as training runs it).
#[test]
fn generic_kernel_on_cuda_with_small_tiles_matches_the_cpu_kernel() {
    let gpu = Device::new_cuda(0).expect("this test needs a CUDA GPU");
    // (q_len, k_len, heads, kv_heads, head_dim, spec, block, sink keys)
    let cases = [
        (520, 520, 8, 2, 64, AttentionSpec::causal(), 32, false),
        (400, 450, 4, 4, 64, AttentionSpec::full(), 64, false),
        (512, 512, 4, 1, 128, AttentionSpec::causal().with_max_distance(100), 32, false),
        (300, 300, 4, 2, 64, AttentionSpec::full().with_max_distance(50), 32, false),
        (384, 384, 8, 2, 64, AttentionSpec::causal(), 32, true),
        (600, 600, 4, 2, 64, AttentionSpec::full(), 64, true),
    ];
    for (dtype, base_tol) in [(DType::F32, 1e-4f64), (DType::BF16, 3e-2)] {
        for (i, (nq, nk, h, hkv, d, spec, block, sinks)) in cases.iter().cloned().enumerate() {
            let seed = 500 + 10 * i as u64;
            let f64s = |shape: &[usize], s: u64| probe(shape, s, &Device::Cpu).unwrap();
            let mut k = f64s(&[1, nk, hkv, d], seed + 1);
            if sinks {
                let mut scale = vec![1f64; nk];
                scale[0] = 30.0;
                scale[200] = 30.0;
                k = k.broadcast_mul(&Tensor::from_vec(scale, (1, nk, 1, 1), &Device::Cpu).unwrap()).unwrap();
            }
            let t = |x: &Tensor| x.to_dtype(dtype).unwrap();
            let (q, k, v) = (t(&f64s(&[1, nq, h, d], seed)), t(&k), t(&f64s(&[1, nk, hkv, d], seed + 2)));
            let d_o = t(&f64s(&[1, nq, h, d], seed + 3));
            let d_lse = f64s(&[1, h, nq], seed + 4).to_dtype(DType::F32).unwrap();
            // The reference: the CPU kernel in f32 on the same (rounded) inputs.
            let f32s = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
            let (o, lse) = attention_forward(&f32s(&q), &f32s(&k), &f32s(&v), &spec).unwrap();
            let want = attention_backward(&f32s(&q), &f32s(&k), &f32s(&v), &o, &lse, &f32s(&d_o), Some(&d_lse), &spec)
                .unwrap();
            // bf16 scores are rounded to bf16 by their GEMM: |S| · 2^-9 in the exponent.
            let tol = if dtype == DType::BF16 { base_tol.max(max_abs_score(&q, &k, &spec) / 512.0) } else { base_tol };

            let on = |x: &Tensor| x.to_device(&gpu).unwrap();
            let (gq, gk, gv) = (on(&q), on(&k), on(&v));
            let (go, glse) = generic_forward_with_block(&gq, &gk, &gv, &spec, block).unwrap();
            assert!(go.device().is_cuda() && go.dtype() == dtype && glse.dtype() == DType::F32);
            let got =
                generic_backward_with_block(&gq, &gk, &gv, &go, &glse, &on(&d_o), Some(&on(&d_lse)), &spec, block)
                    .unwrap();
            let check = |name: &str, g: &Tensor, w: &Tensor| {
                let e = rel(&g.to_device(&Device::Cpu).unwrap(), w) as f64;
                assert!(e <= tol, "{dtype:?} case {i}: {name} off by {e} of the largest element (tolerance {tol})");
            };
            check("o", &go, &o);
            check("lse", &glse, &lse);
            check("dq", &got.0, &want.0);
            check("dk", &got.1, &want.1);
            check("dv", &got.2, &want.2);
        }
    }
}

/// The largest `|q_i · k_j| · scale` over every pair of `q: [1, nq, h, d]` and `k: [1, nk, h_kv, d]` (on the
/// CPU, in f32).
fn max_abs_score(q: &Tensor, k: &Tensor, spec: &AttentionSpec) -> f64 {
    let (_, nq, h, d) = q.dims4().unwrap();
    let hkv = k.dim(2).unwrap();
    let heads_major = |t: &Tensor| t.to_dtype(DType::F32).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
    let q = heads_major(q).reshape((1, hkv, h / hkv * nq, d)).unwrap();
    let s = q.matmul(&heads_major(k).t().unwrap()).unwrap();
    let m = s.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    m * spec.scale_for(d)
}

/// The default tiles on a GPU: 1024 rows × 4096 keys while one score chunk fits `CHUNK_BUDGET_GPU`, halved
/// (keys first) when batch · heads grows.
#[test]
fn default_gpu_tiles_fit_the_chunk_budget() {
    let gpu = Device::new_cuda(0).expect("this test needs a CUDA GPU");
    let dims = |batch, heads| AttentionDims { batch, q_len: 8192, k_len: 8192, heads, kv_heads: heads, head_dim: 128 };
    assert_eq!(TileSize::for_call(&dims(1, 8), DType::F32, &gpu), TileSize { rows: 1024, keys: 4096 });
    assert_eq!(TileSize::for_call(&dims(1, 32), DType::F32, &gpu), TileSize { rows: 1024, keys: 2048 });
    for (b, h, dtype, bytes) in [(1, 32, DType::BF16, 6), (4, 32, DType::BF16, 6), (16, 64, DType::F32, 4)] {
        let t = TileSize::for_call(&dims(b, h), dtype, &gpu);
        assert!(t.rows.is_multiple_of(64) && t.keys.is_multiple_of(64), "{t:?}");
        assert!(b * h * t.rows * t.keys * bytes <= CHUNK_BUDGET_GPU, "{t:?} for batch {b}, heads {h}, {dtype:?}");
    }
}
