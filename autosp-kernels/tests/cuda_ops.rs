//! The device-generic kernels on CUDA (feature `cuda`, on a machine with a CUDA GPU): every op of the
//! training path but attention (`cuda_attention.rs` has it) run on the GPU through its public function (the
//! dispatch sends CUDA tensors to the generic path) against the fast CPU kernel on the same inputs, forward
//! and backward, in f32 and bf16: RMSNorm, RoPE, SwiGLU, the chunked SwiGLU MLP, the chunked linear +
//! cross-entropy and the Ring LSE merge. Run by `scripts/gpu_check.sh`, or with
//! `cargo test --release --features cuda -p autosp-kernels --test cuda_ops`.
//!
//! "max relative error" is `max_i |x_i - y_i| / max_i |y_i|`. Tolerances: f32 1e-4 (cuBLAS may sum matmuls in
//! another order, and with TF32 off candle's CUDA matmuls are true f32: a few ulps of the largest element, with
//! room for the longer reductions of the loss); bf16 2^-6 (both sides widen bf16 to f32, compute and round
//! back: one or two bf16 ulps of the largest element).
#![cfg(feature = "cuda")]

use autosp_core::gradcheck::probe;
use autosp_core::ops::rope::{default_inv_freq, rope_tables};
use autosp_kernels::merge::RunningAttention;
use autosp_kernels::mlp::{chunked_mlp_backward, chunked_mlp_forward};
use autosp_kernels::{chunked_cross_entropy_backward, chunked_cross_entropy_forward, rms_norm, rope, swiglu};
use candle_core::{DType, Device, Tensor};

fn gpu() -> Device {
    Device::new_cuda(0).expect("this test needs a CUDA GPU (and a build with --features cuda)")
}

fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

fn on(t: &Tensor, dev: &Device) -> Tensor {
    t.to_device(dev).unwrap()
}

