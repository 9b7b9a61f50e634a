//! Every device-generic op (`autosp_kernels::generic`, candle tensor ops only) against its fast CPU kernel,
//! called directly on the CPU: RMSNorm (forward, reciprocal, backward with and without it), RoPE (both table
//! shapes), SwiGLU, the chunked linear + cross-entropy (ignored targets; the CPU kernel's chunk does not divide
//! the rows, the generic kernel's own tiles hold them all: `chunked_loss.rs` runs it in many tiles)
//! and the Ring LSE merge (rows with lse = -inf on either or both sides); f32, f64, bf16 and f16 inputs, and
//! non-contiguous ones. This binary never switches the global kernel choice, so the public functions run the
//! fast CPU kernels here.
//!
//! "max relative error" is `max_i |x_i - y_i| / max_i |y_i|`: scale-relative, so one tolerance holds for
//! elements of every size (elementwise relative error blows up on the near-zero elements of a gradient).
//! Tolerances and why:
//! - f32 1e-5, f64 1e-10: both sides compute the same expressions in the same dtype; only the order of
//!   reductions (the CPU kernels' eight-lane sums vs candle's reductions) and a few reassociated products
//!   differ, which moves results by a few ulps of the largest element (~1e-7 in f32, ~1e-16 in f64). The
//!   bounds leave two orders of magnitude for longer sums, and are still far below any real error (a wrong
//!   sign, a missing term or a wrong index moves results by O(1)).
//! - bf16 2^-7, f16 2^-10 (outputs in those dtypes): both sides widen the same inputs to f32, compute, and
//!   round to the narrow dtype; two f32 results a few ulps apart can round to neighbouring narrow values, one
//!   ulp of an element, which is at most 2^-7 (bf16, 8 significand bits) or 2^-10 (f16, 11 bits) of the
//!   largest element. Statistics that stay in f32 (the reciprocal RMS, the merged lse) keep the f32
//!   tolerance.
//! - The chunked loss with bf16/f16 inputs (see [`loss_tol`]): the generic kernel runs its GEMMs in the
//!   inputs' dtype where the CPU kernel widens to f32 first, so each logit is rounded (unit roundoff u = 2^-8
//!   bf16, 2^-11 f16) and so is `dlogits` before the gradient GEMMs. The loss (f32) is held to u/4: a row's
//!   `lse - logit[target]` moves by at most 2u·max|logit|, but independent roundings cancel in the sum
//!   (measured at most 3.5e-4 bf16, 4.4e-5 f16: about 0.09u, a third of the tolerance). The gradients to two
//!   ulps of the largest element, 2^-6 bf16 and 2^-9 f16 (their own rounding plus the rounded operands;
//!   measured at most 7.6e-3 and 7.4e-4, half of it and less).

use autosp_core::gradcheck::probe;
use autosp_core::ops::rope::{default_inv_freq, rope_tables};
use autosp_kernels::dispatch::generic_calls;
use autosp_kernels::merge::RunningAttention;
use autosp_kernels::{chunked_cross_entropy_backward, chunked_cross_entropy_forward, with_kernels, Kernels};
use autosp_kernels::{cross_entropy, rms_norm, rope, swiglu};
use candle_core::{DType, Device, Tensor};

/// `f` with the device-generic kernels forced on this thread: each op's door then runs its generic kernel on
/// the CPU tensors, and the same call outside runs the CPU kernel.
fn gen<R>(f: impl FnOnce() -> R) -> R {
    let before = generic_calls();
    let out = with_kernels(Kernels::Generic, f);
    assert!(generic_calls() > before, "the forced call must select a generic kernel");
    out
}

/// The generic LSE merge through its door: `(o_a, lse_a)` merged with `(o_b, lse_b)`, `o` in `o_a`'s dtype.
fn generic_merge(o_a: &Tensor, lse_a: &Tensor, o_b: &Tensor, lse_b: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    gen(|| {
        let mut run = RunningAttention::new(o_a, lse_a)?;
        run.merge(o_b, lse_b)?;
        run.finish()
    })
}

fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// The max relative error `max_i |a_i - b_i| / max_i |b_i|` (b the reference, the CPU kernel's result).
fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    assert_eq!(a.dtype(), b.dtype(), "the generic op must return the CPU kernel's dtype");
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert!(a.iter().all(|v| v.is_finite()), "the generic result has a non-finite element");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// The tolerance for results in `dtype` (see the module doc).
fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 1e-5,
        DType::BF16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
        other => panic!("no tolerance for {other:?}"),
    }
}

fn assert_close(what: &str, generic: &Tensor, cpu: &Tensor) {
    assert_within(what, generic, cpu, tol(cpu.dtype()));
}

fn assert_within(what: &str, generic: &Tensor, cpu: &Tensor, t: f64) {
    let e = max_rel(generic, cpu);
    assert!(e <= t, "{what} ({:?}): generic vs CPU max relative error {e} > {t}", cpu.dtype());
}

/// The chunked loss's `(loss, gradient)` tolerances for inputs in `dtype` (see the module doc): [`tol`]'s
/// for f32 and f64, looser for bf16 and f16, whose GEMMs the generic kernel runs in that dtype.
fn loss_tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::BF16 => (2f64.powi(-10), 2f64.powi(-6)),
        DType::F16 => (2f64.powi(-13), 2f64.powi(-9)),
        dtype => (tol(dtype), tol(dtype)),
    }
}

const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];
const EPS: f64 = 1e-5;

/// `[rows, d]` as a non-contiguous view: the transpose of a `[d, rows]` tensor (the last dim has stride rows).
fn transposed(rows: usize, d: usize, seed: u64, dtype: DType) -> Tensor {
    let t = rand(&[d, rows], seed, dtype).t().unwrap();
    assert!(!t.is_contiguous());
    t
}

#[test]
fn rms_norm_generic_equals_cpu() {
    for dtype in DTYPES {
        // 37 columns: not a multiple of the CPU kernel's eight lanes. Rows shaped [3, 7] and as a strided view.
        let w = rand(&[37], 2, dtype).affine(0.5, 1.0).unwrap();
        for (name, x, g) in [
            ("contiguous", rand(&[3, 7, 37], 1, dtype), rand(&[3, 7, 37], 3, dtype)),
            ("transposed", transposed(21, 37, 4, dtype), transposed(21, 37, 5, dtype)),
        ] {
            let what = |s: &str| format!("rms_norm {s} {name}");
            let y = gen(|| rms_norm::rms_norm_forward(&x, &w, EPS)).unwrap();
            assert_close(&what("forward"), &y, &rms_norm::rms_norm_forward(&x, &w, EPS).unwrap());
            let r = gen(|| rms_norm::rms_norm_recip(&x, EPS)).unwrap();
            assert_close(&what("recip"), &r, &rms_norm::rms_norm_recip(&x, EPS).unwrap());
            let (dx, dw) = gen(|| rms_norm::rms_norm_backward(&x, &w, &g, EPS, None)).unwrap();
            let (cdx, cdw) = rms_norm::rms_norm_backward(&x, &w, &g, EPS, None).unwrap();
            assert_close(&what("dx"), &dx, &cdx);
            assert_close(&what("dw"), &dw, &cdw);
            // With the saved reciprocals: the same gradients.
            let (dx_r, dw_r) = gen(|| rms_norm::rms_norm_backward(&x, &w, &g, EPS, Some(&r))).unwrap();
            assert_close(&what("dx (recip given)"), &dx_r, &cdx);
            assert_close(&what("dw (recip given)"), &dw_r, &cdw);
        }
    }
    // The same typed error for a bad weight.
    let x = rand(&[4, 8], 1, DType::F32);
    let e = with_kernels(Kernels::Generic, || rms_norm::rms_norm_forward(&x, &rand(&[7], 2, DType::F32), EPS))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[4, 8]") && e.contains("[7]"), "{e}");
}

