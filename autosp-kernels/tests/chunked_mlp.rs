//! The chunked SwiGLU MLP against its unfused composition (`linear`, fused `swiglu`, `linear`): output and the
//! gradients of x and the three weights, m not a multiple of the chunk; finite differences in f64;
//! determinism; the bytes the tape holds inside a recomputing region; bad shapes.
//!
//! Tolerances: f32 1e-6 of the largest element (the chunked backward sums the weight gradients chunk by chunk
//! where the composition makes one matmul over all rows: the same terms in another order); f64 1e-12; bf16
//! and f16 (GEMMs in the storage dtype) against f32, 4 units of their last place (the test says why).

use autosp_core::gradcheck::{check_gradients, probe};
use autosp_core::ops;
use autosp_core::{CheckpointPolicy, Error, MemoryStats, Param, Tape};
use autosp_kernels::mlp::{chunked_mlp, chunked_mlp_backward, chunked_mlp_forward};
use autosp_kernels::swiglu::swiglu;
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

/// The output, the four gradients and the tape's memory after forward, for `loss = sum(y * probe)`.
struct Run {
    y: Tensor,
    grads: Vec<Tensor>,
    after_forward: MemoryStats,
}

/// `x: [b, n, d]`, weights `[f, d], [f, d], [d, f]`; `chunk: None` runs the unfused composition.
fn run(x: &Tensor, w: &[Tensor; 3], chunk: Option<usize>, policy: CheckpointPolicy) -> Run {
    let tape = Tape::new(policy);
    let params: Vec<Param> = w.iter().enumerate().map(|(i, t)| Param::new(format!("w{i}"), t.clone())).collect();
    let xv = tape.leaf(x.clone());
    let y = tape
        .checkpoint("mlp", |t| {
            let x2 = ops::affine(t, &xv, 2.0, 0.0)?;
            let (wg, wu, wd) = (t.param(&params[0])?, t.param(&params[1])?, t.param(&params[2])?);
            match chunk {
                Some(c) => chunked_mlp(t, &x2, &wg, &wu, &wd, c),
                None => {
                    let g = ops::linear(t, &x2, &wg, None)?;
                    let u = ops::linear(t, &x2, &wu, None)?;
                    ops::linear(t, &swiglu(t, &g, &u)?, &wd, None)
                }
            }
        })
        .unwrap();
    let after_forward = tape.memory();
    let probe = rand(y.dims(), 99, y.dtype());
    let loss = ops::sum_all(&tape, &ops::mul(&tape, &y, &tape.constant(probe)).unwrap()).unwrap();
    tape.backward(&loss).unwrap();
    let pg = tape.param_grads();
    let mut grads = vec![tape.grad(&xv).unwrap().unwrap()];
    grads.extend(params.iter().map(|p| pg.get(p).unwrap().clone()));
    Run { y: y.tensor().clone(), grads, after_forward }
}

fn weights(d: usize, f: usize, seed: u64, dtype: DType) -> [Tensor; 3] {
    [rand(&[f, d], seed, dtype), rand(&[f, d], seed + 1, dtype), rand(&[d, f], seed + 2, dtype)]
}

#[test]
fn chunked_equals_the_unfused_composition_f32_and_f64() {
    // m = 2 x 19 = 38 rows, not a multiple of the chunk (8).
    for (dtype, tol) in [(DType::F32, 1e-6), (DType::F64, 1e-12)] {
        let (d, f) = (16, 44);
        let x = (rand(&[2, 19, d], 1, dtype) * 2.0).unwrap();
        let w = weights(d, f, 2, dtype);
        for policy in [CheckpointPolicy::None, CheckpointPolicy::SequenceAware] {
            let c = run(&x, &w, Some(8), policy);
            let u = run(&x, &w, None, policy);
            assert_eq!(c.y.dims(), x.dims());
            let e = rel_diff(&c.y, &u.y);
            assert!(e <= tol, "{dtype:?} {policy:?} y differs by {e} (tolerance {tol})");
            for (name, a, b) in
                ["dx", "d_gate", "d_up", "d_down"].iter().zip(&c.grads).zip(&u.grads).map(|((n, a), b)| (n, a, b))
            {
                let e = rel_diff(a, b);
                assert!(e <= tol, "{dtype:?} {policy:?} {name} differs by {e} (tolerance {tol})");
            }
        }
    }
}

