//! `Tape::trace_memory`: the held bytes after every increase. The peak is the largest entry, an untraced tape
//! records nothing, and the same program at two lengths gives traces of the same length whose entries are
//! affine in the length (what the compile step's planner extrapolates from).

use autosp_core::ops;
use autosp_core::{CheckpointPolicy, Param, Tape};
use candle_core::{DType, Device, Tensor};

/// A small MLP step on `x: [n, 8]`; returns the trace and the peak.
fn step(n: usize, trace: bool) -> (Vec<usize>, usize) {
    let w1 = Param::new("w1", Tensor::ones((16, 8), DType::F32, &Device::Cpu).unwrap());
    let w2 = Param::new("w2", Tensor::ones((8, 16), DType::F32, &Device::Cpu).unwrap());
    let tape = Tape::new(CheckpointPolicy::None);
    if trace {
        tape.trace_memory();
    }
    let x = tape.constant(Tensor::ones((n, 8), DType::F32, &Device::Cpu).unwrap());
    let h = ops::silu(&tape, &ops::linear(&tape, &x, &tape.param(&w1).unwrap(), None).unwrap()).unwrap();
    let y = ops::linear(&tape, &h, &tape.param(&w2).unwrap(), None).unwrap();
    let loss = ops::sum_all(&tape, &ops::mul(&tape, &y, &y).unwrap()).unwrap();
    tape.backward(&loss).unwrap();
    (tape.memory_trace(), tape.memory().peak_bytes)
}

#[test]
fn trace_holds_every_increase_and_is_affine_in_length() {
    assert!(step(32, false).0.is_empty(), "an untraced tape records nothing");
    let runs: Vec<(Vec<usize>, usize)> = [32, 64, 96].iter().map(|&n| step(n, true)).collect();
    for (trace, peak) in &runs {
        assert!(!trace.is_empty());
        assert_eq!(trace.iter().max(), Some(peak), "the peak is reached at an increase");
    }
    let (a, b, c) = (&runs[0].0, &runs[1].0, &runs[2].0);
    assert_eq!((a.len(), b.len()), (c.len(), c.len()), "the same program gives traces of the same length");
    for i in 0..a.len() {
        // Equal steps in n give equal steps in bytes: exact integers, no tolerance.
        assert_eq!(b[i] as i64 - a[i] as i64, c[i] as i64 - b[i] as i64, "moment {i} is not affine in n");
    }
}