#[test]
fn rope_generic_equals_cpu() {
    let (b, n, h, d) = (2, 5, 3, 12);
    let positions: Vec<usize> = (7..7 + n).collect();
    for dtype in DTYPES {
        let (cos, sin) = rope_tables(&positions, &default_inv_freq(d, 10000.0), dtype, &Device::Cpu).unwrap();
        // Per-batch tables [b, n, d/2]: batch 1 shifted by 3 positions.
        let shifted: Vec<usize> = positions.iter().map(|p| p + 3).collect();
        let (cos2, sin2) = rope_tables(&shifted, &default_inv_freq(d, 10000.0), dtype, &Device::Cpu).unwrap();
        let cos_b = Tensor::stack(&[&cos, &cos2], 0).unwrap();
        let sin_b = Tensor::stack(&[&sin, &sin2], 0).unwrap();
        // x contiguous, and as the head-split view of a fused QKV projection (non-contiguous).
        let qkv = rand(&[b, n, 3 * h, d], 11, dtype);
        let view = qkv.narrow(2, h, h).unwrap();
        assert!(!view.is_contiguous());
        // A view whose last dim is strided too.
        let tview = rand(&[b, n, d, h], 12, dtype).transpose(2, 3).unwrap();
        for (name, x) in [("contiguous", rand(&[b, n, h, d], 10, dtype)), ("qkv view", view), ("transposed", tview)] {
            for (tables, c, s) in [("[n, d/2]", &cos, &sin), ("[b, n, d/2]", &cos_b, &sin_b)] {
                let what = |p: &str| format!("rope {p} {name} tables {tables}");
                let y = gen(|| rope::rope_forward(&x, c, s)).unwrap();
                assert!(y.is_contiguous());
                assert_close(&what("forward"), &y, &rope::rope_forward(&x, c, s).unwrap());
                let dx = gen(|| rope::rope_backward(&x, c, s)).unwrap();
                assert_close(&what("backward"), &dx, &rope::rope_backward(&x, c, s).unwrap());
            }
        }
    }
}

#[test]
fn swiglu_generic_equals_cpu() {
    for dtype in DTYPES {
        // Gates over [-4, 4): silu's curved part and both tails.
        for (name, a, u, g) in [
            (
                "contiguous",
                rand(&[6, 41], 20, dtype).affine(4.0, 0.0).unwrap(),
                rand(&[6, 41], 21, dtype),
                rand(&[6, 41], 22, dtype),
            ),
            (
                "transposed",
                transposed(6, 41, 23, dtype).affine(4.0, 0.0).unwrap(),
                transposed(6, 41, 24, dtype),
                transposed(6, 41, 25, dtype),
            ),
        ] {
            let y = gen(|| swiglu::swiglu_forward(&a, &u)).unwrap();
            assert_close(&format!("swiglu forward {name}"), &y, &swiglu::swiglu_forward(&a, &u).unwrap());
            let (da, du) = gen(|| swiglu::swiglu_backward(&a, &u, &g)).unwrap();
            let (cda, cdu) = swiglu::swiglu_backward(&a, &u, &g).unwrap();
            assert_close(&format!("swiglu d_gate {name}"), &da, &cda);
            assert_close(&format!("swiglu d_up {name}"), &du, &cdu);
        }
    }
}

/// Targets in [0, vocab) with every `skip`-th one (from the 4th) ignored (-100).
fn targets(m: usize, vocab: usize, skip: usize) -> Tensor {
    let t: Vec<i64> = (0..m).map(|i| if i % skip == 3 { -100 } else { ((i * 7919 + 13) % vocab) as i64 }).collect();
    Tensor::new(t, &Device::Cpu).unwrap()
}

