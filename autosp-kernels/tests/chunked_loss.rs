//! The chunked linear + cross-entropy against autosp-core's `linear` + `cross_entropy`: loss, count and the
//! gradients of hidden and lm_head, with ignored targets and m not a multiple of the chunk; finite differences
//! in f64; determinism; the bytes the tape holds; bad shapes.
//!
//! Tolerances: f32 1e-6 of the largest element (the chunked loss sums token losses in f64 and exps in
//! eight lanes, candle's matmul and reductions sum in another order; d_hidden differs by 2.7e-7 of its largest
//! element); f64 1e-12.

use autosp_core::gradcheck::{check_gradients, probe};
use autosp_core::ops;
use autosp_core::{CheckpointPolicy, Error, MemoryStats, Param, Tape};
use autosp_kernels::{chunked_cross_entropy, chunked_cross_entropy_backward, chunked_cross_entropy_forward};
use candle_core::{DType, Device, Tensor};

fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Targets in [0, vocab) with every `skip`-th one ignored.
fn targets(m: usize, vocab: usize, skip: usize) -> Tensor {
    let t: Vec<i64> = (0..m).map(|i| if i % skip == 3 { -100 } else { ((i * 7919 + 13) % vocab) as i64 }).collect();
    Tensor::new(t, &Device::Cpu).unwrap()
}

/// `(loss, count, d_hidden, d_lm_head, memory after forward, memory after backward)`.
struct Run {
    loss: Tensor,
    count: usize,
    dh: Tensor,
    dw: Tensor,
    after_forward: MemoryStats,
    after_backward: MemoryStats,
}

fn run(hidden: &Tensor, lm_head: &Tensor, tg: &Tensor, chunk: Option<usize>) -> Run {
    let tape = Tape::new(CheckpointPolicy::None);
    let w = Param::new("lm_head", lm_head.clone());
    let (h, wv, t) = (tape.leaf(hidden.clone()), tape.param(&w).unwrap(), tape.constant(tg.clone()));
    let (loss, count) = match chunk {
        Some(c) => chunked_cross_entropy(&tape, &h, &wv, &t, c).unwrap(),
        None => ops::cross_entropy(&tape, &ops::linear(&tape, &h, &wv, None).unwrap(), &t).unwrap(),
    };
    let after_forward = tape.memory();
    tape.backward(&loss).unwrap();
    let after_backward = tape.memory();
    Run {
        loss: loss.tensor().clone(),
        count,
        dh: tape.grad(&h).unwrap().unwrap(),
        dw: tape.param_grads().get(&w).unwrap().clone(),
        after_forward,
        after_backward,
    }
}

#[test]
fn chunked_equals_linear_plus_cross_entropy_f32_and_f64() {
    // m = 37 is not a multiple of the chunk (8); every 5th target is ignored.
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12)] {
        let (m, d, vocab) = (37, 16, 50);
        let hidden = (rand(&[m, d], 1, dtype) * 2.0).unwrap();
        let lm_head = rand(&[vocab, d], 2, dtype);
        let tg = targets(m, vocab, 5);
        let c = run(&hidden, &lm_head, &tg, Some(8));
        let u = run(&hidden, &lm_head, &tg, None);
        assert_eq!(c.count, u.count);
        assert_eq!(c.count, (0..m).filter(|i| i % 5 != 3).count());
        assert_eq!(c.loss.dtype(), dtype);
        for (name, a, b) in [("loss", &c.loss, &u.loss), ("d_hidden", &c.dh, &u.dh), ("d_lm_head", &c.dw, &u.dw)] {
            let e = rel_diff(a, b);
            assert!(e <= tol, "{dtype:?} {name} differs by {e} (tolerance {tol})");
        }
    }
}

#[test]
fn chunk_size_does_not_change_the_result_and_runs_repeat_bit_for_bit() {
    let (m, d, vocab) = (29, 8, 31);
    let hidden = rand(&[m, d], 3, DType::F32);
    let lm_head = rand(&[vocab, d], 4, DType::F32);
    let tg = targets(m, vocab, 4);
    let a = run(&hidden, &lm_head, &tg, Some(1));
    let b = run(&hidden, &lm_head, &tg, Some(64));
    assert!(rel_diff(&a.loss, &b.loss) <= 1e-6 && rel_diff(&a.dh, &b.dh) <= 1e-6 && rel_diff(&a.dw, &b.dw) <= 1e-6);
    let c = run(&hidden, &lm_head, &tg, Some(1));
    assert_eq!(rel_diff(&a.loss, &c.loss), 0.0);
    assert_eq!(rel_diff(&a.dh, &c.dh), 0.0);
    assert_eq!(rel_diff(&a.dw, &c.dw), 0.0);
}

#[test]
fn chunked_loss_passes_gradcheck() {
    let (m, d, vocab) = (7, 4, 9);
    let hidden = rand(&[m, d], 5, DType::F64);
    let lm_head = rand(&[vocab, d], 6, DType::F64);
    let tg = targets(m, vocab, 4);
    let r = check_gradients(
        |t, v| Ok(vec![chunked_cross_entropy(t, &v[0], &v[1], &v[2], 3)?.0]),
        &[hidden, lm_head, tg],
        &[0, 1],
        1e-6,
        1e-7,
        1e-6,
    )
    .unwrap();
    assert_eq!(r.checked, m * d + vocab * d);
}

