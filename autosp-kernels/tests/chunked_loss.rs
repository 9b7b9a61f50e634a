//! The chunked linear + cross-entropy against autosp-core's `linear` + `cross_entropy`: loss, count and the
//! gradients of hidden and lm_head, with ignored targets and m not a multiple of the chunk; finite differences
//! in f64; determinism; the bytes the tape holds; bad shapes. The device-generic kernel in explicit tiles (many
//! row and vocabulary tiles, partial last ones) against the CPU kernel in f32, f64, bf16 and f16, its frozen
//! head, the tile sizes, and the door's host reads.
//!
//! Tolerances: f32 1e-6 of the largest element (the chunked loss sums token losses in f64 and exps in
//! eight lanes, candle's matmul and reductions sum in another order; d_hidden differs by 2.7e-7 of its largest
//! element); f64 1e-12.

use autosp_core::gradcheck::{check_gradients, probe};
use autosp_core::host_read::host_reads;
use autosp_core::ops;
use autosp_core::{CheckpointPolicy, Error, MemoryStats, Param, Tape};
use autosp_kernels::cross_entropy::{
    generic_backward_with_tiles, generic_forward_with_tiles, LossTiles, MIN_VOCAB_TILE, TILE_BYTES_CPU, TILE_BYTES_GPU,
};
use autosp_kernels::dispatch::generic_calls;
use autosp_kernels::{chunked_cross_entropy, chunked_cross_entropy_backward, chunked_cross_entropy_forward};
use autosp_kernels::{with_kernels, Kernels};
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

/// The generic kernel in explicit tiles against the CPU kernel (this binary never forces the kernels, so the
/// public functions run the CPU kernel): 37 rows in tiles of 8 (the last one 5) and a vocabulary of 50 in
/// tiles of 12 (the last one 2), every 5th target ignored and a target in every vocabulary tile; also one tile
/// over everything. Tolerances (max relative error, see `rel_diff`): f32 1e-5, f64 1e-10. Both kernels compute
/// the same expressions in the same dtype; they differ in the order of their sums (the online log-sum-exp
/// over vocabulary tiles rescales partial sums; `d_hidden` and `d_lm_head` are summed tile by tile, and the
/// CPU kernel's exps run in eight lanes): a few ulps of the largest element, ~1e-7 in f32 and ~1e-16 in f64
/// (measured at most 3.3e-7 and 6.1e-16), two orders of magnitude below the bounds, which are still far below
/// any real error (a wrong index or a missing term moves results by O(1)).
#[test]
fn generic_tiles_equal_the_cpu_kernel_f32_and_f64() {
    let (m, d, vocab) = (37, 16, 50);
    let tg = targets(m, vocab, 5);
    let ids = tg.to_vec1::<i64>().unwrap();
    for v0 in (0..vocab).step_by(12) {
        assert!(ids.iter().any(|&t| t >= v0 as i64 && t < (v0 + 12) as i64), "no target in the tile at {v0}");
    }
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-10)] {
        let hidden = (rand(&[m, d], 21, dtype) * 2.0).unwrap();
        let lm_head = rand(&[vocab, d], 22, dtype);
        let (closs, ccount) = chunked_cross_entropy_forward(&hidden, &lm_head, &tg, 8).unwrap();
        for tiles in [LossTiles { rows: 8, vocab: 12 }, LossTiles { rows: m, vocab }] {
            let (loss, count) = generic_forward_with_tiles(&hidden, &lm_head, &tg, tiles).unwrap();
            assert_eq!((count, loss.dtype()), (ccount, dtype));
            let e = rel_diff(&loss, &closs);
            assert!(e <= tol, "{dtype:?} {tiles:?}: loss differs by {e}");
            for grad in [1.0, -0.37] {
                let (cdh, cdw) = chunked_cross_entropy_backward(&hidden, &lm_head, &tg, 8, grad).unwrap();
                let (dh, dw) = generic_backward_with_tiles(&hidden, &lm_head, &tg, tiles, grad, true).unwrap();
                let dw = dw.unwrap();
                assert_eq!((dh.dtype(), dw.dtype()), (dtype, dtype));
                for (name, a, b) in [("d_hidden", &dh, &cdh), ("d_lm_head", &dw, &cdw)] {
                    let e = rel_diff(a, b);
                    assert!(e <= tol, "{dtype:?} {tiles:?} grad {grad}: {name} differs by {e}");
                }
                // Ignored rows (3, 8, ...) get exactly zero gradient.
                assert_eq!(
                    dh.get(3)
                        .unwrap()
                        .abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap(),
                    0.0
                );
            }
        }
        // A fixed order of sums: a second run repeats bit for bit.
        let tiles = LossTiles { rows: 8, vocab: 12 };
        let a = generic_backward_with_tiles(&hidden, &lm_head, &tg, tiles, 1.0, true).unwrap();
        let b = generic_backward_with_tiles(&hidden, &lm_head, &tg, tiles, 1.0, true).unwrap();
        assert_eq!(rel_diff(&a.0, &b.0), 0.0);
        assert_eq!(rel_diff(&a.1.unwrap(), &b.1.unwrap()), 0.0);
    }
}

