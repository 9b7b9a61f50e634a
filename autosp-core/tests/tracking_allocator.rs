//! The tracking allocator, installed as this test binary's global allocator, sees allocations and frees.

use autosp_core::TrackingAllocator;

#[global_allocator]
static ALLOC: TrackingAllocator = TrackingAllocator::new();

#[test]
fn counts_live_and_peak_bytes() {
    ALLOC.reset_peak();
    let before = ALLOC.live_bytes();
    let big = vec![1u8; 64 << 20];
    assert!(ALLOC.live_bytes() >= before + (64 << 20));
    let peak = ALLOC.peak_bytes();
    assert!(peak >= before + (64 << 20));
    drop(big);
    assert!(ALLOC.live_bytes() < before + (64 << 20));
    // The peak remembers the 64 MiB after they are freed, until reset.
    assert_eq!(ALLOC.peak_bytes().max(peak), ALLOC.peak_bytes());
    ALLOC.reset_peak();
    assert!(ALLOC.peak_bytes() < before + (64 << 20));
    // A tensor's storage goes through the allocator too.
    let t = candle_core::Tensor::zeros((1024, 1024), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    assert!(ALLOC.peak_bytes() >= 4 << 20);
    drop(t);
}