#[test]
fn chunk_size_does_not_change_the_result_and_runs_repeat_bit_for_bit() {
    let (d, f) = (8, 20);
    let x = rand(&[1, 29, d], 3, DType::F32);
    let w = weights(d, f, 4, DType::F32);
    let a = run(&x, &w, Some(1), CheckpointPolicy::Full);
    let b = run(&x, &w, Some(64), CheckpointPolicy::Full);
    assert!(rel_diff(&a.y, &b.y) <= 1e-6);
    for (ga, gb) in a.grads.iter().zip(&b.grads) {
        assert!(rel_diff(ga, gb) <= 1e-6);
    }
    let c = run(&x, &w, Some(1), CheckpointPolicy::Full);
    assert_eq!(rel_diff(&a.y, &c.y), 0.0);
    for (ga, gc) in a.grads.iter().zip(&c.grads) {
        assert_eq!(rel_diff(ga, gc), 0.0);
    }
}

#[test]
fn chunked_mlp_passes_gradcheck() {
    let (m, d, f) = (7, 4, 6);
    let x = rand(&[m, d], 5, DType::F64);
    let [wg, wu, wd] = weights(d, f, 6, DType::F64);
    let r = check_gradients(
        |t, v| Ok(vec![chunked_mlp(t, &v[0], &v[1], &v[2], &v[3], 3)?]),
        &[x, wg, wu, wd],
        &[0, 1, 2, 3],
        1e-6,
        1e-7,
        1e-6,
    )
    .unwrap();
    assert_eq!(r.checked, m * d + 3 * d * f);
}

#[test]
fn tape_holds_only_the_input_and_no_intermediate() {
    // Under None the unfused composition holds gate, up and swiglu ([m, f] each) plus x; the chunked op
    // holds x only (and the weights, which are parameters), so it holds under (d + 0) / (d + 3 f) of the bytes.
    let (d, f) = (32, 96);
    let x = rand(&[1, 256, d], 7, DType::F32);
    let w = weights(d, f, 8, DType::F32);
    let c = run(&x, &w, Some(32), CheckpointPolicy::None);
    let u = run(&x, &w, None, CheckpointPolicy::None);
    let m = 256;
    assert!(u.after_forward.held_bytes >= 3 * m * f * 4, "{:?}", u.after_forward);
    assert!(c.after_forward.held_bytes < 2 * m * d * 4 + 1024, "{:?}", c.after_forward);
}