fn max_rel(gpu: &Tensor, cpu: &Tensor) -> f64 {
    assert_eq!(gpu.dims(), cpu.dims());
    assert!(!gpu.device().is_cpu(), "the GPU result must stay on the GPU");
    let a = gpu.to_device(&Device::Cpu).unwrap().to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = cpu.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let (a, b) = (a.to_vec1::<f64>().unwrap(), b.to_vec1::<f64>().unwrap());
    assert!(a.iter().all(|v| v.is_finite()), "non-finite element on the GPU");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn check(what: &str, gpu: &Tensor, cpu: &Tensor, dtype: DType) {
    let tol = if dtype == DType::BF16 { 2f64.powi(-6) } else { 1e-4 };
    let e = max_rel(gpu, cpu);
    eprintln!("{what} {dtype:?}: max relative error {e:.2e}");
    assert!(e <= tol, "{what} ({dtype:?}): CUDA vs CPU max relative error {e} > {tol}");
}

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

#[test]
fn norm_rope_swiglu_on_cuda_equal_the_cpu_kernels() {
    let dev = gpu();
    for dtype in DTYPES {
        let (x, w, g) = (
            rand(&[3, 50, 64], 1, dtype),
            rand(&[64], 2, dtype).affine(0.5, 1.0).unwrap(),
            rand(&[3, 50, 64], 3, dtype),
        );
        let y = rms_norm::rms_norm_forward(&x, &w, 1e-5).unwrap();
        check("rms_norm forward", &rms_norm::rms_norm_forward(&on(&x, &dev), &on(&w, &dev), 1e-5).unwrap(), &y, dtype);
        let (dx, dw) = rms_norm::rms_norm_backward(&x, &w, &g, 1e-5, None).unwrap();
        let (gdx, gdw) = rms_norm::rms_norm_backward(&on(&x, &dev), &on(&w, &dev), &on(&g, &dev), 1e-5, None).unwrap();
        check("rms_norm dx", &gdx, &dx, dtype);
        check("rms_norm dw", &gdw, &dw, dtype);

        let (b, n, h, d) = (2, 40, 4, 32);
        let positions: Vec<usize> = (5..5 + n).collect();
        let (cos, sin) = rope_tables(&positions, &default_inv_freq(d, 10000.0), dtype, &Device::Cpu).unwrap();
        let x = rand(&[b, n, h, d], 4, dtype);
        let y = rope::rope_forward(&x, &cos, &sin).unwrap();
        check("rope forward", &rope::rope_forward(&on(&x, &dev), &on(&cos, &dev), &on(&sin, &dev)).unwrap(), &y, dtype);
        let dy = rope::rope_backward(&x, &cos, &sin).unwrap();
        check(
            "rope backward",
            &rope::rope_backward(&on(&x, &dev), &on(&cos, &dev), &on(&sin, &dev)).unwrap(),
            &dy,
            dtype,
        );

        let (gate, up, g) = (rand(&[70, 96], 5, dtype), rand(&[70, 96], 6, dtype), rand(&[70, 96], 7, dtype));
        check(
            "swiglu forward",
            &swiglu::swiglu_forward(&on(&gate, &dev), &on(&up, &dev)).unwrap(),
            &swiglu::swiglu_forward(&gate, &up).unwrap(),
            dtype,
        );
        let (dg, du) = swiglu::swiglu_backward(&gate, &up, &g).unwrap();
        let (gdg, gdu) = swiglu::swiglu_backward(&on(&gate, &dev), &on(&up, &dev), &on(&g, &dev)).unwrap();
        check("swiglu d_gate", &gdg, &dg, dtype);
        check("swiglu d_up", &gdu, &du, dtype);
    }
}

#[test]
fn chunked_mlp_and_loss_on_cuda_equal_the_cpu_kernels() {
    let dev = gpu();
    for dtype in DTYPES {
        let (m, hid, inter) = (90, 48, 80);
        let x = rand(&[m, hid], 1, dtype);
        let (wg, wu, wd) =
            (rand(&[inter, hid], 2, dtype), rand(&[inter, hid], 3, dtype), rand(&[hid, inter], 4, dtype));
        let dy = rand(&[m, hid], 5, dtype);
        let g = |t: &Tensor| on(t, &dev);
        check(
            "chunked_mlp forward",
            &chunked_mlp_forward(&g(&x), &g(&wg), &g(&wu), &g(&wd), 32).unwrap(),
            &chunked_mlp_forward(&x, &wg, &wu, &wd, 32).unwrap(),
            dtype,
        );
        let cpu = chunked_mlp_backward(&x, &wg, &wu, &wd, &dy, 32).unwrap();
        let cuda = chunked_mlp_backward(&g(&x), &g(&wg), &g(&wu), &g(&wd), &g(&dy), 32).unwrap();
        for (name, a, b) in
            [("dx", &cuda.0, &cpu.0), ("dwg", &cuda.1, &cpu.1), ("dwu", &cuda.2, &cpu.2), ("dwd", &cuda.3, &cpu.3)]
        {
            check(&format!("chunked_mlp {name}"), a, b, dtype);
        }

        let (rows, vocab) = (45, 130);
        let hidden = rand(&[rows, hid], 6, dtype);
        let head = rand(&[vocab, hid], 7, dtype);
        let t: Vec<i64> = (0..rows as i64).map(|i| if i % 9 == 4 { -100 } else { (i * 37) % vocab as i64 }).collect();
        let targets = Tensor::new(t, &Device::Cpu).unwrap();
        let (loss, count) = chunked_cross_entropy_forward(&hidden, &head, &targets, 16).unwrap();
        let (gloss, gcount) = chunked_cross_entropy_forward(&g(&hidden), &g(&head), &g(&targets), 16).unwrap();
        assert_eq!(gcount, count);
        assert_eq!(gloss.dtype(), loss.dtype(), "the loss stays in f32 whatever the hidden dtype");
        check("chunked loss", &gloss, &loss, DType::F32);
        let (dh, dw) = chunked_cross_entropy_backward(&hidden, &head, &targets, 16, 0.5).unwrap();
        let (gdh, gdw) = chunked_cross_entropy_backward(&g(&hidden), &g(&head), &g(&targets), 16, 0.5).unwrap();
        check("chunked loss d_hidden", &gdh, &dh, dtype);
        check("chunked loss d_lm_head", &gdw, &dw, dtype);
    }
}

#[test]
fn ring_merge_on_cuda_equals_the_cpu_merge() {
    let dev = gpu();
    let (b, n, h, d) = (1, 20, 3, 16);
    let (o_a, o_b) = (rand(&[b, n, h, d], 1, DType::F32), rand(&[b, n, h, d], 2, DType::F32));
    let (la, lb) = (rand(&[b, h, n], 3, DType::F32), rand(&[b, h, n], 4, DType::F32).affine(1.0, 0.3).unwrap());
    let mut cpu = RunningAttention::new(&o_a, &la).unwrap();
    cpu.merge(&o_b, &lb).unwrap();
    let (o, lse) = cpu.finish().unwrap();
    let mut cuda = RunningAttention::new(&on(&o_a, &dev), &on(&la, &dev)).unwrap();
    cuda.merge(&on(&o_b, &dev), &on(&lb, &dev)).unwrap();
    let (go, glse) = cuda.finish().unwrap();
    check("merge o", &go, &o, DType::F32);
    check("merge lse", &glse, &lse, DType::F32);
}