/// bf16 and f16 inputs in tiles, against the f32 results of the CPU kernel on the same (rounded) inputs. The
/// generic kernel runs its GEMMs in the inputs' dtype: each logit is rounded to it (unit roundoff u = 2^-8 for
/// bf16, 2^-11 for f16), which moves a row's `lse - logit[target]` by at most 2u·max|logit| (logits up to ~5
/// here), and `dlogits` is rounded to it before the gradient GEMMs, whose results are rounded once more.
/// Measured: loss 1.3e-4 bf16 and 1.5e-5 f16 (independent roundings cancel in the sum), gradients 5.0e-3 and
/// 7.6e-4 (1.3u and 1.6u of the largest element). Tolerances 2-3x those: loss 2^-12 (bf16) and 2^-15 (f16),
/// gradients 2^-6 and 2^-9.
#[test]
fn generic_tiles_in_bf16_and_f16_are_within_their_rounding_of_f32() {
    let (m, d, vocab) = (37, 16, 50);
    let tg = targets(m, vocab, 5);
    let tiles = LossTiles { rows: 8, vocab: 12 };
    for (dtype, loss_tol, grad_tol) in
        [(DType::BF16, 2f64.powi(-12), 2f64.powi(-6)), (DType::F16, 2f64.powi(-15), 2f64.powi(-9))]
    {
        let hidden = (rand(&[m, d], 23, DType::F32) * 2.0).unwrap().to_dtype(dtype).unwrap();
        let lm_head = rand(&[vocab, d], 24, dtype);
        let (h32, w32) = (hidden.to_dtype(DType::F32).unwrap(), lm_head.to_dtype(DType::F32).unwrap());
        let (loss, count) = generic_forward_with_tiles(&hidden, &lm_head, &tg, tiles).unwrap();
        let (loss32, count32) = chunked_cross_entropy_forward(&h32, &w32, &tg, 8).unwrap();
        assert_eq!((loss.dtype(), count), (DType::F32, count32));
        let e = rel_diff(&loss, &loss32);
        assert!(e <= loss_tol, "{dtype:?}: loss differs by {e} (tolerance {loss_tol})");
        let (dh, dw) = generic_backward_with_tiles(&hidden, &lm_head, &tg, tiles, 1.0, true).unwrap();
        let dw = dw.unwrap();
        assert_eq!((dh.dtype(), dw.dtype()), (dtype, dtype));
        let (dh32, dw32) = chunked_cross_entropy_backward(&h32, &w32, &tg, 8, 1.0).unwrap();
        for (name, a, b) in [("d_hidden", &dh, &dh32), ("d_lm_head", &dw, &dw32)] {
            let e = rel_diff(a, b);
            assert!(e <= grad_tol, "{dtype:?}: {name} differs by {e} (tolerance {grad_tol})");
        }
    }
}

#[test]
fn generic_frozen_head_skips_its_gradient_and_keeps_d_hidden() {
    let (m, d, vocab) = (21, 8, 30);
    let hidden = rand(&[m, d], 25, DType::F32);
    let lm_head = rand(&[vocab, d], 26, DType::F32);
    let tg = targets(m, vocab, 4);
    let tiles = LossTiles { rows: 5, vocab: 7 };
    let (dh, dw) = generic_backward_with_tiles(&hidden, &lm_head, &tg, tiles, 0.5, true).unwrap();
    let (dh_frozen, none) = generic_backward_with_tiles(&hidden, &lm_head, &tg, tiles, 0.5, false).unwrap();
    assert!(dw.is_some() && none.is_none());
    assert_eq!(rel_diff(&dh_frozen, &dh), 0.0);
}

#[test]
fn one_host_read_per_forward_and_at_most_one_per_backward() {
    let (m, d, vocab) = (19, 8, 23);
    let hidden = rand(&[m, d], 27, DType::F32);
    let lm_head = rand(&[vocab, d], 28, DType::F32);
    let tg = targets(m, vocab, 4);
    // (plain forward, plain backward, tape forward, tape backward) host reads.
    let reads = || {
        let counted = |f: &mut dyn FnMut()| {
            let before = host_reads();
            f();
            host_reads() - before
        };
        let fwd = counted(&mut || drop(chunked_cross_entropy_forward(&hidden, &lm_head, &tg, 4).unwrap()));
        let bwd = counted(&mut || drop(chunked_cross_entropy_backward(&hidden, &lm_head, &tg, 4, 1.0).unwrap()));
        let tape = Tape::new(CheckpointPolicy::None);
        let w = Param::new("lm_head", lm_head.clone());
        let (h, wv, t) = (tape.leaf(hidden.clone()), tape.param(&w).unwrap(), tape.constant(tg.clone()));
        let mut loss = None;
        let tape_fwd = counted(&mut || loss = Some(chunked_cross_entropy(&tape, &h, &wv, &t, 4).unwrap().0));
        let tape_bwd = counted(&mut || tape.backward(loss.as_ref().unwrap()).unwrap());
        (fwd, bwd, tape_fwd, tape_bwd)
    };
    // Generic: the targets' summary once per forward and per plain backward; the tape's backward keeps g on
    // the device. CPU: the summary per forward, g read back once by the plain backward; the tape's loss
    // computed its gradients in its forward pass (f32) and its backward only scales them: no read.
    let before = generic_calls();
    assert_eq!(with_kernels(Kernels::Generic, reads), (1, 1, 1, 0));
    assert!(generic_calls() > before, "the forced calls must take the generic kernel");
    assert_eq!(reads(), (1, 1, 1, 0));
}

