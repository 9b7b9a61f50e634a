//! Every op's backward against central finite differences in f64, and against candle's own autograd where
//! candle has a working backward for the op.
//!
//! Tolerance: f64 central differences with eps = 1e-6 have truncation error ~eps^2 * f''' ~ 1e-12 and
//! round-off ~1e-16 / eps ~ 1e-10 per unit of the projected output, so |analytic - numeric| must stay under
//! 1e-7 + 1e-6 |numeric|: five orders above the expected error, many below any real mistake.

#![allow(clippy::cloned_ref_to_slice_refs)]

use autosp_core::gradcheck::{check_gradients, probe};
use autosp_core::ops::{self, AttentionSpec};
use autosp_core::{CheckpointPolicy, Result, Tape, Value};
use candle_core::{DType, Device, Tensor, Var};

const EPS: f64 = 1e-6;
const ATOL: f64 = 1e-7;
const RTOL: f64 = 1e-6;

fn rand(shape: &[usize], seed: u64) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap()
}

fn positive(shape: &[usize], seed: u64) -> Tensor {
    (rand(shape, seed).abs().unwrap() + 0.5).unwrap()
}

fn check<F>(f: F, inputs: &[Tensor], wrt: &[usize])
where
    F: Fn(&Tape, &[Value]) -> Result<Vec<Value>>,
{
    let r = check_gradients(f, inputs, wrt, EPS, ATOL, RTOL).unwrap();
    assert!(r.checked > 0);
}

#[test]
fn linear_with_and_without_bias() {
    let x = rand(&[2, 3, 4], 1);
    let w = rand(&[5, 4], 2);
    let b = rand(&[5], 3);
    check(|t, v| Ok(vec![ops::linear(t, &v[0], &v[1], Some(&v[2]))?]), &[x.clone(), w.clone(), b], &[0, 1, 2]);
    check(|t, v| Ok(vec![ops::linear(t, &v[0], &v[1], None)?]), &[x, w], &[0, 1]);
}

#[test]
fn matmul_batched_and_broadcast() {
    check(|t, v| Ok(vec![ops::matmul(t, &v[0], &v[1])?]), &[rand(&[2, 3, 4], 4), rand(&[2, 4, 5], 5)], &[0, 1]);
    // A weight shared by every batch entry.
    check(|t, v| Ok(vec![ops::matmul(t, &v[0], &v[1])?]), &[rand(&[2, 3, 4], 6), rand(&[4, 5], 7)], &[0, 1]);
}

#[test]
fn binary_ops_with_broadcasting() {
    let a = rand(&[2, 3, 4], 8);
    let b = rand(&[3, 1], 9);
    check(|t, v| Ok(vec![ops::add(t, &v[0], &v[1])?]), &[a.clone(), b.clone()], &[0, 1]);
    check(|t, v| Ok(vec![ops::sub(t, &v[0], &v[1])?]), &[a.clone(), b.clone()], &[0, 1]);
    check(|t, v| Ok(vec![ops::mul(t, &v[0], &v[1])?]), &[a.clone(), b], &[0, 1]);
    check(|t, v| Ok(vec![ops::div(t, &v[0], &v[1])?]), &[a, positive(&[1, 4], 10)], &[0, 1]);
}

#[test]
fn scalar_ops() {
    let x = positive(&[3, 4], 11);
    check(|t, v| Ok(vec![ops::affine(t, &v[0], -1.5, 0.25)?]), &[x.clone()], &[0]);
    check(|t, v| Ok(vec![ops::powf(t, &v[0], 2.5)?]), &[x], &[0]);
}

#[test]
fn reductions() {
    let x = rand(&[2, 3, 4], 12);
    check(|t, v| Ok(vec![ops::sum(t, &v[0], &[1], false)?]), &[x.clone()], &[0]);
    check(|t, v| Ok(vec![ops::sum(t, &v[0], &[0, 2], true)?]), &[x.clone()], &[0]);
    check(|t, v| Ok(vec![ops::mean(t, &v[0], &[2], false)?]), &[x.clone()], &[0]);
    check(|t, v| Ok(vec![ops::sum_all(t, &v[0])?]), &[x], &[0]);
}

