//! The device-generic attention (`src/attention/generic.rs`, candle tensor ops only) against the
//! fast CPU flash kernel on the CPU: forward o and lse, backward dq/dk/dv with and without d_lse, in f32, f64,
//! bf16 and f16, and with sink keys (a few keys of very large norm); causal and not, MHA/GQA/MQA, q_len != k_len, the position offsets Ring's shards use, rows that
//! see no key. The generic functions are called directly with small blocks (several tiles, diagonal tiles,
//! skipped tiles, a query block that sees no key) and once with the default block (through the door, with the
//! generic kernels forced on the calling thread only, `with_kernels`); the CPU side is
//! `attention_forward/backward` under the default dispatch; the
//! sliding-window cases are held against the naive reference instead.
//!
//! "max relative error" is `max_i |x_i - y_i| / max_i |y_i|` (scale-relative), over the finite entries of y;
//! an lse entry of -inf must be -inf in both. Tolerances: f32 1e-5 (both accumulate in f32 over at most a
//! few hundred keys, in different orders and with exp vs exp2, so they differ by a few f32 ulps of the
//! largest element); f64 1e-10 (the same in f64, far above its rounding).
//!
//! bf16 and f16: the generic kernel's tile products are GEMMs in the input dtype, so unlike the CPU kernel
//! (which widens the inputs and computes in f32) it rounds each product to the input dtype before converting
//! it to f32: the scores carry `|S| · u` in the exponent (`u` the unit roundoff, 2^-9 for bf16, 2^-12 for
//! f16), P and dS a relative `u` as GEMM operands, and the outputs a last rounding. With scores of a few
//! units (|S| up to about 10 here) that is about 1e-2 of the largest element in bf16 and 1e-3 in f16. They
//! are held against the f32 CPU kernel on the same rounded inputs (and, in bf16, against the CPU kernel in
//! bf16, which also rounds its outputs), the generic backward reading its own forward's o and lse. Worst
//! measured over the cases below, forward and backward: bf16 1.45e-2 (dq against the bf16 CPU kernel; 1.16e-2
//! against f32), f16 1.7e-3; the tolerances, about twice that: bf16 3e-2, f16 4e-3. Sink keys, whose scores
//! reach ±190, have their own (see `sink_keys_match_the_cpu_kernel`).

mod common;

use autosp_core::ops::attention::{naive_attention_backward, naive_attention_forward, AttentionDims, AttentionSpec};
use autosp_kernels::attention::{generic_backward_with_block, generic_forward_with_block, TileSize, CHUNK_BUDGET_CPU};
use autosp_kernels::dispatch::generic_calls;
use autosp_kernels::{attention_backward, attention_forward, with_kernels, Error, Kernels};
use candle_core::{DType, Device, Tensor};
use common::{inputs, spec, values, Case, Inputs};

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
    /// The CPU kernel in f32 on the same inputs widened to f32 (for bf16/f16 inputs: the generic result,
    /// widened, is held against the f32 attention of the rounded inputs).
    CpuKernelF32,
    Naive,
}

/// Generic (with `block`, or the default when None) vs `reference` on one case: forward, backward with and
/// without d_lse.
fn check_case(c: &Case, seed: u64, dtype: DType, tol: f64, block: Option<usize>, reference: Reference) {
    check_inputs(c, &inputs(c, seed, dtype), tol, block, reference);
}

