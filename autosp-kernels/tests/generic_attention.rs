//! The device-generic attention (`src/attention/generic.rs`, candle tensor ops only) against the
//! fast CPU flash kernel on the CPU: forward o and lse, backward dq/dk/dv with and without d_lse, in f32, f64
//! and bf16; causal and not, MHA/GQA/MQA, q_len != k_len, the position offsets Ring's shards use, rows that
//! see no key. The generic functions are called directly with small blocks (several tiles, diagonal tiles,
//! skipped tiles, a query block that sees no key) and once with the default block (through the door, with the
//! generic kernels forced on the calling thread only, `with_kernels`); the CPU side is
//! `attention_forward/backward` under the default dispatch; the
//! sliding-window cases are held against the naive reference instead.
//!
//! "max relative error" is `max_i |x_i - y_i| / max_i |y_i|` (scale-relative), over the finite entries of y;
//! an lse entry of -inf must be -inf in both. Tolerances: f32 1e-5 (both accumulate in f32 over at most a
//! few hundred keys, in different orders and with exp vs exp2, so they differ by a few f32 ulps of the
//! largest element); f64 1e-10 (the same in f64, far above its rounding); bf16 2^-7 (both compute in f32
//! from the same bf16 inputs and round the results to bf16, whose ulp is 2^-8 of the element: rounding can
//! differ by one ulp, and dq/dk/dv are sums over tiles rounded once).

mod common;

use autosp_core::ops::attention::{naive_attention_backward, naive_attention_forward, AttentionSpec};
use autosp_kernels::attention::{generic_backward_with_block, generic_forward_with_block};
use autosp_kernels::dispatch::generic_calls;
use autosp_kernels::{attention_backward, attention_forward, with_kernels, Error, Kernels};
use candle_core::{DType, Tensor};
use common::{inputs, spec, values, Case};

/// `f` with the device-generic kernels forced on this thread: `attention_forward` / `_backward` then run the
/// generic kernel with its default block for the device.
fn generic<R>(f: impl FnOnce() -> R) -> R {
    let before = generic_calls();
    let out = with_kernels(Kernels::Generic, f);
    assert!(generic_calls() > before, "the forced call must select a generic kernel");
    out
}

/// Tile size for the small shapes: 16 rows × 16 keys, so 70 rows are 5 blocks (the last partial).
const BLOCK: usize = 16;

/// The shapes every numerical check runs.
fn cases() -> Vec<Case> {
    let c = |b, nq, nk, h, hkv, d, spec| Case { b, nq, nk, h, hkv, d, spec };
    vec![
        c(1, 70, 70, 2, 2, 16, spec(true, 0, 0)), // MHA causal: diagonal, partial and skipped tiles
        c(2, 50, 37, 4, 2, 24, spec(false, 0, 0)), // GQA 4/2, full, q_len != k_len, batch 2
        c(1, 48, 48, 4, 1, 16, spec(true, 0, 0)), // MQA causal
        c(1, 40, 30, 4, 2, 16, spec(true, 9, 25)), // rows 0..16 see no key: the whole first query block
        c(1, 50, 50, 2, 1, 8, spec(true, 0, 20)), // keys start mid-queries: a diagonal off the tile grid
        c(1, 32, 64, 2, 2, 16, spec(true, 96, 32)), // Ring: a later query chunk against earlier keys (no mask)
        c(1, 32, 32, 2, 2, 16, spec(true, 32, 32)), // Ring: a chunk against itself at its true positions
        c(1, 20, 45, 2, 1, 16, spec(true, 25, 0)), // KV-cache decoding: queries after a prefix
        c(1, 33, 33, 2, 2, 16, AttentionSpec { scale: Some(0.3), ..spec(true, 0, 0) }), // own scale
    ]
}

/// Asserts `got` matches `want` (same shape and dtype) within `tol` max relative error; -inf entries of
/// `want` must be -inf in `got`; every entry of `got` must be a number.
fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (values(got), values(want));
    let scale = w.iter().filter(|x| x.is_finite()).fold(0f64, |m, x| m.max(x.abs()));
    let mut err = 0f64;
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        assert!(!a.is_nan(), "{what}: NaN at {i}");
        if b == f64::NEG_INFINITY {
            assert_eq!(a, f64::NEG_INFINITY, "{what}: entry {i} must be -inf");
        } else {
            err = err.max((a - b).abs());
        }
    }
    let rel = if scale > 0.0 { err / scale } else { err };
    assert!(rel <= tol, "{what}: max relative error {rel:e} > {tol:e} (max |want| {scale:e})");
}

