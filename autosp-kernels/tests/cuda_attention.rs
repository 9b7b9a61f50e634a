//! CUDA attention (feature `cuda`, on a machine with a CUDA GPU of compute capability >= 8.0):
//! candle-flash-attn's output against the CPU flash kernel on the same bf16 inputs (widened to f32 on the
//! CPU), for causal and full attention, MHA and GQA, and KV-cache decoding (one query after a prefix); asking
//! for the LSE or a gradient on CUDA is a typed error. Run with
//! `cargo test --release --features cuda -p autosp-kernels --test cuda_attention`.
//!
//! Tolerance: 2e-2 of the largest output element. The inputs are bf16 (8 bits of mantissa); flash-attn keeps
//! P in bf16 for the PV product, so each output element carries a relative error of about 2^-8 per term.
#![cfg(feature = "flash-attn")]

use autosp_core::gradcheck::probe;
use autosp_core::ops::AttentionSpec;
use autosp_kernels::{flash_attention_backward, flash_attention_forward, flash_attention_output, Error};
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
        let (want, _) = flash_attention_forward(&f32s(&q), &f32s(&k), &f32s(&v), &spec).unwrap();
        let on = |t: &Tensor| t.to_device(&gpu).unwrap();
        let got = flash_attention_output(&on(&q), &on(&k), &on(&v), &spec).unwrap();
        assert_eq!(got.dims(), want.dims());
        assert_eq!(got.dtype(), DType::BF16);
        let e = rel(&got.to_device(&Device::Cpu).unwrap(), &want);
        assert!(e <= 2e-2, "case {i}: CUDA output off by {e} of the largest element (tolerance 2e-2)");
    }
}

#[test]
fn lse_and_gradients_on_cuda_are_typed_errors() {
    let gpu = Device::new_cuda(0).expect("this test needs a CUDA GPU");
    let t = |seed| bf16(&[1, 64, 4, 64], seed).to_device(&gpu).unwrap();
    let (q, k, v) = (t(1), t(2), t(3));
    let spec = AttentionSpec::causal();
    assert!(matches!(flash_attention_forward(&q, &k, &v, &spec), Err(Error::CudaLse { .. })));
    let o = flash_attention_output(&q, &k, &v, &spec).unwrap();
    let lse = Tensor::zeros((1, 4, 64), DType::F32, &gpu).unwrap();
    let e = flash_attention_backward(&q, &k, &v, &o, &lse, &o, None, &spec);
    assert!(matches!(e, Err(Error::CudaBackward { .. })), "{e:?}");
    let f32q = q.to_dtype(DType::F32).unwrap();
    assert!(matches!(flash_attention_output(&f32q, &f32q, &f32q, &spec), Err(Error::CudaDType { .. })));
}