#[test]
fn views() {
    let x = rand(&[2, 3, 4], 13);
    let y = rand(&[2, 2, 4], 14);
    check(|t, v| Ok(vec![ops::reshape(t, &v[0], (6, 4))?]), &[x.clone()], &[0]);
    check(|t, v| Ok(vec![ops::transpose(t, &v[0], 0, 2)?]), &[x.clone()], &[0]);
    check(|t, v| Ok(vec![ops::narrow(t, &v[0], 1, 1, 2)?]), &[x.clone()], &[0]);
    check(|t, v| Ok(vec![ops::cat(t, &[&v[0], &v[1]], 1)?]), &[x.clone(), y], &[0, 1]);
    check(
        |t, v| {
            let tr = ops::transpose(t, &v[0], 1, 2)?;
            Ok(vec![ops::contiguous(t, &tr)?])
        },
        &[x],
        &[0],
    );
}

#[test]
fn embedding_scatter_adds_repeated_ids() {
    let ids = Tensor::new(&[[1u32, 3, 1], [0, 3, 3]], &Device::Cpu).unwrap();
    let table = rand(&[5, 4], 15);
    check(|t, v| Ok(vec![ops::embedding(t, &v[0], &v[1])?]), &[ids, table], &[1]);
}

#[test]
fn pointwise_functions() {
    let x = rand(&[3, 5], 16);
    check(|t, v| Ok(vec![ops::silu(t, &v[0])?]), &[x.clone()], &[0]);
    // gelu's tanh bends over |x| of a few: spread the inputs over [-3, 3].
    check(|t, v| Ok(vec![ops::gelu_tanh(t, &v[0])?]), &[(x.clone() * 3.0).unwrap()], &[0]);
    check(|t, v| Ok(vec![ops::exp(t, &v[0])?]), &[x], &[0]);
    check(|t, v| Ok(vec![ops::log(t, &v[0])?]), &[positive(&[3, 5], 17)], &[0]);
}

#[test]
fn softmax_and_rms_norm() {
    check(|t, v| Ok(vec![ops::softmax_last_dim(t, &v[0])?]), &[rand(&[2, 3, 6], 18)], &[0]);
    check(|t, v| Ok(vec![ops::rms_norm(t, &v[0], &v[1], 1e-5)?]), &[rand(&[2, 3, 8], 19), rand(&[8], 20)], &[0, 1]);
}

#[test]
fn rope_with_explicit_positions() {
    let inv = ops::rope::default_inv_freq(8, 10000.0);
    // A shard that starts at position 37, with a gap: positions need not be contiguous.
    let (cos, sin) = ops::rope_tables(&[37, 38, 39, 52], &inv, DType::F64, &Device::Cpu).unwrap();
    check(|t, v| Ok(vec![ops::rope(t, &v[0], &v[1], &v[2])?]), &[rand(&[2, 4, 3, 8], 21), cos, sin], &[0]);
}

#[test]
fn rope_rotates_by_position() {
    // Position 0 is the identity; the rotation preserves each pair's norm.
    let inv = ops::rope::default_inv_freq(4, 10000.0);
    let (cos, sin) = ops::rope_tables(&[0, 5], &inv, DType::F64, &Device::Cpu).unwrap();
    let x = rand(&[1, 2, 1, 4], 22);
    let t = Tape::inference();
    let y = ops::rope(&t, &Value::constant(x.clone()), &Value::constant(cos), &Value::constant(sin)).unwrap();
    let (xv, yv) = (
        x.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        y.tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap(),
    );
    for i in 0..4 {
        assert!((xv[i] - yv[i]).abs() < 1e-15);
    }
    for i in 0..2 {
        let nx = xv[4 + i].hypot(xv[6 + i]);
        let ny = yv[4 + i].hypot(yv[6 + i]);
        assert!((nx - ny).abs() < 1e-12);
    }
    assert!((xv[4] - yv[4]).abs() > 1e-3, "position 5 must rotate");
}