/// What a generic result is held against: the fast CPU kernel, or the naive reference (for windows, which
/// the CPU kernel gained at the same time, so the naive attention is the independent check).
#[derive(Clone, Copy, Debug)]
enum Reference {
    CpuKernel,
    Naive,
}

/// Generic (with `block`, or the default when None) vs `reference` on one case: forward, backward with and
/// without d_lse.
fn check_case(c: &Case, seed: u64, dtype: DType, tol: f64, block: Option<usize>, reference: Reference) {
    let x = inputs(c, seed, dtype);
    let what = |name: &str| format!("{name} {dtype:?} block {block:?} {reference:?} {c:?}");
    let (o_ref, lse_ref) = match reference {
        Reference::CpuKernel => attention_forward(&x.q, &x.k, &x.v, &c.spec).unwrap(),
        Reference::Naive => naive_attention_forward(&x.q, &x.k, &x.v, &c.spec).unwrap(),
    };
    let (o, lse) = match block {
        Some(bl) => generic_forward_with_block(&x.q, &x.k, &x.v, &c.spec, bl),
        None => generic(|| attention_forward(&x.q, &x.k, &x.v, &c.spec)),
    }
    .unwrap();
    assert_close(&what("o"), &o, &o_ref, tol);
    assert_close(&what("lse"), &lse, &lse_ref, tol);
    for d_lse in [None, Some(&x.d_lse)] {
        let want = match reference {
            Reference::CpuKernel => {
                attention_backward(&x.q, &x.k, &x.v, &o_ref, &lse_ref, &x.d_o, d_lse, &c.spec).unwrap()
            }
            Reference::Naive => {
                naive_attention_backward(&x.q, &x.k, &x.v, &o_ref, &lse_ref, Some(&x.d_o), d_lse, &c.spec).unwrap()
            }
        };
        // Both backwards read the reference's o and lse, so the comparison is of the backward alone.
        let got = match block {
            Some(bl) => generic_backward_with_block(&x.q, &x.k, &x.v, &o_ref, &lse_ref, &x.d_o, d_lse, &c.spec, bl),
            None => generic(|| attention_backward(&x.q, &x.k, &x.v, &o_ref, &lse_ref, &x.d_o, d_lse, &c.spec)),
        }
        .unwrap();
        let tag = if d_lse.is_some() { " with d_lse" } else { "" };
        assert_close(&what(&format!("dq{tag}")), &got.0, &want.0, tol);
        assert_close(&what(&format!("dk{tag}")), &got.1, &want.1, tol);
        assert_close(&what(&format!("dv{tag}")), &got.2, &want.2, tol);
    }
}

#[test]
fn f32_matches_the_cpu_kernel() {
    for (i, c) in cases().iter().enumerate() {
        check_case(c, 100 * i as u64, DType::F32, 1e-5, Some(BLOCK), Reference::CpuKernel);
    }
}

#[test]
fn f64_matches_the_cpu_kernel() {
    for (i, c) in cases().iter().enumerate() {
        check_case(c, 100 * i as u64 + 7, DType::F64, 1e-10, Some(BLOCK), Reference::CpuKernel);
    }
}

/// Other block sizes: 7 (blocks that cut every GQA group and diagonal off the grid), 1 (one row per tile),
/// and the default (one tile for these shapes).
#[test]
fn any_block_size_gives_the_same_result() {
    let cs = cases();
    for c in [cs[0], cs[1], cs[3], cs[4]] {
        for block in [Some(7), Some(1), None] {
            check_case(&c, 31, DType::F32, 1e-5, block, Reference::CpuKernel);
        }
    }
}