/// [`check_case`] on given inputs `x` (in one dtype).
fn check_inputs(c: &Case, x: &Inputs, tol: f64, block: Option<usize>, reference: Reference) {
    let dtype = x.q.dtype();
    let what = |name: &str| format!("{name} {dtype:?} block {block:?} {reference:?} {c:?}");
    let wide = |t: &Tensor| match reference {
        Reference::CpuKernelF32 => t.to_dtype(DType::F32).unwrap(),
        _ => t.clone(),
    };
    let (q, k, v, d_o) = (wide(&x.q), wide(&x.k), wide(&x.v), wide(&x.d_o));
    let (o_ref, lse_ref) = match reference {
        Reference::CpuKernel | Reference::CpuKernelF32 => attention_forward(&q, &k, &v, &c.spec).unwrap(),
        Reference::Naive => naive_attention_forward(&q, &k, &v, &c.spec).unwrap(),
    };
    let (o, lse) = match block {
        Some(bl) => generic_forward_with_block(&x.q, &x.k, &x.v, &c.spec, bl),
        None => generic(|| attention_forward(&x.q, &x.k, &x.v, &c.spec)),
    }
    .unwrap();
    assert_eq!((o.dtype(), lse.dtype()), (dtype, if dtype == DType::F64 { DType::F64 } else { DType::F32 }));
    assert_close(&what("o"), &wide(&o), &o_ref, tol);
    assert_close(&what("lse"), &lse, &lse_ref, tol);
    // Both backwards read the reference's o and lse, so the comparison is of the backward alone; except
    // against the f32 kernel, where the generic backward reads its own forward's, as training runs it: its
    // P = exp(S - lse) must see the scores rounded as its forward saw them (one bf16 score of 100 is off by up
    // to 0.2, so against the f32 lse its P would be off by 20%, where against its own lse P still sums to 1).
    let (o_in, lse_in) = match reference {
        Reference::CpuKernelF32 => (o.clone(), lse.clone()),
        Reference::CpuKernel | Reference::Naive => (o_ref.clone(), lse_ref.clone()),
    };
    for d_lse in [None, Some(&x.d_lse)] {
        let want = match reference {
            Reference::CpuKernel | Reference::CpuKernelF32 => {
                attention_backward(&q, &k, &v, &o_ref, &lse_ref, &d_o, d_lse, &c.spec).unwrap()
            }
            Reference::Naive => {
                naive_attention_backward(&q, &k, &v, &o_ref, &lse_ref, Some(&d_o), d_lse, &c.spec).unwrap()
            }
        };
        let got = match block {
            Some(bl) => generic_backward_with_block(&x.q, &x.k, &x.v, &o_in, &lse_in, &x.d_o, d_lse, &c.spec, bl),
            None => generic(|| attention_backward(&x.q, &x.k, &x.v, &o_in, &lse_in, &x.d_o, d_lse, &c.spec)),
        }
        .unwrap();
        assert_eq!((got.0.dtype(), got.1.dtype(), got.2.dtype()), (dtype, dtype, dtype));
        let tag = if d_lse.is_some() { " with d_lse" } else { "" };
        assert_close(&what(&format!("dq{tag}")), &wide(&got.0), &want.0, tol);
        assert_close(&what(&format!("dk{tag}")), &wide(&got.1), &want.1, tol);
        assert_close(&what(&format!("dv{tag}")), &wide(&got.2), &want.2, tol);
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
    for c in [&cs[0], &cs[1], &cs[3], &cs[4]] {
        for block in [Some(7), Some(1), None] {
            check_case(c, 31, DType::F32, 1e-5, block, Reference::CpuKernel);
        }
    }
}

/// The tolerance of bf16 and f16 inputs (see the module doc): 3e-2 and 4e-3.
fn reduced_tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        3e-2
    } else {
        4e-3
    }
}

/// bf16 and f16 inputs (the generic kernel's GEMMs in the input dtype) against the f32 CPU kernel on the same
/// rounded inputs, every case, then a few against the CPU kernel in bf16 itself.
#[test]
fn bf16_and_f16_match_the_f32_cpu_kernel() {
    for dtype in [DType::BF16, DType::F16] {
        for (i, c) in cases().iter().enumerate() {
            check_case(c, 500 + i as u64, dtype, reduced_tol(dtype), Some(BLOCK), Reference::CpuKernelF32);
        }
        check_case(&cases()[1], 590, dtype, reduced_tol(dtype), None, Reference::CpuKernelF32);
    }
    let cs = cases();
    for (i, c) in [&cs[0], &cs[1], &cs[3]].into_iter().enumerate() {
        check_case(c, 600 + i as u64, DType::BF16, reduced_tol(DType::BF16), Some(BLOCK), Reference::CpuKernel);
    }
}