#[test]
fn cross_entropy_with_ignored_targets() {
    let logits = rand(&[5, 7], 23);
    let targets = Tensor::new(&[3i64, -100, 0, 6, -100], &Device::Cpu).unwrap();
    check(
        |t, v| {
            let (loss, count) = ops::cross_entropy(t, &v[0], &v[1])?;
            assert_eq!(count, 3);
            Ok(vec![loss])
        },
        &[logits.clone(), targets.clone()],
        &[0],
    );
    // The value itself: sum over valid rows of lse - logit[target].
    let t = Tape::inference();
    let (loss, _) = ops::cross_entropy(&t, &Value::constant(logits.clone()), &Value::constant(targets)).unwrap();
    let rows = logits.to_vec2::<f64>().unwrap();
    let mut want = 0.0;
    for (r, tgt) in [(0usize, 3usize), (2, 0), (3, 6)] {
        let lse = rows[r].iter().map(|x| x.exp()).sum::<f64>().ln();
        want += lse - rows[r][tgt];
    }
    assert!((loss.tensor().to_scalar::<f64>().unwrap() - want).abs() < 1e-12);
}

#[test]
fn naive_attention_all_variants() {
    let cases = [
        // (nq, nk, h, hkv, causal, q_offset, k_offset, max_distance)
        (5, 5, 2, 2, true, 0, 0, None),
        (5, 5, 4, 2, false, 0, 0, None),
        (3, 6, 4, 1, true, 3, 0, None),
        // queries before every key: the first rows see nothing (lse = -inf, o = 0).
        (4, 3, 2, 1, true, 0, 2, None),
        // Sliding windows: causal (each row sees its last 2 positions), non-causal with GQA, offsets and
        // q_len != k_len, a window of 0 (each row sees only its own position), and non-causal rows whose
        // window holds no key (q positions 0..2 against keys 6..10 with w = 4: rows 0 and 1 see nothing).
        (6, 6, 2, 2, true, 0, 0, Some(1)),
        (5, 7, 4, 2, false, 2, 0, Some(2)),
        (4, 6, 2, 1, true, 2, 0, Some(0)),
        (3, 4, 2, 2, false, 0, 6, Some(4)),
    ];
    for (i, &(nq, nk, h, hkv, causal, qo, ko, w)) in cases.iter().enumerate() {
        let spec = AttentionSpec { causal, scale: None, q_offset: qo, k_offset: ko, max_distance: w, documents: None };
        let s = 30 + 3 * i as u64;
        let inputs = [rand(&[1, nq, h, 4], s), rand(&[1, nk, hkv, 4], s + 1), rand(&[1, nk, hkv, 4], s + 2)];
        check(
            move |t, v| {
                let (o, lse) = ops::naive_attention(t, &v[0], &v[1], &v[2], spec.clone())?;
                Ok(vec![o, lse])
            },
            &inputs,
            &[0, 1, 2],
        );
    }
}

#[test]
fn attention_row_with_no_visible_key_is_zero_not_nan() {
    let spec =
        AttentionSpec { causal: true, scale: None, q_offset: 0, k_offset: 1, max_distance: None, documents: None };
    let (o, lse) = ops::attention::naive_attention_forward(
        &rand(&[1, 2, 1, 4], 40),
        &rand(&[1, 2, 1, 4], 41),
        &rand(&[1, 2, 1, 4], 42),
        &spec,
    )
    .unwrap();
    let lse = lse.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(lse[0], f64::NEG_INFINITY);
    assert!(lse[1].is_finite());
    let o = o.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert!(o[..4].iter().all(|&x| x == 0.0));
    assert!(o.iter().all(|x| x.is_finite()));
}