#[test]
fn bf16_matches_the_cpu_kernel() {
    let cs = cases();
    for (i, c) in [cs[0], cs[1], cs[3]].iter().enumerate() {
        let x = inputs(c, 500 + i as u64, DType::BF16);
        let (o, lse) = generic_forward_with_block(&x.q, &x.k, &x.v, &c.spec, BLOCK).unwrap();
        assert_eq!((o.dtype(), lse.dtype()), (DType::BF16, DType::F32));
        check_case(c, 500 + i as u64, DType::BF16, 1.0 / 128.0, Some(BLOCK), Reference::CpuKernel);
    }
}

/// Rows that see no key: lse = -inf, o = 0, and every gradient finite (0 for those rows' dq).
#[test]
fn rows_that_see_no_key_give_minus_inf_zero_and_finite_gradients() {
    // Query positions 9..49 against key positions 25..55: query rows 0..16 see nothing.
    let c = cases()[3];
    let blind_rows = c.spec.k_offset - c.spec.q_offset;
    let x = inputs(&c, 900, DType::F32);
    let (o, lse) = generic_forward_with_block(&x.q, &x.k, &x.v, &c.spec, BLOCK).unwrap();
    let (lse_v, o_v) = (values(&lse), values(&o));
    for bh in 0..c.b * c.h {
        for i in 0..c.nq {
            let blind = c.spec.q_offset + i < c.spec.k_offset;
            let l = lse_v[bh * c.nq + i];
            assert_eq!(l == f64::NEG_INFINITY, blind, "head {bh} row {i}: lse {l}");
        }
    }
    let row = c.h * c.d;
    for bi in 0..c.b {
        for i in 0..blind_rows {
            let at = (bi * c.nq + i) * row;
            assert!(o_v[at..at + row].iter().all(|&x| x == 0.0), "row {i} of o must be 0");
        }
    }
    let (dq, dk, dv) =
        generic_backward_with_block(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, Some(&x.d_lse), &c.spec, BLOCK).unwrap();
    for (name, t) in [("dk", &dk), ("dv", &dv)] {
        assert!(values(t).iter().all(|x| x.is_finite()), "{name} has a non-finite entry");
    }
    let dq_v = values(&dq);
    assert!(dq_v.iter().all(|x| x.is_finite()), "dq has a non-finite entry");
    for bi in 0..c.b {
        for i in 0..blind_rows {
            let at = (bi * c.nq + i) * row;
            assert!(dq_v[at..at + row].iter().all(|&x| x == 0.0), "row {i} of dq must be 0");
        }
    }
    // And when no query sees any key at all: every lse -inf, o and every gradient 0.
    let blind = AttentionSpec { causal: true, scale: None, q_offset: 0, k_offset: 100, max_distance: None };
    let (o, lse) = generic_forward_with_block(&x.q, &x.k, &x.v, &blind, BLOCK).unwrap();
    assert!(values(&lse).iter().all(|&l| l == f64::NEG_INFINITY));
    assert!(values(&o).iter().all(|&v| v == 0.0));
    let grads = generic(|| attention_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, Some(&x.d_lse), &blind)).unwrap();
    for t in [&grads.0, &grads.1, &grads.2] {
        assert!(values(t).iter().all(|&v| v == 0.0));
    }
}

/// Strided inputs (a `[b, heads, n, d]` tensor transposed to the layout) give the bits of contiguous ones.
#[test]
fn strided_inputs_give_the_same_result() {
    let c = cases()[1];
    let x = inputs(&c, 77, DType::F32);
    let strided = |t: &Tensor| t.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap();
    let (qs, ks, vs, dos) = (strided(&x.q), strided(&x.k), strided(&x.v), strided(&x.d_o));
    assert!(!qs.is_contiguous());
    let (o1, l1) = generic_forward_with_block(&x.q, &x.k, &x.v, &c.spec, BLOCK).unwrap();
    let (o2, l2) = generic_forward_with_block(&qs, &ks, &vs, &c.spec, BLOCK).unwrap();
    assert_eq!((values(&o1), values(&l1)), (values(&o2), values(&l2)));
    let g1 = generic_backward_with_block(&x.q, &x.k, &x.v, &o1, &l1, &x.d_o, None, &c.spec, BLOCK).unwrap();
    let g2 = generic_backward_with_block(&qs, &ks, &vs, &strided(&o1), &l1, &dos, None, &c.spec, BLOCK).unwrap();
    for (a, b) in [(&g1.0, &g2.0), (&g1.1, &g2.1), (&g1.2, &g2.2)] {
        assert_eq!(values(a), values(b));
    }
}

