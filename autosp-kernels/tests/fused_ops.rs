//! The fused RMSNorm, RoPE and SwiGLU against their unfused compositions from autosp-core (forward and every
//! gradient, f32 and f64), against finite differences in f64, on strided inputs, and on bad shapes.
//!
//! Tolerances: the fused kernels sum in a different order than candle's reductions (eight-lane partial sums,
//! block sums of the weight gradient), so f32 results agree to a few ulps of the largest element (RMSNorm
//! differs by 1.2e-7 of it; RoPE and SwiGLU compute the same expressions and agree exactly): we allow 1e-6.
//! In f64 the same reordering leaves ~1e-15; we allow 1e-12. Also: checkpoint policies replay the fused ops
//! bit for bit, and the weight gradients are the same bits whatever the thread count.

use autosp_core::gradcheck::{check_gradients, probe};
use autosp_core::ops::{self, rope::default_inv_freq};
use autosp_core::{CheckpointPolicy, Error, Result, Tape, Value};
use autosp_kernels::{rms_norm, rope, swiglu};
use candle_core::{DType, Device, Tensor};

const F32_TOL: f64 = 1e-6;
const F64_TOL: f64 = 1e-12;

fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

/// `max |a - b| / max(max |b|, 1e-30)`.
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
}

type Graph = dyn Fn(&Tape, &[Value]) -> Result<Value>;

/// The output of `f` and the gradients of inputs `wrt` under a fixed random output gradient.
fn output_and_grads(f: &Graph, inputs: &[Tensor], wrt: &[usize]) -> (Tensor, Vec<Tensor>) {
    let tape = Tape::new(CheckpointPolicy::None);
    let vals: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| if wrt.contains(&i) { tape.leaf(t.clone()) } else { tape.constant(t.clone()) })
        .collect();
    let y = f(&tape, &vals).unwrap();
    let seed = rand(y.dims(), 77, y.dtype());
    tape.backward_with_grad(&y, &seed, false).unwrap();
    let grads = wrt.iter().map(|&i| tape.grad(&vals[i]).unwrap().expect("a gradient")).collect();
    (y.tensor().clone(), grads)
}

/// Fused vs unfused: output and every gradient within `tol` (relative to the largest element).
fn assert_same(fused: &Graph, unfused: &Graph, inputs: &[Tensor], wrt: &[usize], tol: f64) {
    let (yf, gf) = output_and_grads(fused, inputs, wrt);
    let (yu, gu) = output_and_grads(unfused, inputs, wrt);
    let e = rel_diff(&yf, &yu);
    assert!(e <= tol, "output differs by {e} (tolerance {tol})");
    for (k, (a, b)) in gf.iter().zip(&gu).enumerate() {
        let e = rel_diff(a, b);
        assert!(e <= tol, "gradient of input {} differs by {e} (tolerance {tol})", wrt[k]);
    }
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::F64 {
        F64_TOL
    } else {
        F32_TOL
    }
}

const EPS: f64 = 1e-5;

fn rms_fused(t: &Tape, v: &[Value]) -> Result<Value> {
    rms_norm::rms_norm(t, &v[0], &v[1], EPS)
}
fn rms_unfused(t: &Tape, v: &[Value]) -> Result<Value> {
    ops::rms_norm(t, &v[0], &v[1], EPS)
}

#[test]
fn rms_norm_equals_core_f32_and_f64() {
    // 300 rows spread over several weight-gradient blocks; d = 37 exercises the 8-lane remainder.
    for dtype in [DType::F32, DType::F64] {
        let x = rand(&[3, 100, 37], 1, dtype);
        let w = (rand(&[37], 2, dtype) + 1.0).unwrap();
        assert_same(&rms_fused, &rms_unfused, &[x, w], &[0, 1], tol(dtype));
    }
}