/// Rows that see no key: lse = -inf, o = 0, and every gradient finite (0 for those rows' dq).
#[test]
fn rows_that_see_no_key_give_minus_inf_zero_and_finite_gradients() {
    // Query positions 9..49 against key positions 25..55: query rows 0..16 see nothing.
    let c = cases()[3].clone();
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
    let blind =
        AttentionSpec { causal: true, scale: None, q_offset: 0, k_offset: 100, max_distance: None, documents: None };
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
    let c = cases()[1].clone();
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
    let c = cases()[0].clone();
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
    let tail = AttentionSpec { q_offset: 80, ..c.spec.clone() };
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

/// `x` with the keys at `sinks` (position, factor) multiplied by their factor: "sink" keys of a norm far
/// above the others', like the keys at the first position (BOS) of real checkpoints.
fn with_sinks(c: &Case, x: Inputs, sinks: &[(usize, f64)]) -> Inputs {
    let mut scale = vec![1f64; c.nk];
    for &(j, f) in sinks {
        scale[j] = f;
    }
    let scale = Tensor::from_vec(scale, (1, c.nk, 1, 1), x.k.device()).unwrap().to_dtype(x.k.dtype()).unwrap();
    Inputs { k: x.k.broadcast_mul(&scale).unwrap(), ..x }
}

/// The largest `|q_i · k_j| · scale` of `x` over every pair (masked or not), in f32.
fn max_abs_score(c: &Case, x: &Inputs) -> f64 {
    let heads_major = |t: &Tensor| t.to_dtype(DType::F32).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
    let q = heads_major(&x.q).reshape((c.b, c.hkv, c.h / c.hkv * c.nq, c.d)).unwrap();
    let s = q.matmul(&heads_major(&x.k).t().unwrap()).unwrap();
    values(&s).iter().fold(0f64, |m, v| m.max(v.abs())) * c.spec.scale_for(c.d)
}

/// Sink keys: one or a few keys of norm 20 – 50 times the others' (about 4.6 here), so each row's scores
/// against them reach ±100 while its other scores stay within a few units: rows dominated by a sink, rows
/// that give it no weight, causal and not, GQA/MQA, several tiles, a query block whose first chunk holds
/// only a sink, and the default tiles. Against the CPU kernel: f32 within 1e-4 (the scores near 100 carry
/// an f32 rounding of `|S| · 2^-24` ≈ 1e-5 in the exponent, differently in the two kernels, exp against
/// exp2 of `S · log2 e`; dq sums it against keys 30 – 50 times the others' norm; worst measured 2.7e-5), f64
/// within 1e-10. bf16 and f16 against the f32 CPU kernel on the same rounded inputs: the scores are rounded
/// to the input dtype by its GEMM, `|S| · 2^-9` (bf16) or `|S| · 2^-12` (f16) in the exponent, up to 0.2 for
/// a bf16 score of 100, which no tile or accumulator order can undo; so the tolerance is [`reduced_tol`] or
/// `|S|max · u` with `u` that unit roundoff, whichever is larger (worst measured: 0.36 · |S|max · u in
/// bf16, 0.28 in f16, for |S|max 80 – 190: 1e-1 and 8e-3 of the largest element).
#[test]
fn sink_keys_match_the_cpu_kernel() {
    let cs = cases();
    let sinks: [(Case, &[(usize, f64)]); 5] = [
        (cs[0].clone(), &[(0, 30.0)]),                         // causal, one sink at the first key
        (cs[1].clone(), &[(0, 50.0), (20, 20.0)]),             // GQA, full, batch 2: two sinks
        (cs[2].clone(), &[(0, 40.0), (17, 25.0), (33, 30.0)]), // MQA causal: sinks in three key blocks
        (cs[4].clone(), &[(0, 20.0)]),                         // keys start mid-queries: the sink is on the diagonal
        (cs[5].clone(), &[(0, 30.0), (63, 30.0)]),             // Ring: a later chunk, sinks at both ends
    ];
    for (i, (c, at)) in sinks.iter().enumerate() {
        let seed = 3000 + 10 * i as u64;
        for (dtype, unit, reference) in [
            (DType::F32, None, Reference::CpuKernel),
            (DType::F64, None, Reference::CpuKernel),
            (DType::BF16, Some(2f64.powi(-9)), Reference::CpuKernelF32),
            (DType::F16, Some(2f64.powi(-12)), Reference::CpuKernelF32),
        ] {
            let x = with_sinks(c, inputs(c, seed, dtype), at);
            let tol = match (dtype, unit) {
                (DType::F32, _) => 1e-4,
                (DType::F64, _) => 1e-10,
                (_, Some(u)) => reduced_tol(dtype).max(max_abs_score(c, &x) * u),
                (_, None) => unreachable!("bf16 and f16 have a unit roundoff"),
            };
            for block in [Some(BLOCK), None] {
                check_inputs(c, &x, tol, block, reference);
            }
        }
    }
}

/// The default tiles on the CPU: 256 rows × 1024 keys while one score chunk (f32, plus its bf16/f16 copy)
/// fits `CHUNK_BUDGET_CPU`; halved, keys first, in multiples of 64 when batch · heads grows.
#[test]
fn default_tiles_fit_the_chunk_budget() {
    let dims = |batch, heads| AttentionDims { batch, q_len: 8192, k_len: 8192, heads, kv_heads: heads, head_dim: 64 };
    let cpu = Device::Cpu;
    let tiles = |b, h, dtype| TileSize::for_call(&dims(b, h), dtype, &cpu);
    assert_eq!(tiles(1, 8, DType::F32), TileSize { rows: 256, keys: 1024 });
    assert_eq!(tiles(1, 8, DType::BF16), TileSize { rows: 256, keys: 1024 });
    assert_eq!(tiles(1, 32, DType::F32), TileSize { rows: 256, keys: 1024 });
    assert_eq!(tiles(1, 32, DType::BF16), TileSize { rows: 256, keys: 512 });
    assert_eq!(tiles(4, 32, DType::F32), TileSize { rows: 256, keys: 256 });
    for (b, h, dtype, bytes) in [(2, 32, DType::F64, 8), (8, 64, DType::F16, 6), (64, 64, DType::F32, 4)] {
        let t = tiles(b, h, dtype);
        assert!(t.rows.is_multiple_of(64) && t.keys.is_multiple_of(64) && t.keys >= t.rows, "{t:?}");
        let fits = b * h * t.rows * t.keys * bytes <= CHUNK_BUDGET_CPU;
        assert!(fits || t == TileSize { rows: 64, keys: 64 }, "{t:?} for batch {b}, heads {h}, {dtype:?}");
    }
}