/// Misuse is the same typed error whichever kernel would have run: the door checks before it routes.
#[test]
fn bad_inputs_are_typed_errors() {
    let c = cases()[0];
    let x = inputs(&c, 1, DType::F32);
    let k64 = x.k.to_dtype(DType::F64).unwrap();
    let e = with_kernels(Kernels::Generic, || attention_forward(&x.q, &k64, &x.v, &c.spec)).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { name: "k", .. }), "{e}");
    let (o, lse) = generic(|| attention_forward(&x.q, &x.k, &x.v, &c.spec)).unwrap();
    let short = lse.narrow(2, 0, 3).unwrap();
    let e = with_kernels(Kernels::Generic, || attention_backward(&x.q, &x.k, &x.v, &o, &short, &x.d_o, None, &c.spec))
        .unwrap_err();
    assert!(matches!(e, Error::Shape { name: "lse", .. }), "{e}");
}

/// Sliding windows (`max_distance`), causal and not, with offsets, GQA/MQA, q_len != k_len, rows that see no
/// key, windows narrower and wider than a block and than the sequence: generic vs the naive reference
/// (`naive_attention_forward/backward`, which materialises the scores and applies `AttentionSpec::visible`;
/// the CPU flash kernel is not the reference here). Tolerances: f32 1e-5 and f64 1e-10 as above (the naive
/// reference also accumulates in the compute dtype, in yet another order).
#[test]
fn sliding_windows_match_the_naive_reference() {
    let c = |b, nq, nk, h, hkv, d, causal, qo, ko, w| Case {
        b,
        nq,
        nk,
        h,
        hkv,
        d,
        spec: spec(causal, qo, ko).with_max_distance(w),
    };
    let cases = [
        c(1, 70, 70, 2, 2, 16, true, 0, 0, 5), // causal, window < block: one masked band per block
        c(1, 70, 70, 2, 2, 16, true, 0, 0, 20), // causal, window > block: full chunks between the edges
        c(1, 70, 70, 2, 2, 16, false, 0, 0, 9), // not causal: a band on both sides of the diagonal
        c(2, 50, 37, 4, 2, 24, false, 0, 0, 13), // GQA, q_len != k_len: the last rows past every key's window
        c(1, 48, 48, 4, 1, 16, true, 0, 0, 1), // MQA, window 1: each row sees itself and the row before
        c(1, 40, 30, 4, 2, 16, true, 9, 25, 11), // rows before the keys and rows whose window ends before them
        c(1, 32, 64, 2, 2, 16, true, 96, 32, 40), // Ring: a later chunk, the window cuts into the keys
        c(1, 32, 64, 2, 2, 16, true, 96, 32, 20), // Ring: the window ends before these keys: no row sees one
        c(1, 20, 45, 2, 1, 16, false, 25, 0, 30), // not causal with offsets: the window reaches past the queries
        c(1, 33, 33, 2, 2, 16, true, 0, 0, 1000), // a window wider than everything: plain causal
    ];
    for (i, c) in cases.iter().enumerate() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-10)] {
            for block in [Some(BLOCK), Some(7), None] {
                check_case(c, 1000 + 10 * i as u64, dtype, tol, block, Reference::Naive);
            }
        }
    }
}

