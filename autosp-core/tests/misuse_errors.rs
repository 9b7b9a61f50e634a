//! Bad use of the tape gets a typed error that says what to do.

use autosp_core::ops;
use autosp_core::{CheckpointPolicy, Error, Param, Tape};
use candle_core::{Device, Tensor};

fn ones(shape: &[usize]) -> Tensor {
    Tensor::ones(shape, candle_core::DType::F32, &Device::Cpu).unwrap()
}

#[test]
fn backward_twice_without_retaining() {
    let tape = Tape::new(CheckpointPolicy::None);
    let x = tape.leaf(ones(&[3]));
    let y = ops::sum_all(&tape, &ops::exp(&tape, &x).unwrap()).unwrap();
    tape.backward_retained(&y).unwrap();
    tape.backward(&y).unwrap();
    // Two passes accumulated: 2 * e.
    let g = tape.grad(&x).unwrap().unwrap().to_vec1::<f32>().unwrap();
    assert!((g[0] - 2.0 * std::f32::consts::E).abs() < 1e-5);
    let e = tape.backward(&y).unwrap_err();
    assert!(matches!(e, Error::BackwardTwice), "{e}");
    assert!(e.to_string().contains("backward_retained"));
}

#[test]
fn shape_mismatch_names_both_shapes() {
    let tape = Tape::new(CheckpointPolicy::None);
    let x = tape.leaf(ones(&[2, 3]));
    let w = tape.param(&Param::new("w", ones(&[4, 5]))).unwrap();
    let e = ops::linear(&tape, &x, &w, None).unwrap_err();
    match &e {
        Error::ShapeMismatch(m) => {
            assert_eq!(m.lhs, vec![2, 3]);
            assert_eq!(m.rhs, vec![4, 5]);
        }
        other => panic!("expected ShapeMismatch, got {other}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("[4, 5]"), "{msg}");
}

#[test]
fn gradient_of_a_non_leaf() {
    let tape = Tape::new(CheckpointPolicy::None);
    let x = tape.leaf(ones(&[3]));
    let y = ops::exp(&tape, &x).unwrap();
    let s = ops::sum_all(&tape, &y).unwrap();
    tape.backward(&s).unwrap();
    let e = tape.grad(&y).unwrap_err();
    assert!(matches!(e, Error::NotALeaf { op: "exp", .. }), "{e}");
    assert!(e.to_string().contains("leaf"));
}

#[test]
fn unbalanced_regions() {
    let tape = Tape::new(CheckpointPolicy::Full);
    assert!(matches!(tape.end_region(), Err(Error::UnbalancedRegion { .. })));
    tape.begin_region("a").unwrap();
    let e = tape.begin_region("b").unwrap_err();
    assert!(matches!(e, Error::UnbalancedRegion { .. }) && e.to_string().contains("`a`"), "{e}");
    let x = tape.leaf(ones(&[2]));
    let y = ops::sum_all(&tape, &ops::exp(&tape, &x).unwrap()).unwrap();
    let e = tape.backward(&y).unwrap_err();
    assert!(matches!(e, Error::UnbalancedRegion { .. }) && e.to_string().contains("end_region"), "{e}");
    tape.end_region().unwrap();
    tape.backward(&y).unwrap();
}

#[test]
fn backward_from_non_scalar_needs_a_seed() {
    let tape = Tape::new(CheckpointPolicy::None);
    let x = tape.leaf(ones(&[2, 2]));
    let y = ops::exp(&tape, &x).unwrap();
    assert!(matches!(tape.backward(&y), Err(Error::NotScalar { .. })));
    let seed = Tensor::new(&[[1f32, 0.], [0., 2.]], &Device::Cpu).unwrap();
    tape.backward_with_grad(&y, &seed, false).unwrap();
    let g = tape.grad(&x).unwrap().unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(g[0][1], 0.0);
    assert!((g[1][1] - 2.0 * std::f32::consts::E).abs() < 1e-5);
}

#[test]
fn inference_tape_records_nothing() {
    let tape = Tape::inference();
    let x = tape.leaf(ones(&[3]));
    let y = ops::sum_all(&tape, &ops::exp(&tape, &x).unwrap()).unwrap();
    assert!(!y.is_tracked());
    assert_eq!(tape.node_count(), 0);
    assert!(matches!(tape.backward(&y), Err(Error::InferenceMode)));
}

#[test]
fn values_from_another_tape_are_rejected() {
    let a = Tape::new(CheckpointPolicy::None);
    let b = Tape::new(CheckpointPolicy::None);
    let x = a.leaf(ones(&[3]));
    assert!(matches!(ops::exp(&b, &x), Err(Error::ForeignValue { .. })));
}