#[test]
fn rms_norm_saved_recip_gives_the_same_backward() {
    let x = rand(&[64, 40], 3, DType::F32);
    let w = rand(&[40], 4, DType::F32);
    let g = rand(&[64, 40], 5, DType::F32);
    let r = rms_norm::rms_norm_recip(&x, EPS).unwrap();
    assert_eq!(r.dims(), &[64]);
    let (dx1, dw1) = rms_norm::rms_norm_backward(&x, &w, &g, EPS, None).unwrap();
    let (dx2, dw2) = rms_norm::rms_norm_backward(&x, &w, &g, EPS, Some(&r)).unwrap();
    assert_eq!(rel_diff(&dx1, &dx2), 0.0);
    assert_eq!(rel_diff(&dw1, &dw2), 0.0);
}

#[test]
fn rms_norm_passes_gradcheck() {
    let x = rand(&[5, 11], 6, DType::F64);
    let w = rand(&[11], 7, DType::F64);
    let r = check_gradients(|t, v| Ok(vec![rms_fused(t, v)?]), &[x, w], &[0, 1], 1e-6, 1e-7, 1e-6).unwrap();
    assert_eq!(r.checked, 55 + 11);
}

fn swiglu_fused(t: &Tape, v: &[Value]) -> Result<Value> {
    swiglu::swiglu(t, &v[0], &v[1])
}
fn swiglu_unfused(t: &Tape, v: &[Value]) -> Result<Value> {
    ops::mul(t, &ops::silu(t, &v[0])?, &v[1])
}

#[test]
fn swiglu_equals_core_f32_and_f64() {
    for dtype in [DType::F32, DType::F64] {
        // Values in [-4, 4) so both tails of the sigmoid are exercised; more elements than one rayon task.
        let gate = (rand(&[2, 130, 77], 8, dtype) * 4.0).unwrap();
        let up = rand(&[2, 130, 77], 9, dtype);
        assert_same(&swiglu_fused, &swiglu_unfused, &[gate, up], &[0, 1], tol(dtype));
    }
}

#[test]
fn swiglu_passes_gradcheck() {
    let gate = (rand(&[4, 9], 10, DType::F64) * 3.0).unwrap();
    let up = rand(&[4, 9], 11, DType::F64);
    check_gradients(|t, v| Ok(vec![swiglu_fused(t, v)?]), &[gate, up], &[0, 1], 1e-6, 1e-7, 1e-6).unwrap();
}

fn tables(n: usize, d: usize, offset: usize, dtype: DType) -> (Tensor, Tensor) {
    let pos: Vec<usize> = (offset..offset + n).collect();
    ops::rope_tables(&pos, &default_inv_freq(d, 10000.0), dtype, &Device::Cpu).unwrap()
}

fn rope_fused(t: &Tape, v: &[Value]) -> Result<Value> {
    rope::rope(t, &v[0], &v[1], &v[2])
}
fn rope_unfused(t: &Tape, v: &[Value]) -> Result<Value> {
    ops::rope(t, &v[0], &v[1], &v[2])
}

#[test]
fn rope_equals_core_f32_and_f64_with_2d_and_3d_tables() {
    for dtype in [DType::F32, DType::F64] {
        let (b, n, h, d) = (2, 19, 3, 16);
        let x = rand(&[b, n, h, d], 12, dtype);
        let (cos, sin) = tables(n, d, 5, dtype);
        assert_same(&rope_fused, &rope_unfused, &[x.clone(), cos.clone(), sin.clone()], &[0], tol(dtype));
        // Per-batch tables: batch 1 starts at another position.
        let (cos2, sin2) = tables(n, d, 100, dtype);
        let cos3 = Tensor::stack(&[cos, cos2], 0).unwrap();
        let sin3 = Tensor::stack(&[sin, sin2], 0).unwrap();
        assert_same(&rope_fused, &rope_unfused, &[x, cos3, sin3], &[0], tol(dtype));
    }
}