#[test]
fn chunked_cross_entropy_generic_equals_cpu() {
    // 23 rows (the CPU kernel's chunks of 5, the last one 3; the generic kernel in one tile), every 4th target
    // ignored; logits of size ~3.
    let (m, d, vocab, chunk) = (23, 16, 29, 5);
    let tg = targets(m, vocab, 4);
    for dtype in DTYPES {
        let hidden = rand(&[m, d], 30, dtype).affine(2.0, 0.0).unwrap();
        let lm_head = rand(&[vocab, d], 31, dtype);
        // hidden also as a non-contiguous view.
        let hidden_t = rand(&[d, m], 32, dtype).affine(2.0, 0.0).unwrap().t().unwrap();
        for (name, h) in [("contiguous", &hidden), ("transposed", &hidden_t)] {
            let (loss, count) = gen(|| cross_entropy::chunked_cross_entropy_forward(h, &lm_head, &tg, chunk)).unwrap();
            let (closs, ccount) = chunked_cross_entropy_forward(h, &lm_head, &tg, chunk).unwrap();
            // The loss is a statistic: f32 (f64 for f64), never rounded to a narrow hidden dtype.
            let loss_dtype = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
            assert_eq!((loss.dtype(), closs.dtype()), (loss_dtype, loss_dtype));
            assert_eq!(loss.dims(), &[] as &[usize]);
            assert_eq!((count, ccount), (m - m.div_ceil(4) + 1, m - m.div_ceil(4) + 1));
            let (loss_t, grad_t) = loss_tol(dtype);
            assert_within(&format!("loss {name} {dtype:?}"), &loss, &closs, loss_t);
            for grad in [1.0, -0.37] {
                let (dh, dw) =
                    gen(|| cross_entropy::chunked_cross_entropy_backward(h, &lm_head, &tg, chunk, grad)).unwrap();
                let (cdh, cdw) = chunked_cross_entropy_backward(h, &lm_head, &tg, chunk, grad).unwrap();
                assert_eq!((dh.dtype(), dw.dtype()), (dtype, dtype));
                assert_within(&format!("d_hidden {name} grad {grad}"), &dh, &cdh, grad_t);
                assert_within(&format!("d_lm_head {name} grad {grad}"), &dw, &cdw, grad_t);
            }
        }
    }
    // An ignored row contributes nothing: its d_hidden row is exactly 0.
    let hidden = rand(&[m, d], 30, DType::F32);
    let lm_head = rand(&[vocab, d], 31, DType::F32);
    let (dh, _) = gen(|| cross_entropy::chunked_cross_entropy_backward(&hidden, &lm_head, &tg, chunk, 1.0)).unwrap();
    let row3 = dh.get(3).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(row3, 0.0);
    // u32 targets (none ignored) give the CPU kernel's results too.
    let tg_u32 = Tensor::new((0..m as u32).map(|i| (i * 5) % vocab as u32).collect::<Vec<_>>(), &Device::Cpu).unwrap();
    let (l, c) = gen(|| cross_entropy::chunked_cross_entropy_forward(&hidden, &lm_head, &tg_u32, chunk)).unwrap();
    let (cl, cc) = chunked_cross_entropy_forward(&hidden, &lm_head, &tg_u32, chunk).unwrap();
    assert_eq!((c, cc), (m, m));
    assert_close("loss (u32 targets)", &l, &cl);
    // An out-of-range target is a typed error naming it.
    let mut bad: Vec<i64> = (0..m as i64).map(|i| i % vocab as i64).collect();
    bad[7] = vocab as i64 + 4;
    let bad = Tensor::new(bad, &Device::Cpu).unwrap();
    let e = gen(|| cross_entropy::chunked_cross_entropy_forward(&hidden, &lm_head, &bad, chunk)).unwrap_err();
    let e = e.to_string();
    assert!(e.contains(&format!("target {}", vocab + 4)) && e.contains(&format!("{vocab} classes")), "{e}");
}

/// The positions of -inf and the finite values, separately: equal -inf masks, finite values within `tol`.
fn assert_lse_close(what: &str, generic: &Tensor, cpu: &Tensor) {
    let ninf = |t: &Tensor| t.eq(f64::NEG_INFINITY).unwrap();
    let (ga, ca) = (ninf(generic), ninf(cpu));
    assert_eq!(ga.to_vec3::<u8>().unwrap(), ca.to_vec3::<u8>().unwrap(), "{what}: the -inf rows differ");
    let zeros = cpu.zeros_like().unwrap();
    assert_close(what, &ga.where_cond(&zeros, generic).unwrap(), &ca.where_cond(&zeros, cpu).unwrap());
}

