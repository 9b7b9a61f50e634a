//! The CPU flash attention against the naive reference attention of autosp-core: output, LSE and
//! dq/dk/dv in f64 and f32, causal and not, MHA/GQA/MQA, lengths that are not tile multiples, position
//! offsets (with rows that see no key), head_dim 64/128/80 and odd ones; every output element written
//! (poisoned buffers), identical bits on a second run, and typed errors for bad input.

mod common;

use autosp_core::ops::attention::{naive_attention_forward, AttentionSpec};
use autosp_kernels::attention::poisoned;
use autosp_kernels::{attention_backward, attention_forward, Error};
use candle_core::{DType, Device, Tensor};
use common::{assert_close, check_against_naive, inputs, random, spec, values, Case};

/// The shapes every numerical check runs (tiles are 64 × 64, so 70, 100, 131, 150 cut tiles; 600 and 700 run
/// more query tiles than a forward task's group and more key tiles than a backward task's group).
fn cases() -> Vec<Case> {
    let c = |b, nq, nk, h, hkv, d, spec| Case { b, nq, nk, h, hkv, d, spec };
    vec![
        c(1, 150, 150, 4, 4, 64, spec(true, 0, 0)),  // MHA causal, head_dim 64
        c(2, 150, 150, 8, 4, 64, spec(true, 0, 0)),  // batch x kv heads = 8: one backward chunk per kv head
        c(2, 70, 130, 4, 2, 80, spec(false, 0, 0)),  // GQA, full, head_dim 80, q_len != k_len
        c(1, 131, 131, 4, 1, 128, spec(true, 0, 0)), // MQA causal, head_dim 128
        c(1, 100, 90, 2, 2, 64, spec(true, 40, 60)), // offsets: query rows 0..20 see no key
        c(1, 65, 200, 3, 3, 24, spec(true, 150, 0)), // later query shard against earlier keys
        c(2, 33, 47, 6, 2, 72, spec(false, 0, 0)),   // head_dim not a multiple of 16
        c(1, 1, 1, 1, 1, 16, spec(true, 0, 0)),      // one token
        c(1, 80, 80, 2, 1, 256, spec(true, 0, 0)),   // the largest head_dim
        c(1, 64, 128, 2, 2, 64, AttentionSpec { scale: Some(0.3), ..spec(true, 64, 0) }), // own scale
        // 10 query tiles: forward groups of 8 and 2 (d = 64's byte budget; fewer per group on many threads);
        // one backward chunk per kv head, its 10 key tiles in key groups of 3, 3, 3 and 1.
        c(2, 600, 600, 4, 4, 64, spec(true, 0, 0)),
        // 11 tiles at d = 128: forward groups of 4, 4 and 3; one backward chunk per kv head, key groups of 2
        // (the last of 1).
        c(1, 700, 700, 8, 8, 128, spec(true, 0, 0)),
    ]
}

/// f64: both sides compute in f64 and differ only in summation order (tiles, the online rescaling) and in
/// exp2(x·log2 e) against exp(x): a few ulp per step over sums of at most a few hundred terms of size
/// ~1..100 gives errors near 1e-13; 1e-10 relative to the largest value leaves a wide margin and still
/// catches any wrong term (which would be ~1e-2 or more).
#[test]
fn f64_matches_naive() {
    check_against_naive(&cases(), DType::F64, 1e-10, 1000);
}

/// f32: the naive reference runs in f32 too; two different f32 summation orders over up to 700 keys and
/// head_dim 256, plus a 1-ulp vectorised exp2, differ by up to ~1e-6 relative on well-scaled values, and
/// the backward's D = rowsum(dO ∘ O) cancellation loses another digit; 2e-5 relative to the largest value
/// passes every time and still catches a wrong term.
#[test]
fn f32_matches_naive() {
    check_against_naive(&cases(), DType::F32, 2e-5, 2000);
}

/// bf16 inputs compute in f32 and return bf16: they match the f32 kernel on the same (bf16-rounded) inputs
/// to bf16 rounding of the outputs (2^-8 relative to the largest value), and lse stays f32.
#[test]
fn bf16_inputs_accumulate_in_f32() {
    let c = Case { b: 1, nq: 90, nk: 90, h: 2, hkv: 1, d: 64, spec: spec(true, 0, 0) };
    let x = inputs(&c, 77, DType::BF16);
    let (o, lse) = attention_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
    assert_eq!((o.dtype(), lse.dtype()), (DType::BF16, DType::F32));
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let (o32, lse32) = attention_forward(&f(&x.q), &f(&x.k), &f(&x.v), &c.spec).unwrap();
    assert_close("o bf16", &c, &o, &o32, 1.0 / 256.0);
    assert_close("lse bf16", &c, &lse, &lse32, 1e-6);
    let (dq, dk, dv) = attention_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, None, &c.spec).unwrap();
    assert_eq!(dq.dtype(), DType::BF16);
    let want = attention_backward(&f(&x.q), &f(&x.k), &f(&x.v), &f(&o), &lse, &f(&x.d_o), None, &c.spec).unwrap();
    assert_close("dq bf16", &c, &dq, &want.0, 1.0 / 128.0);
    assert_close("dk bf16", &c, &dk, &want.1, 1.0 / 128.0);
    assert_close("dv bf16", &c, &dv, &want.2, 1.0 / 128.0);
}

