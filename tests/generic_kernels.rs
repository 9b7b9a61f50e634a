//! The whole compiled model with the device-generic kernels forced (`set_kernels(Kernels::Generic)`, what
//! `AUTOSP_KERNELS=generic` does) against the fast CPU kernels: one training step (loss, every gradient, the
//! parameters after AdamW) at P = 1, 2 (Ulysses, Ring) and 4 (hybrid), under sequence-aware checkpointing
//! (so the chunked MLP, the fused Ulysses op and Ring's merge run) and under no checkpointing.
//!
//! Tolerance 1e-5 relative to the largest element (loss and gradients; 1e-4 on the parameters after AdamW,
//! see `common::assert_close`): the generic kernels compute the same maths in f32 with another summation
//! order (candle's matmuls, whole-tile reductions), so the results differ by f32 rounding, not by more.
//!
//! The kernel switch is process-wide: this file is its own test binary, and its one test runs the two paths
//! one after the other.

mod common;

use autosp::compile::Strategy;
use autosp::kernels::dispatch::generic_calls;
use autosp::kernels::{kernels, set_kernels, Kernels};
use autosp_core::CheckpointPolicy;
use autosp_models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device};

fn tiny() -> LlamaModel {
    // 4 heads, 2 kv heads (< P = 4: Ulysses replicates them), vocab 128.
    let spec = TinySpec { hidden: 32, intermediate: 64, ..TinySpec::default() };
    let cfg = spec.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, 11, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

#[test]
fn compiled_model_on_generic_kernels_equals_the_cpu_kernels() {
    let n = 50;
    let cases =
        [(1, Strategy::Ulysses), (2, Strategy::Ulysses), (2, Strategy::Ring), (4, Strategy::Hybrid { ulysses: 2 })];
    for policy in [CheckpointPolicy::SequenceAware, CheckpointPolicy::None] {
        for (p, s) in cases {
            set_kernels(Kernels::Auto);
            let calls = generic_calls();
            let fast = common::compiled(tiny, p, n, s, policy);
            assert_eq!(generic_calls(), calls, "the CPU run must not touch a generic kernel");
            set_kernels(Kernels::Generic);
            assert_eq!(kernels(), Kernels::Generic);
            let generic = common::compiled(tiny, p, n, s, policy);
            // Every kernel of the step (norms, RoPE, SwiGLU/MLP, attention, loss) went through the dispatch.
            assert!(generic_calls() > calls, "forcing the generic kernels must route calls to them");
            set_kernels(Kernels::Auto);
            common::assert_close(&format!("generic vs CPU kernels, P={p} {s:?} {policy:?}"), &generic, &fast, 1e-5);
        }
    }
}