#[test]
fn rope_reads_strided_views_without_a_copy_and_matches_core() {
    let (b, n, h, kv, d) = (2, 13, 4, 2, 8);
    // A fused QKV projection [b, n, (h + 2 kv) d] split into heads; q is a narrow of it: not contiguous.
    let qkv = rand(&[b, n, (h + 2 * kv) * d], 13, DType::F32).reshape((b, n, h + 2 * kv, d)).unwrap();
    let q = qkv.narrow(2, 0, h).unwrap();
    let k = qkv.narrow(2, h, kv).unwrap();
    assert!(!q.is_contiguous() && !k.is_contiguous());
    // A [b, h, n, d] layout transposed to [b, n, h, d]: also a strided view with a dense last dim.
    let bhnd = rand(&[b, h, n, d], 14, DType::F32).transpose(1, 2).unwrap();
    assert!(!bhnd.is_contiguous());
    let (cos, sin) = tables(n, d, 0, DType::F32);
    for x in [q, k, bhnd] {
        let fused_y = rope::rope_forward(&x, &cos, &sin).unwrap();
        let tape = Tape::inference();
        let core_y = ops::rope(
            &tape,
            &Value::constant(x.contiguous().unwrap()),
            &Value::constant(cos.clone()),
            &Value::constant(sin.clone()),
        )
        .unwrap();
        assert!(rel_diff(&fused_y, core_y.tensor()) <= F32_TOL);
        assert!(fused_y.is_contiguous());
        // The gradient through the strided view reaches the whole QKV leaf.
    }
    let tape = Tape::new(CheckpointPolicy::None);
    let leaf = tape.leaf(qkv.contiguous().unwrap());
    let qv = ops::narrow(&tape, &leaf, 2, 0, h).unwrap();
    let y = rope::rope(&tape, &qv, &tape.constant(cos.clone()), &tape.constant(sin.clone())).unwrap();
    let seed = rand(y.dims(), 15, DType::F32);
    tape.backward_with_grad(&y, &seed, false).unwrap();
    let g = tape.grad(&leaf).unwrap().unwrap();
    let want = rope::rope_backward(&seed, &cos, &sin).unwrap();
    assert!(rel_diff(&g.narrow(2, 0, h).unwrap(), &want) <= F32_TOL);
    assert_eq!(g.narrow(2, h, 2 * kv).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
}

#[test]
fn rope_passes_gradcheck() {
    let x = rand(&[1, 3, 2, 4], 16, DType::F64);
    let (cos, sin) = tables(3, 4, 7, DType::F64);
    check_gradients(|t, v| Ok(vec![rope_fused(t, v)?]), &[x, cos, sin], &[0], 1e-6, 1e-7, 1e-6).unwrap();
}

#[test]
fn bf16_inputs_compute_in_f32() {
    // bf16 keeps 8 bits of mantissa: the fused result, rounded once to bf16, is within 2^-7 of the f32 one.
    let x = rand(&[16, 64], 17, DType::F32);
    let w = rand(&[64], 18, DType::F32);
    let y32 = rms_norm::rms_norm_forward(&x, &w, EPS).unwrap();
    let y16 =
        rms_norm::rms_norm_forward(&x.to_dtype(DType::BF16).unwrap(), &w.to_dtype(DType::BF16).unwrap(), EPS).unwrap();
    assert_eq!(y16.dtype(), DType::BF16);
    assert!(rel_diff(&y16, &y32) < 2f64.powi(-6));
    let s = swiglu::swiglu_forward(&x.to_dtype(DType::BF16).unwrap(), &x.to_dtype(DType::BF16).unwrap()).unwrap();
    assert!(rel_diff(&s, &swiglu::swiglu_forward(&x, &x).unwrap()) < 2f64.powi(-6));
}

#[test]
fn bf16_and_f16_inputs_compute_in_f32_and_round_once() {
    // The contract for narrow floats: widen the inputs to f32 once, compute in f32, round each result once.
    // So every output and gradient is exactly (bit for bit) the f32 kernel's on the widened inputs, rounded.
    let (cos32, sin32) = tables(5, 8, 3, DType::F32);
    for dtype in [DType::BF16, DType::F16] {
        let narrow = |shape: &[usize], seed| rand(shape, seed, dtype);
        let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let same = |what: &str, got: &Tensor, want32: &Tensor| {
            assert_eq!(got.dtype(), dtype, "{what}");
            let want = want32.to_dtype(dtype).unwrap();
            let eq = got.eq(&want).unwrap().to_dtype(DType::U32).unwrap().sum_all().unwrap();
            assert_eq!(eq.to_scalar::<u32>().unwrap() as usize, got.elem_count(), "{what} ({dtype:?})");
        };
        let (x, w, g) = (narrow(&[6, 24], 31), narrow(&[24], 32), narrow(&[6, 24], 33));
        same(
            "rms_norm",
            &rms_norm::rms_norm_forward(&x, &w, EPS).unwrap(),
            &rms_norm::rms_norm_forward(&wide(&x), &wide(&w), EPS).unwrap(),
        );
        let (dx, dw) = rms_norm::rms_norm_backward(&x, &w, &g, EPS, None).unwrap();
        let (dx32, dw32) = rms_norm::rms_norm_backward(&wide(&x), &wide(&w), &wide(&g), EPS, None).unwrap();
        same("rms_norm dx", &dx, &dx32);
        same("rms_norm dw", &dw, &dw32);
        let (a, u) = (narrow(&[6, 24], 34).affine(4.0, 0.0).unwrap(), narrow(&[6, 24], 35));
        same(
            "swiglu",
            &swiglu::swiglu_forward(&a, &u).unwrap(),
            &swiglu::swiglu_forward(&wide(&a), &wide(&u)).unwrap(),
        );
        let (da, du) = swiglu::swiglu_backward(&a, &u, &g).unwrap();
        let (da32, du32) = swiglu::swiglu_backward(&wide(&a), &wide(&u), &wide(&g)).unwrap();
        same("swiglu d_gate", &da, &da32);
        same("swiglu d_up", &du, &du32);
        let (q, cos, sin) = (narrow(&[2, 5, 3, 8], 36), cos32.to_dtype(dtype).unwrap(), sin32.to_dtype(dtype).unwrap());
        let (cw, sw) = (wide(&cos), wide(&sin));
        same("rope", &rope::rope_forward(&q, &cos, &sin).unwrap(), &rope::rope_forward(&wide(&q), &cw, &sw).unwrap());
        same(
            "rope backward",
            &rope::rope_backward(&q, &cos, &sin).unwrap(),
            &rope::rope_backward(&wide(&q), &cw, &sw).unwrap(),
        );
    }
}

fn shape_error<T: std::fmt::Debug>(r: Result<T>) -> String {
    match r {
        Err(e @ Error::ShapeMismatch(_)) => e.to_string(),
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
}

#[test]
fn bad_shapes_are_typed_errors_naming_the_shapes() {
    let x = rand(&[4, 6], 19, DType::F32);
    let msg = shape_error(rms_norm::rms_norm_forward(&x, &rand(&[5], 20, DType::F32), EPS));
    assert!(msg.contains("[4, 6]") && msg.contains("[5]"), "{msg}");

    let msg = shape_error(swiglu::swiglu_forward(&x, &rand(&[4, 7], 21, DType::F32)));
    assert!(msg.contains("[4, 6]") && msg.contains("[4, 7]"), "{msg}");

    let (cos, sin) = tables(5, 8, 0, DType::F32);
    let msg = shape_error(rope::rope_forward(&rand(&[1, 4, 2, 8], 22, DType::F32), &cos, &sin));
    assert!(msg.contains("[1, 4, 2, 8]") && msg.contains("[5, 4]"), "{msg}");
    let msg = shape_error(rope::rope_forward(&rand(&[4, 2, 8], 23, DType::F32), &cos, &sin));
    assert!(msg.contains("[4, 2, 8]"), "{msg}");

    let tape = Tape::new(CheckpointPolicy::None);
    let xv = tape.leaf(x);
    assert!(matches!(
        rms_norm::rms_norm(&tape, &xv, &tape.constant(rand(&[6], 24, DType::F32)), -1.0),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        rms_norm::rms_norm_forward(&rand(&[2, 2], 25, DType::U32), &rand(&[2], 26, DType::U32), EPS),
        Err(Error::UnsupportedDType { op: "rms_norm", dtype: DType::U32 })
    ));
}

/// A toy block of fused ops (norm, projection, rope on a narrow of a fused QKV, SwiGLU), its loss from the
/// chunked cross-entropy, and the gradients of every parameter, under `policy`.
fn toy_block_grads(policy: CheckpointPolicy) -> Vec<Vec<f32>> {
    use autosp_core::Param;
    let (n, dm, h, hd, vocab) = (12, 16, 2, 8, 11);
    let p = |name: &str, shape: &[usize], seed: u64| Param::new(name, (rand(shape, seed, DType::F32) * 0.3).unwrap());
    let (nw, qkv, gate, up, head) = (
        p("norm", &[dm], 30),
        p("qkv", &[3 * h * hd, dm], 31),
        p("gate", &[24, dm], 32),
        p("up", &[24, dm], 33),
        p("head", &[vocab, 24], 34),
    );
    let tape = Tape::new(policy);
    let x = tape.constant(rand(&[n, dm], 35, DType::F32));
    let (cos, sin) = tables(n, hd, 0, DType::F32);
    let (cos, sin) = (tape.constant(cos), tape.constant(sin));
    let out = tape
        .checkpoint("block", |t| {
            let xn = rms_norm::rms_norm(t, &x, &t.param(&nw)?, EPS)?;
            let proj = ops::reshape(t, &ops::linear(t, &xn, &t.param(&qkv)?, None)?, (1, n, 3 * h, hd))?;
            let q = rope::rope(t, &ops::narrow(t, &proj, 2, 0, h)?, &cos, &sin)?;
            let q = ops::reshape(t, &q, (n, h * hd))?;
            let g = ops::add(
                t,
                &ops::linear(t, &xn, &t.param(&gate)?, None)?,
                &ops::linear(t, &q, &t.param(&gate)?, None)?,
            )?;
            swiglu::swiglu(t, &g, &ops::linear(t, &xn, &t.param(&up)?, None)?)
        })
        .unwrap();
    let targets = Tensor::new(
        (0..n as i64).map(|i| if i == 4 { -100 } else { i % vocab as i64 }).collect::<Vec<_>>(),
        &Device::Cpu,
    )
    .unwrap();
    let (loss, _) =
        autosp_kernels::chunked_cross_entropy(&tape, &out, &tape.param(&head).unwrap(), &tape.constant(targets), 5)
            .unwrap();
    tape.backward(&loss).unwrap();
    let grads = tape.param_grads();
    [&nw, &qkv, &gate, &up, &head]
        .iter()
        .map(|p| grads.get(p).expect("a gradient").flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

#[test]
fn checkpoint_policies_replay_the_fused_ops_bit_for_bit() {
    // The fused forwards are deterministic, so replaying them under Full or SequenceAware gives the same bits.
    let none = toy_block_grads(CheckpointPolicy::None);
    assert!(none.iter().all(|g| g.iter().any(|v| *v != 0.0)));
    assert_eq!(toy_block_grads(CheckpointPolicy::SequenceAware), none);
    assert_eq!(toy_block_grads(CheckpointPolicy::Full), none);
}

#[test]
fn weight_and_lm_head_gradients_do_not_depend_on_the_thread_count() {
    let x = rand(&[1000, 24], 40, DType::F32);
    let w = rand(&[24], 41, DType::F32);
    let g = rand(&[1000, 24], 42, DType::F32);
    let lm = rand(&[30, 24], 43, DType::F32);
    let tg = Tensor::new((0..1000i64).map(|i| i % 30).collect::<Vec<_>>(), &Device::Cpu).unwrap();
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let (dx, dw) = rms_norm::rms_norm_backward(&x, &w, &g, EPS, None).unwrap();
            let (dh, dl) = autosp_kernels::chunked_cross_entropy_backward(&x, &lm, &tg, 128, 1.0).unwrap();
            [dx, dw, dh, dl].map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
    };
    let one = run(1);
    assert_eq!(run(3), one);
    assert_eq!(run(2), one);
}