/// Rows that see no key (a causal key shard after the queries): lse = -inf, o = 0, and zero (not NaN)
/// gradients; keys no query sees get zero dk/dv.
#[test]
fn rows_that_see_no_key() {
    let c = Case { b: 1, nq: 70, nk: 70, h: 2, hkv: 2, d: 64, spec: spec(true, 0, 100) };
    let x = inputs(&c, 5, DType::F32);
    let (o, lse) = poisoned::cpu_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
    assert!(values(&lse).iter().all(|&l| l == f64::NEG_INFINITY));
    assert!(values(&o).iter().all(|&v| v == 0.0));
    let (dq, dk, dv) = poisoned::cpu_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, Some(&x.d_lse), &c.spec).unwrap();
    for t in [&dq, &dk, &dv] {
        assert!(values(t).iter().all(|&v| v == 0.0));
    }
}

/// Runs on the same inputs give the same bits, whatever the thread count (a shape with batch · kv heads small
/// enough that the backward splits each kv head's key tiles over several tasks, and GQA sums).
#[test]
fn two_runs_give_identical_bits() {
    let c = Case { b: 1, nq: 300, nk: 300, h: 4, hkv: 2, d: 64, spec: spec(true, 0, 0) };
    let x = inputs(&c, 9, DType::F32);
    let run = || {
        let (o, lse) = attention_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
        let (dq, dk, dv) = attention_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, None, &c.spec).unwrap();
        [o, lse, dq, dk, dv].map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
    };
    let first = run();
    // Again on the default pool, and on pools of 1, 3 and 8 threads: other schedules, other task placement,
    // and other backward waves (the 4 key chunks per kv head run 1, 2 or 4 at a time), so other dQ partial
    // slots; the sums must still run in chunk order.
    let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build().unwrap();
    let runs = [run(), pool(1).install(run), pool(3).install(run), pool(8).install(run)];
    for again in &runs {
        for (a, b) in first.iter().zip(again) {
            assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
}

/// Strided (non-contiguous) inputs give the same result as their contiguous copies.
#[test]
fn non_contiguous_inputs() {
    let c = Case { b: 1, nq: 40, nk: 40, h: 2, hkv: 2, d: 32, spec: spec(true, 0, 0) };
    let x = inputs(&c, 31, DType::F32);
    // [b, h, n, d] transposed to [b, n, h, d]: a strided view.
    let strided = |t: &Tensor| t.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap();
    let (qs, ks, vs) = (strided(&x.q), strided(&x.k), strided(&x.v));
    assert!(!qs.is_contiguous());
    let (o1, l1) = attention_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
    let (o2, l2) = attention_forward(&qs, &ks, &vs, &c.spec).unwrap();
    assert_eq!(values(&o1), values(&o2));
    assert_eq!(values(&l1), values(&l2));
}

/// Bad inputs are typed errors that name the shapes.
#[test]
fn bad_inputs_are_typed_errors() {
    let t = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
    let s = AttentionSpec::causal();
    let msg = |e: &Error| e.to_string();

    // Heads not divisible by kv heads.
    let e = attention_forward(&t(&[1, 8, 6, 16]), &t(&[1, 8, 4, 16]), &t(&[1, 8, 4, 16]), &s).unwrap_err();
    assert!(matches!(&e, Error::Core(c) if matches!(**c, autosp_core::Error::ShapeMismatch { .. })), "{e}");
    assert!(msg(&e).contains("[1, 8, 6, 16]") && msg(&e).contains("[1, 8, 4, 16]"), "{e}");

    // Mismatched k and v.
    let e = attention_forward(&t(&[1, 8, 4, 16]), &t(&[1, 8, 4, 16]), &t(&[1, 8, 2, 16]), &s).unwrap_err();
    assert!(matches!(&e, Error::Core(c) if matches!(**c, autosp_core::Error::ShapeMismatch { .. })), "{e}");

    // Mismatched head_dim of q and k.
    let e = attention_forward(&t(&[1, 8, 4, 16]), &t(&[1, 8, 4, 32]), &t(&[1, 8, 4, 32]), &s).unwrap_err();
    assert!(msg(&e).contains("[1, 8, 4, 16]") && msg(&e).contains("[1, 8, 4, 32]"), "{e}");

    // Wrong rank.
    let e = attention_forward(&t(&[8, 4, 16]), &t(&[1, 8, 4, 16]), &t(&[1, 8, 4, 16]), &s).unwrap_err();
    assert!(matches!(&e, Error::Core(c) if matches!(**c, autosp_core::Error::InvalidArgument { .. })), "{e}");
    assert!(msg(&e).contains("[8, 4, 16]"), "{e}");

    // head_dim over the CPU kernel's limit: the kernel itself refuses it; the public function sends it to the
    // device-generic kernel, which takes any head_dim (checked against the naive attention, 1e-5 of 1).
    let big = random(&[1, 5, 2, 320], 77, DType::F32);
    let e = poisoned::cpu_forward(&big, &big, &big, &s).unwrap_err();
    assert!(matches!(e, Error::HeadDim { head_dim: 320, max: 256, .. }), "{e}");
    assert!(msg(&e).contains("[1, 5, 2, 320]"), "{e}");
    let c = Case { b: 1, nq: 5, nk: 5, h: 2, hkv: 2, d: 320, spec: s.clone() };
    let (o, lse) = attention_forward(&big, &big, &big, &s).unwrap();
    let (o_ref, lse_ref) = naive_attention_forward(&big, &big, &big, &s).unwrap();
    assert_close("o, head_dim 320", &c, &o, &o_ref, 1e-5);
    assert_close("lse, head_dim 320", &c, &lse, &lse_ref, 1e-5);
    let e = attention_forward(&t(&[1, 2, 1, 0]), &t(&[1, 2, 1, 0]), &t(&[1, 2, 1, 0]), &s).unwrap_err();
    assert!(matches!(e, Error::HeadDim { head_dim: 0, .. }), "{e}");

    // Mixed dtypes.
    let q = t(&[1, 8, 4, 16]);
    let k64 = q.to_dtype(DType::F64).unwrap();
    let e = attention_forward(&q, &k64, &k64, &s).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { name: "k", .. }), "{e}");

    // Backward: lse of the wrong shape.
    let (o, lse) = attention_forward(&q, &q, &q, &s).unwrap();
    let e = attention_backward(&q, &q, &q, &o, &lse.t().unwrap(), &o, None, &s).unwrap_err();
    assert!(matches!(e, Error::Shape { name: "lse", .. }), "{e}");
    assert!(msg(&e).contains("[1, 4, 8]"), "{e}");
    let e = attention_backward(&q, &q, &q, &o, &lse, &t(&[1, 8, 4, 8]), None, &s).unwrap_err();
    assert!(matches!(e, Error::Shape { name: "d_o", .. }), "{e}");
}

