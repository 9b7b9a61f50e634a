//! Model and optimizer state on CUDA (feature `cuda`, on a machine with a CUDA GPU; `scripts/gpu_check.sh`
//! runs it): a parameter refuses a tensor from another device instead of moving to it, and AdamW restores a
//! checkpoint's moments (read on the host) onto the parameter's GPU, so the next step runs on one device.
//! `cargo test --release --features cuda --test cuda_state`.

#![cfg(feature = "cuda")]

use autosp_core::optim::{AdamW, AdamWConfig, Optimizer};
use autosp_core::{Gradients, Param};
use candle_core::{DType, Device, Tensor};

fn gpu() -> Device {
    Device::new_cuda(0).expect("this test needs a CUDA GPU (and a build with --features cuda)")
}

#[test]
fn a_cuda_parameter_refuses_a_cpu_tensor() {
    let p = Param::new("w", Tensor::zeros((2, 3), DType::F32, &gpu()).unwrap());
    let e = p.set(Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap()).unwrap_err().to_string();
    assert!(e.contains("move it with `to_device`"), "{e}");
    assert!(p.tensor().device().is_cuda(), "the parameter stays on the GPU");
}

#[test]
fn restored_moments_and_masters_move_to_the_parameters_gpu() {
    let dev = gpu();
    for dtype in [DType::F32, DType::BF16] {
        let p = Param::new("w", Tensor::ones((4, 5), dtype, &dev).unwrap());
        let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
        // As a checkpoint gives them: on the host.
        let host = |v: f32| Tensor::full(v, (4, 5), &Device::Cpu).unwrap();
        opt.set_state(3, &p, host(0.1), host(0.01)).unwrap();
        if dtype == DType::BF16 {
            opt.set_master(&p, &host(1.5)).unwrap();
            assert!(opt.master(&p).unwrap().device().is_cuda());
        }
        let (m, v) = opt.moments(&p).unwrap();
        assert!(m.device().is_cuda() && v.device().is_cuda(), "{dtype:?}: moments on the GPU");
        let mut grads = Gradients::new();
        grads.insert(&p, Tensor::full(0.5f32, (4, 5), &dev).unwrap());
        opt.step(std::slice::from_ref(&p), &grads, 1e-2).unwrap();
        assert!(p.tensor().device().is_cuda(), "{dtype:?}: the step kept the parameter on the GPU");
    }
}