/// A window computes only the keys near each query: with a window the result must not change when the keys
/// outside every row's window are replaced (by NaN here, which would poison any product that read them).
#[test]
fn keys_outside_the_window_are_never_read() {
    let c = Case { b: 1, nq: 96, nk: 96, h: 2, hkv: 2, d: 16, spec: spec(true, 0, 0).with_max_distance(10) };
    let x = inputs(&c, 4242, DType::F32);
    let (o, lse) = generic_forward_with_block(&x.q, &x.k, &x.v, &c.spec, BLOCK).unwrap();
    // Query rows 80..96 see keys 70..96 only; keep the queries 80.. and NaN the keys before 70.
    let (q_tail, do_tail) = (x.q.narrow(1, 80, 16).unwrap(), x.d_o.narrow(1, 80, 16).unwrap());
    let poison = |t: &Tensor| {
        let nan = Tensor::full(f32::NAN, (1, 70, 2, 16), t.device()).unwrap();
        Tensor::cat(&[&nan, &t.narrow(1, 70, 26).unwrap()], 1).unwrap()
    };
    let tail = AttentionSpec { q_offset: 80, ..c.spec };
    let (kp, vp) = (poison(&x.k), poison(&x.v));
    let (o_t, lse_t) = generic_forward_with_block(&q_tail, &kp, &vp, &tail, BLOCK).unwrap();
    assert_close("o of the last rows", &o_t, &o.narrow(1, 80, 16).unwrap(), 1e-6);
    assert_close("lse of the last rows", &lse_t, &lse.narrow(2, 80, 16).unwrap(), 1e-6);
    let (o_tail, lse_tail) = (o.narrow(1, 80, 16).unwrap(), lse.narrow(2, 80, 16).unwrap());
    let (dq, dk, dv) =
        generic_backward_with_block(&q_tail, &kp, &vp, &o_tail, &lse_tail, &do_tail, None, &tail, BLOCK).unwrap();
    for (name, t) in [("dq", &dq), ("dk", &dk), ("dv", &dv)] {
        assert!(values(t).iter().all(|v| v.is_finite()), "{name} read a key outside the window");
    }
    // The keys no row sees get exactly 0.
    assert!(values(&dk.narrow(1, 0, 70).unwrap()).iter().all(|&v| v == 0.0));
}

/// The generic forward first bounds each row's scores by `|q_i| · max_j |k_j|` and takes the online pass
/// only when that bound is too loose for f32. Here one key of each kv head has a large norm along a feature
/// every query has 0 in, so its scores are 0 while it inflates every row's bound by `norm · |q_i| · scale`
/// (|q_i| about 4.5 here, inputs uniform in [-2, 2) over 15 features; scale 1/4): norm 13 puts the bounds
/// about 15 above the largest scores and norm 40 about 45 (terms near e^-45 ≈ 3e-20): both are within the
/// bounded pass's range (row sums above the 40 · 2^-100 floor for rows with |q_i| up to about 6), and with
/// the fallback disabled both still pass here (checked by hand) while norm 2500 turns to NaN. Norm 2500 (bounds about 2800
/// above: every term underflows to 0) must be taken over by the online pass. Each must match the CPU kernel
/// within the f32 tolerance of the other tests.
#[test]
fn loose_score_bounds_keep_f32_precision_or_fall_back() {
    let c = Case { b: 1, nq: 40, nk: 40, h: 4, hkv: 2, d: 16, spec: spec(true, 0, 0) };
    for big in [13f32, 40.0, 2500.0] {
        let x = inputs(&c, 7, DType::F32);
        let mut keep = vec![1f32; c.d];
        keep[0] = 0.0;
        let keep = Tensor::new(keep.as_slice(), x.q.device()).unwrap();
        let q = x.q.broadcast_mul(&keep).unwrap();
        let mut first = vec![0f32; c.hkv * c.d];
        for hk in 0..c.hkv {
            first[hk * c.d] = big;
        }
        let first = Tensor::from_vec(first, (1, 1, c.hkv, c.d), q.device()).unwrap();
        let k = Tensor::cat(&[&first, &x.k.narrow(1, 1, c.nk - 1).unwrap()], 1).unwrap();
        let (o_ref, lse_ref) = attention_forward(&q, &k, &x.v, &c.spec).unwrap();
        for block in [Some(BLOCK), None] {
            let (o, lse) = match block {
                Some(bl) => generic_forward_with_block(&q, &k, &x.v, &c.spec, bl),
                None => generic(|| attention_forward(&q, &k, &x.v, &c.spec)),
            }
            .unwrap();
            assert_close(&format!("o, key norm {big}, block {block:?}"), &o, &o_ref, 1e-5);
            assert_close(&format!("lse, key norm {big}, block {block:?}"), &lse, &lse_ref, 1e-5);
        }
    }
}
