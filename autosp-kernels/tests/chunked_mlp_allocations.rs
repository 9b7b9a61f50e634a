//! The chunked MLP in bf16 holds no f32 copy of its weights, counted by the tracking global allocator as the
//! peak of live heap bytes while it runs, with large weights and few tokens (so weight-sized buffers
//! dominate). One CPU GEMM's own transients are allowed for: candle 0.11 widens a bf16 GEMM's operands to
//! f32 for the call and gemm packs the widened weight (two f32 weights at most, measured). The old path held
//! all three weights in f32 for the whole call on top of that: measured 2.12 MB forward and 4.22 MB / 3.42 MB
//! backward (two chunks / one) against 1.06 MB and 3.15 MB / 1.34 MB now, bounds 1.31 MB and 3.41 MB /
//! 2.10 MB. One test in this binary: the allocator is process-wide.

use autosp_core::alloc::TrackingAllocator;
use autosp_core::gradcheck::probe;
use autosp_kernels::mlp::{chunked_mlp_backward, chunked_mlp_forward};
use candle_core::{DType, Device, Tensor};

#[global_allocator]
static ALLOC: TrackingAllocator = TrackingAllocator::new();

fn rand(shape: &[usize], seed: u64) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap()
}

/// The peak of live heap bytes above those live before `f` runs, and its result.
fn peak_above<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let before = ALLOC.live_bytes();
    ALLOC.reset_peak();
    let out = f();
    (ALLOC.peak_bytes().saturating_sub(before), out)
}

#[test]
fn bf16_weights_are_not_held_in_f32() {
    // Weights [512, 256] (128 Ki elements: 256 KiB in bf16, 512 KiB in f32), 4 tokens in chunks of 2 and 4.
    let (d, f, m) = (256, 512, 4);
    let (wg, wu, wd) = (rand(&[f, d], 1), rand(&[f, d], 2), rand(&[d, f], 3));
    let (x, dy) = (rand(&[1, m, d], 4), rand(&[1, m, d], 5));
    let weight_f32 = f * d * 4;
    let weight_bf16 = f * d * 2;
    // A first run outside the measure: candle and gemm set up per-thread state on their first GEMM.
    chunked_mlp_backward(&x, &wg, &wu, &wd, &dy, 2).unwrap();
    // One GEMM's transients (see the module doc).
    let gemm = 2 * weight_f32;
    for chunk in [2, 4] {
        // The forward keeps nothing weight-sized: the GEMM's transients and [chunk, f] intermediates.
        let (bytes, y) = peak_above(|| chunked_mlp_forward(&x, &wg, &wu, &wd, chunk).unwrap());
        assert_eq!(y.dtype(), DType::BF16);
        assert!(bytes < gemm + weight_f32 / 2, "forward, chunks of {chunk}: peak {bytes} bytes above the start");
        // The backward keeps three bf16 weight gradients; with two chunks their running sums are f32 (gradients,
        // not weights: the accumulation dtype of the precision policy), and a sum being added holds one more.
        let (bytes, g) = peak_above(|| chunked_mlp_backward(&x, &wg, &wu, &wd, &dy, chunk).unwrap());
        assert!([&g.0, &g.1, &g.2, &g.3].iter().all(|t| t.dtype() == DType::BF16));
        let kept = if chunk < m { 4 * weight_f32 } else { 3 * weight_bf16 };
        assert!(
            bytes < kept + gemm + weight_f32 / 2,
            "backward, chunks of {chunk}: peak {bytes} bytes above the start"
        );
    }
}