/// Empty sequences: no keys gives o = 0, lse = -inf and zero dq; no queries gives zero dk/dv.
#[test]
fn empty_sequences() {
    let s = AttentionSpec::full();
    let q = random(&[2, 5, 4, 16], 1, DType::F32);
    let kv = Tensor::zeros((2, 0, 2, 16), DType::F32, &Device::Cpu).unwrap();
    let (o, lse) = poisoned::cpu_forward(&q, &kv, &kv, &s).unwrap();
    assert_eq!((o.dims(), lse.dims()), (q.dims(), &[2, 4, 5][..]));
    assert!(values(&o).iter().all(|&x| x == 0.0));
    assert!(values(&lse).iter().all(|&x| x == f64::NEG_INFINITY));
    let (dq, dk, dv) = poisoned::cpu_backward(&q, &kv, &kv, &o, &lse, &q, None, &s).unwrap();
    assert!(values(&dq).iter().all(|&x| x == 0.0));
    assert_eq!((dk.dims(), dv.dims()), (kv.dims(), kv.dims()));

    let q0 = Tensor::zeros((2, 0, 4, 16), DType::F32, &Device::Cpu).unwrap();
    let k = random(&[2, 7, 2, 16], 2, DType::F32);
    let (o, lse) = poisoned::cpu_forward(&q0, &k, &k, &s).unwrap();
    assert_eq!((o.dims(), lse.dims()), (q0.dims(), &[2, 4, 0][..]));
    let (_, dk, dv) = poisoned::cpu_backward(&q0, &k, &k, &o, &lse, &q0, None, &s).unwrap();
    assert!(values(&dk).iter().chain(&values(&dv)).all(|&x| x == 0.0));
}