#[test]
fn all_targets_ignored_gives_zero_loss_and_gradients() {
    let hidden = rand(&[10, 4], 7, DType::F32);
    let lm_head = rand(&[6, 4], 8, DType::F32);
    let tg = Tensor::new(vec![-100i64; 10], &Device::Cpu).unwrap();
    let (loss, count) = chunked_cross_entropy_forward(&hidden, &lm_head, &tg, 3).unwrap();
    assert_eq!((loss.to_scalar::<f32>().unwrap(), count), (0.0, 0));
    let (dh, dw) = chunked_cross_entropy_backward(&hidden, &lm_head, &tg, 3, 1.0).unwrap();
    assert_eq!(dh.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    assert_eq!(dw.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
}

#[test]
fn tape_holds_under_an_eighth_of_the_unchunked_bytes() {
    let (m, d, vocab) = (1024, 32, 4096);
    let hidden = rand(&[m, d], 9, DType::F32);
    let lm_head = (rand(&[vocab, d], 10, DType::F32) * 0.1).unwrap();
    let tg = targets(m, vocab, 7);
    let c = run(&hidden, &lm_head, &tg, Some(128));
    let u = run(&hidden, &lm_head, &tg, None);
    assert!(rel_diff(&c.loss, &u.loss) <= 1e-6);
    // Unchunked: the [m, vocab] logits (16 MiB) are held after forward, and their gradient too in backward.
    assert!(u.after_forward.held_bytes >= m * vocab * 4);
    assert!(
        c.after_forward.held_bytes * 8 < u.after_forward.held_bytes,
        "{:?} vs {:?}",
        c.after_forward,
        u.after_forward
    );
    assert!(
        c.after_backward.peak_bytes * 8 < u.after_backward.peak_bytes,
        "{:?} vs {:?}",
        c.after_backward,
        u.after_backward
    );
}

#[test]
fn bad_input_is_a_typed_error_naming_the_shapes() {
    let hidden = rand(&[6, 4], 11, DType::F32);
    let lm_head = rand(&[9, 4], 12, DType::F32);
    let tg = targets(6, 9, 4);
    let msg = match chunked_cross_entropy_forward(&hidden, &rand(&[9, 5], 13, DType::F32), &tg, 2) {
        Err(e @ Error::ShapeMismatch(_)) => e.to_string(),
        other => panic!("expected a shape mismatch, got {other:?}"),
    };
    assert!(msg.contains("[6, 4]") && msg.contains("[9, 5]"), "{msg}");
    let msg = match chunked_cross_entropy_forward(&hidden, &lm_head, &targets(5, 9, 4), 2) {
        Err(e @ Error::ShapeMismatch(_)) => e.to_string(),
        other => panic!("expected a shape mismatch, got {other:?}"),
    };
    assert!(msg.contains("[6, 4]") && msg.contains("[5]"), "{msg}");
    let msg = match chunked_cross_entropy_forward(&hidden.unsqueeze(0).unwrap(), &lm_head, &tg, 2) {
        Err(e @ Error::ShapeMismatch(_)) => e.to_string(),
        other => panic!("expected a shape mismatch, got {other:?}"),
    };
    assert!(msg.contains("[1, 6, 4]"), "{msg}");
    assert!(matches!(chunked_cross_entropy_forward(&hidden, &lm_head, &tg, 0), Err(Error::InvalidArgument { .. })));
    let out_of_range = Tensor::new(vec![0i64, 1, 2, 9, 0, 0], &Device::Cpu).unwrap();
    let err = chunked_cross_entropy_forward(&hidden, &lm_head, &out_of_range, 2).unwrap_err().to_string();
    assert!(err.contains("target 9") && err.contains("9 classes"), "{err}");
}

#[test]
fn bf16_inputs_are_computed_in_f32() {
    // bf16 inputs are widened to f32 once; the results, rounded to bf16 (8 bits of mantissa), are within 2^-6
    // of the f32 results on the same (bf16-rounded) inputs.
    let (m, d, vocab) = (20, 8, 40);
    let hidden = rand(&[m, d], 14, DType::BF16);
    let lm_head = rand(&[vocab, d], 15, DType::BF16);
    let tg = targets(m, vocab, 6);
    let (h32, w32) = (hidden.to_dtype(DType::F32).unwrap(), lm_head.to_dtype(DType::F32).unwrap());
    let (l16, c16) = chunked_cross_entropy_forward(&hidden, &lm_head, &tg, 7).unwrap();
    let (l32, c32) = chunked_cross_entropy_forward(&h32, &w32, &tg, 7).unwrap();
    // The loss is a statistic: f32 for bf16 inputs, never rounded to bf16.
    assert_eq!((l16.dtype(), c16), (DType::F32, c32));
    assert!(rel_diff(&l16, &l32) < 2f64.powi(-6));
    let (dh16, dw16) = chunked_cross_entropy_backward(&hidden, &lm_head, &tg, 7, 1.0).unwrap();
    let (dh32, dw32) = chunked_cross_entropy_backward(&h32, &w32, &tg, 7, 1.0).unwrap();
    assert_eq!((dh16.dtype(), dw16.dtype()), (DType::BF16, DType::BF16));
    assert!(rel_diff(&dh16, &dh32) < 2f64.powi(-6) && rel_diff(&dw16, &dw32) < 2f64.powi(-6));
}