#[test]
fn matches_direct_calls_and_zero_rows() {
    let (d, f) = (8, 12);
    let x = rand(&[3, 5, d], 9, DType::F32);
    let [wg, wu, wd] = weights(d, f, 10, DType::F32);
    // `run` feeds the op 2x (an affine inside the region).
    let y = chunked_mlp_forward(&(&x * 2.0).unwrap(), &wg, &wu, &wd, 4).unwrap();
    let r = run(&x, &[wg.clone(), wu.clone(), wd.clone()], Some(4), CheckpointPolicy::None);
    assert_eq!(rel_diff(&y, &r.y), 0.0);
    let empty = Tensor::zeros((1, 0, d), DType::F32, &Device::Cpu).unwrap();
    let y0 = chunked_mlp_forward(&empty, &wg, &wu, &wd, 4).unwrap();
    assert_eq!(y0.dims(), &[1, 0, d]);
    let (dx, dwg, dwu, dwd) = chunked_mlp_backward(&empty, &wg, &wu, &wd, &empty, 4).unwrap();
    assert_eq!(dx.dims(), &[1, 0, d]);
    for g in [dwg, dwu, dwd] {
        assert_eq!(g.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
}

#[test]
fn bad_input_is_a_typed_error_naming_the_shapes() {
    let x = rand(&[6, 4], 11, DType::F32);
    let [wg, wu, wd] = weights(4, 10, 12, DType::F32);
    let msg = match chunked_mlp_forward(&x, &rand(&[10, 5], 13, DType::F32), &wu, &wd, 2) {
        Err(e @ Error::ShapeMismatch(_)) => e.to_string(),
        other => panic!("expected a shape mismatch, got {other:?}"),
    };
    assert!(msg.contains("[6, 4]") && msg.contains("[10, 5]"), "{msg}");
    let msg = match chunked_mlp_forward(&x, &wg, &wu, &rand(&[10, 4], 14, DType::F32), 2) {
        Err(e @ Error::ShapeMismatch(_)) => e.to_string(),
        other => panic!("expected a shape mismatch, got {other:?}"),
    };
    assert!(msg.contains("[10, 4]") && msg.contains("[4, 10]"), "{msg}");
    assert!(matches!(chunked_mlp_forward(&x, &wg, &wu, &wd, 0), Err(Error::InvalidArgument { .. })));
    let x64 = x.to_dtype(DType::F64).unwrap();
    assert!(matches!(chunked_mlp_forward(&x64, &wg, &wu, &wd, 2), Err(Error::InvalidArgument { .. })));
}

#[test]
fn bf16_and_f16_gemms_match_f32_within_their_rounding() {
    // The GEMMs run in the storage dtype (f32 accumulation inside candle's GEMM), each product rounded once
    // to it; the weight gradients sum their chunks in f32. Against the f32 run on the same (widened) inputs the
    // error is a few roundings of the largest element: bf16 keeps 8 significant bits (unit roundoff 2^-9,
    // about 2e-3), f16 11 (2^-12, about 2.4e-4). A result passes through at most four roundings in a row
    // (gate/up, SwiGLU, the product, the sum of dx's halves), each relative to its own magnitude, which can
    // exceed the output's largest element: the tolerance is 4 units of the last place at the largest element,
    // 4 x 2^-8 = 1.6e-2 for bf16 and 4 x 2^-11 = 2e-3 for f16 (measured: at most 7.5e-3 and 7.9e-4, d_down).
    // m = 2 x 13 rows in chunks of 4 (seven chunks summed, the last short).
    let (d, f) = (48, 80);
    for (dtype, tol) in [(DType::BF16, 4.0 / 256.0), (DType::F16, 4.0 / 2048.0)] {
        let (x, dy) = (rand(&[2, 13, d], 21, dtype), rand(&[2, 13, d], 22, dtype));
        let w = weights(d, f, 23, dtype);
        let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let close = |what: &str, got: &Tensor, want32: &Tensor| {
            assert_eq!(got.dtype(), dtype, "{what}");
            let err = rel_diff(got, want32);
            assert!(err < tol, "{dtype:?} {what}: {err:.3e} >= {tol:.1e}");
        };
        let y = chunked_mlp_forward(&x, &w[0], &w[1], &w[2], 4).unwrap();
        close("y", &y, &chunked_mlp_forward(&wide(&x), &wide(&w[0]), &wide(&w[1]), &wide(&w[2]), 4).unwrap());
        let got = chunked_mlp_backward(&x, &w[0], &w[1], &w[2], &dy, 4).unwrap();
        let want = chunked_mlp_backward(&wide(&x), &wide(&w[0]), &wide(&w[1]), &wide(&w[2]), &wide(&dy), 4).unwrap();
        close("dx", &got.0, &want.0);
        close("d_gate", &got.1, &want.1);
        close("d_up", &got.2, &want.2);
        close("d_down", &got.3, &want.3);
        // One chunk and seven give the same within the same bound (the chunk sums are f32).
        let one = chunked_mlp_backward(&x, &w[0], &w[1], &w[2], &dy, 64).unwrap();
        close("d_gate, one chunk", &one.1, &want.1);
    }
}