/// The tape's gradients equal candle's autograd for a composition of ops candle differentiates.
#[test]
fn matches_candle_autograd() {
    let dev = Device::Cpu;
    let (x0, w0, b0) = (rand(&[2, 3, 4], 50), rand(&[5, 4], 51), rand(&[5], 52));
    let ids0 = Tensor::new(&[2u32, 0, 1], &dev).unwrap();
    let table0 = rand(&[4, 5], 53);
    let p = rand(&[2, 3, 5], 54);

    // candle
    let (x, w, b, table) = (
        Var::from_tensor(&x0).unwrap(),
        Var::from_tensor(&w0).unwrap(),
        Var::from_tensor(&b0).unwrap(),
        Var::from_tensor(&table0).unwrap(),
    );
    let y = x.broadcast_matmul(&w.t().unwrap()).unwrap().broadcast_add(&b).unwrap();
    let e = table.embedding(&ids0).unwrap().unsqueeze(0).unwrap();
    let z = y.broadcast_mul(&e).unwrap().exp().unwrap();
    let z = (z.sum_keepdim(2).unwrap().broadcast_div(&(z.narrow(2, 0, 1).unwrap() + 2.0).unwrap())).unwrap();
    let z = z.transpose(0, 1).unwrap().reshape((3, 2)).unwrap().sqr().unwrap().mean_all().unwrap();
    let lin = y.affine(0.5, 0.1).unwrap().broadcast_mul(&p).unwrap().sum_all().unwrap();
    // silu, log, sub and cat, also differentiated by candle.
    let c = Tensor::cat(&[&y, &e.broadcast_as((2, 3, 5)).unwrap()], 1).unwrap().silu().unwrap();
    let c = (c.exp().unwrap() + 1.0).unwrap().log().unwrap().broadcast_sub(&b).unwrap();
    let c = c.broadcast_matmul(&w).unwrap().sum_all().unwrap();
    let loss = ((z + lin).unwrap() + c).unwrap();
    let gs = loss.backward().unwrap();

    // tape
    let tape = Tape::new(CheckpointPolicy::None);
    let (tx, tw, tb, tt) = (tape.leaf(x0), tape.leaf(w0), tape.leaf(b0), tape.leaf(table0));
    let tids = tape.constant(ids0);
    let y = ops::linear(&tape, &tx, &tw, Some(&tb)).unwrap();
    let e = ops::embedding(&tape, &tids, &tt).unwrap();
    let e = ops::reshape(&tape, &e, (1, 3, 5)).unwrap();
    let z = ops::exp(&tape, &ops::mul(&tape, &y, &e).unwrap()).unwrap();
    let den = ops::affine(&tape, &ops::narrow(&tape, &z, 2, 0, 1).unwrap(), 1.0, 2.0).unwrap();
    let z = ops::div(&tape, &ops::sum(&tape, &z, &[2], true).unwrap(), &den).unwrap();
    let z = ops::reshape(&tape, &ops::transpose(&tape, &z, 0, 1).unwrap(), (3, 2)).unwrap();
    let z = ops::mean(&tape, &ops::powf(&tape, &z, 2.0).unwrap(), &[0, 1], false).unwrap();
    let pv = tape.constant(p);
    let lin = ops::mul(&tape, &ops::affine(&tape, &y, 0.5, 0.1).unwrap(), &pv).unwrap();
    let loss2 = ops::add(&tape, &z, &ops::sum_all(&tape, &lin).unwrap()).unwrap();
    let eb = ops::mul(&tape, &e, &tape.constant(Tensor::ones((2, 3, 5), DType::F64, &dev).unwrap())).unwrap();
    let c = ops::silu(&tape, &ops::cat(&tape, &[&y, &eb], 1).unwrap()).unwrap();
    let c = ops::log(&tape, &ops::affine(&tape, &ops::exp(&tape, &c).unwrap(), 1.0, 1.0).unwrap()).unwrap();
    let c = ops::sub(&tape, &c, &tb).unwrap();
    let c = ops::sum_all(&tape, &ops::matmul(&tape, &c, &tw).unwrap()).unwrap();
    let loss2 = ops::add(&tape, &loss2, &c).unwrap();
    tape.backward(&loss2).unwrap();

    let close = |a: &Tensor, b: &Tensor| {
        let a = a.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-12 * (1.0 + y.abs()), "{x} vs {y}");
        }
    };
    close(&loss.to_dtype(DType::F64).unwrap(), loss2.tensor());
    close(&tape.grad(&tx).unwrap().unwrap(), gs.get(&x).unwrap());
    close(&tape.grad(&tw).unwrap().unwrap(), gs.get(&w).unwrap());
    close(&tape.grad(&tb).unwrap().unwrap(), gs.get(&b).unwrap());
    close(&tape.grad(&tt).unwrap().unwrap(), gs.get(&table).unwrap());
}