#[test]
fn ring_merge_generic_equals_cpu_with_empty_rows() {
    let (b, n, h, d) = (2, 6, 3, 8);
    for acc in [DType::F32, DType::F64] {
        for out in [acc, DType::BF16] {
            let o_a = rand(&[b, n, h, d], 40, out);
            let o_b = rand(&[b, n, h, d], 41, out);
            // LSEs around 2 with a spread of 6: both weights matter, neither underflows.
            let lse = |seed| rand(&[b, h, n], seed, DType::F64).affine(3.0, 2.0).unwrap().to_vec3::<f64>().unwrap();
            let (mut lse_a, mut lse_b) = (lse(42), lse(43));
            // Row 0: a saw no key; row 1: b saw none; row 2: neither (both o = 0, as the flash kernels give).
            for bi in 0..b {
                for hi in 0..h {
                    lse_a[bi][hi][0] = f64::NEG_INFINITY;
                    lse_b[bi][hi][1] = f64::NEG_INFINITY;
                    lse_a[bi][hi][2] = f64::NEG_INFINITY;
                    lse_b[bi][hi][2] = f64::NEG_INFINITY;
                }
            }
            let lse_a = Tensor::new(lse_a, &Device::Cpu).unwrap().to_dtype(acc).unwrap();
            let lse_b = Tensor::new(lse_b, &Device::Cpu).unwrap().to_dtype(acc).unwrap();
            // Query row 2 saw no key on either side: its o is 0 on both.
            let keep = Tensor::new(&[1f64, 1., 0., 1., 1., 1.], &Device::Cpu)
                .unwrap()
                .reshape((1, n, 1, 1))
                .unwrap()
                .to_dtype(out)
                .unwrap();
            let (o_a, o_b) = (o_a.broadcast_mul(&keep).unwrap(), o_b.broadcast_mul(&keep).unwrap());
            // o_b also as a non-contiguous view.
            let o_b_t = o_b.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap();
            assert!(!o_b_t.is_contiguous());

            let mut run = RunningAttention::new(&o_a, &lse_a).unwrap();
            run.merge(&o_b, &lse_b).unwrap();
            let (co, clse) = run.finish().unwrap();
            let (go, glse) = generic_merge(&o_a.to_dtype(acc).unwrap(), &lse_a, &o_b_t, &lse_b).unwrap();
            assert_eq!((go.dtype(), glse.dtype()), (acc, acc));
            let what = format!("merge acc {acc:?} out {out:?}");
            assert_close(&format!("{what} o"), &go.to_dtype(out).unwrap(), &co);
            assert_lse_close(&format!("{what} lse"), &glse, &clse);
            // Row 0 is b's, row 1 is a's, exactly; row 2 is o = 0 with lse = -inf.
            let row = |t: &Tensor, i: usize| t.narrow(1, i, 1).unwrap().to_dtype(DType::F64).unwrap();
            let same = |x: &Tensor, y: &Tensor| (x - y).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>();
            assert_eq!(same(&row(&go, 0), &row(&o_b, 0)).unwrap(), 0.0);
            assert_eq!(same(&row(&go, 1), &row(&o_a, 1)).unwrap(), 0.0);
            assert_eq!(row(&go, 2).abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap(), 0.0);
            let lse2 = glse.narrow(2, 2, 1).unwrap().to_dtype(DType::F64).unwrap().flatten_all().unwrap();
            assert!(lse2.to_vec1::<f64>().unwrap().iter().all(|&v| v == f64::NEG_INFINITY));
        }
    }
}

#[test]
fn ring_merge_generic_is_stable_far_apart_and_equal() {
    // lse pairs equal (weights 1/2 each), 40 apart (exp(-40) ~ 4e-18: below f32's epsilon, log1p's small
    // argument), and large (1e4: exp(lse) would overflow; the stable form never forms it).
    let pairs = [(0.5f64, 0.5f64), (3.0, -37.0), (-37.0, 3.0), (1e4, 1e4 - 1.0), (-1e4, -1e4 + 2.0)];
    let n = pairs.len();
    let lse_a = Tensor::new(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), &Device::Cpu).unwrap();
    let lse_b = Tensor::new(pairs.iter().map(|p| p.1).collect::<Vec<_>>(), &Device::Cpu).unwrap();
    for acc in [DType::F32, DType::F64] {
        let la = lse_a.reshape((1, 1, n)).unwrap().to_dtype(acc).unwrap();
        let lb = lse_b.reshape((1, 1, n)).unwrap().to_dtype(acc).unwrap();
        let o_a = rand(&[1, n, 1, 4], 50, acc);
        let o_b = rand(&[1, n, 1, 4], 51, acc);
        let mut run = RunningAttention::new(&o_a, &la).unwrap();
        run.merge(&o_b, &lb).unwrap();
        let (co, clse) = run.finish().unwrap();
        let (go, glse) = generic_merge(&o_a, &la, &o_b, &lb).unwrap();
        assert_close(&format!("stable merge o {acc:?}"), &go, &co);
        assert_close(&format!("stable merge lse {acc:?}"), &glse, &clse);
    }
}
