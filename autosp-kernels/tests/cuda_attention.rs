//! CUDA attention (feature `cuda`, on a machine with a CUDA GPU of compute capability >= 8.0): the inference
//! output (`attention_output`: candle-flash-attn with feature `flash-attn`, the generic kernel without)
//! against the CPU flash kernel on the same bf16 inputs (widened to f32 on the
//! CPU), for causal and full attention, MHA and GQA, and KV-cache decoding (one query after a prefix); and the
//! device-generic kernel, which serves the LSE, the backward and whatever candle-flash-attn does not take on
//! CUDA, against the CPU kernel: forward o and lse, backward dq/dk/dv with d_lse, f32 and bf16. Run with
//! `cargo test --release --features cuda -p autosp-kernels --test cuda_attention` (add `flash-attn` for
//! candle-flash-attn).
//!
//! Tolerances (max relative error: `max |x - y| / max |y|`): candle-flash-attn 2e-2 (the inputs are bf16, 8
//! bits of mantissa, and flash-attn keeps P in bf16 for the PV product, so each output element carries a
//! relative error of about 2^-8 per term). Generic f32 1e-4 (both accumulate in f32, in different orders;
//! cuBLAS may split the sums differently from the CPU's). Generic bf16 2^-7 (both compute in f32 from the
//! same bf16 inputs and round the results to bf16, whose ulp is 2^-8 of the element).
#![cfg(feature = "cuda")]

use autosp_core::gradcheck::probe;
use autosp_core::ops::AttentionSpec;
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
    for (i, (nq, nk, h, hkv, d, spec)) in cases.into_iter().enumerate() {
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
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 1.0 / 128.0)] {
        for (i, (nq, nk, h, hkv, d, spec)) in cases.into_iter().enumerate() {
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