/// gelu (tanh approximation) in bf16, the dtype a Gemma run computes in, follows its f32 path: forward and the
/// gradient of `sum(gelu(x) * w)` agree within 2e-2 of the largest element (bf16 keeps 8 bits: 2^-8 per
/// rounding, a few roundings per element), on inputs over [-3, 3] where tanh bends. (The f32/f64 backward is
/// held against finite differences in `pointwise_functions`.)
#[test]
fn gelu_tanh_in_bf16_follows_f32() {
    let x = (rand(&[8, 64], 31) * 3.0).unwrap().to_dtype(DType::F32).unwrap();
    let w = rand(&[8, 64], 32).to_dtype(DType::F32).unwrap();
    let run = |dtype: DType| -> (Vec<f32>, Vec<f32>) {
        let tape = Tape::new(CheckpointPolicy::None);
        let xv = tape.leaf(x.to_dtype(dtype).unwrap());
        let y = ops::gelu_tanh(&tape, &xv).unwrap();
        let loss =
            ops::sum_all(&tape, &ops::mul(&tape, &y, &tape.constant(w.to_dtype(dtype).unwrap())).unwrap()).unwrap();
        tape.backward(&loss).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        (flat(y.tensor()), flat(&tape.grad(&xv).unwrap().unwrap()))
    };
    let ((y32, g32), (y16, g16)) = (run(DType::F32), run(DType::BF16));
    let rel = |a: &[f32], b: &[f32]| {
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max) / scale
    };
    assert!(rel(&y16, &y32) < 2e-2, "forward: {}", rel(&y16, &y32));
    assert!(rel(&g16, &g32) < 2e-2, "backward: {}", rel(&g16, &g32));
}

/// Dropout's mask is a function of its seed alone, so finite differences see the same mask as the analytic
/// gradient; about `p` of the elements are dropped and the kept ones scaled by `1 / (1 - p)`; the same seed
/// draws the same mask and another seed another; an inference tape leaves `x` as it is.
#[test]
fn dropout_with_a_seeded_mask() {
    let x = rand(&[3, 50], 21);
    // The op itself (`ops::dropout` is the identity on the inference tapes finite differences evaluate on).
    let coordinates = std::sync::Arc::new(autosp_core::TokenCoordinates::local(1, 3));
    let op = || ops::dropout::Dropout { p: 0.3, seed: 7, first_sequence: 0, coordinates: coordinates.clone() };
    check(|t, v| Ok(vec![t.apply(op(), &[&v[0]])?.remove(0)]), &[x.clone()], &[0]);
    let ones = Tensor::ones((100, 100), DType::F64, &Device::Cpu).unwrap();
    let tape = Tape::new(CheckpointPolicy::None);
    let y = ops::dropout(&tape, &tape.leaf(ones.clone()), 0.3, 7, 0).unwrap().tensor().clone();
    let v = y.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let dropped = v.iter().filter(|&&e| e == 0.0).count() as f64 / v.len() as f64;
    // 10,000 draws: the dropped fraction's standard deviation is 0.0046; 0.02 is over four of them.
    assert!((dropped - 0.3).abs() < 0.02, "dropped {dropped}");
    let keep = 1.0 / (1.0 - f64::from(0.3f32));
    assert!(v.iter().all(|&e| e == 0.0 || e == keep));
    let again = ops::dropout(&tape, &tape.leaf(ones.clone()), 0.3, 7, 0).unwrap().tensor().clone();
    let other = ops::dropout(&tape, &tape.leaf(ones.clone()), 0.3, 8, 0).unwrap().tensor().clone();
    assert_eq!(v, again.flatten_all().unwrap().to_vec1::<f64>().unwrap());
    assert_ne!(v, other.flatten_all().unwrap().to_vec1::<f64>().unwrap());
    let inference = Tape::inference();
    let same = ops::dropout(&inference, &inference.leaf(ones.clone()), 0.3, 7, 0).unwrap();
    assert_eq!(same.tensor().sum_all().unwrap().to_scalar::<f64>().unwrap(), 10_000.0);
    assert!(ops::dropout(&tape, &tape.leaf(ones), 1.0, 7, 0).is_err());
}