#[test]
fn tiles_come_from_a_byte_budget_per_device() {
    // The CPU's 32 MiB of f32 logits: all 2048 rows by 4096 columns; at 8K rows and Llama-3's vocabulary the
    // fewest columns (1024) and all the rows.
    assert_eq!(LossTiles::for_inputs(&Device::Cpu, DType::F32, 2048, 49152), LossTiles { rows: 2048, vocab: 4096 });
    assert_eq!(LossTiles::for_budget(TILE_BYTES_CPU, DType::BF16, 8192, 128256), LossTiles { rows: 8192, vocab: 1024 });
    // A GPU's 256 MiB: [8192, 8192] tiles (16 over a 128256 vocabulary; f64 statistics halve the columns).
    assert_eq!(LossTiles::for_budget(TILE_BYTES_GPU, DType::BF16, 8192, 128256), LossTiles { rows: 8192, vocab: 8192 });
    assert_eq!(LossTiles::for_budget(TILE_BYTES_GPU, DType::F64, 8192, 128256), LossTiles { rows: 8192, vocab: 4096 });
    // Many rows: MIN_VOCAB_TILE columns, the rows the budget leaves; small inputs: one tile.
    assert_eq!(
        LossTiles::for_budget(TILE_BYTES_CPU, DType::F32, 65536, 128256),
        LossTiles { rows: TILE_BYTES_CPU / 4 / MIN_VOCAB_TILE, vocab: MIN_VOCAB_TILE }
    );
    assert_eq!(LossTiles::for_budget(TILE_BYTES_GPU, DType::F16, 37, 50), LossTiles { rows: 37, vocab: 50 });
}

/// On a recording tape the CPU kernel (f32, f64) computes the gradients in the loss's own pass, and backward
/// only scales them by the upstream gradient: the same loss and the same gradients (1e-6 relative in f32: the
/// same products, the scale applied after instead of inside; 1e-12 in f64) as the plain forward and the
/// recomputing backward, for an upstream gradient other than 1; a frozen head gets none, and `d_hidden` is
/// unchanged by it; the tape holds the two gradients from the forward on.
#[test]
fn the_tape_loss_computes_its_gradients_in_its_forward_pass() {
    let (m, d, vocab) = (37, 16, 53);
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12)] {
        let hidden = rand(&[m, d], 31, dtype);
        let lm_head = rand(&[vocab, d], 32, dtype);
        let tg = targets(m, vocab, 5);
        let (want_loss, _) = chunked_cross_entropy_forward(&hidden, &lm_head, &tg, 8).unwrap();
        let (want_dh, want_dw) = chunked_cross_entropy_backward(&hidden, &lm_head, &tg, 8, 0.25).unwrap();
        for frozen in [false, true] {
            let tape = Tape::new(CheckpointPolicy::None);
            let w = Param::new("lm_head", lm_head.clone());
            w.set_frozen(frozen);
            let (h, wv, t) = (tape.leaf(hidden.clone()), tape.param(&w).unwrap(), tape.constant(tg.clone()));
            let before = tape.memory().held_bytes;
            let (loss, _) = chunked_cross_entropy(&tape, &h, &wv, &t, 8).unwrap();
            let held = tape.memory().held_bytes - before;
            let stash = (m * d + if frozen { 0 } else { vocab * d }) * dtype.size_in_bytes();
            assert!(held >= stash, "{dtype:?} frozen={frozen}: the tape holds {held} bytes, the gradients are {stash}");
            assert_eq!(rel_diff(loss.tensor(), &want_loss), 0.0, "{dtype:?}: the fused pass's loss");
            let scaled = ops::scale(&tape, &loss, 0.25).unwrap();
            tape.backward(&scaled).unwrap();
            let dh = tape.grad(&h).unwrap().unwrap();
            assert!(
                rel_diff(&dh, &want_dh) <= tol,
                "{dtype:?} frozen={frozen}: d_hidden off by {}",
                rel_diff(&dh, &want_dh)
            );
            match tape.param_grads().get(&w) {
                Some(dw) => {
                    assert!(!frozen);
                    assert!(rel_diff(dw, &want_dw) <= tol, "{dtype:?}: d_lm_head off by {}", rel_diff(dw, &want_dw));
                }
                None => assert!(frozen, "{dtype:?}: a trainable head gets its gradient"),
            }
        }
    }
}
