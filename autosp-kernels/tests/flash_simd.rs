//! The f32 flash kernel on every vector path this CPU runs (AVX-512, AVX2+FMA, NEON) against the scalar path,
//! the reference: output, LSE and dq/dk/dv, causal and not, GQA, offsets with rows that see no key, head_dims
//! that are and are not a multiple of the vector width, through the poisoned entry points (so every element
//! is written). This binary holds one test because it switches the process-wide path
//! (`autosp_kernels::simd::set_simd`); the micro-kernels themselves are compared per call in
//! `src/vector/mod.rs`.

mod common;

use autosp_core::ops::attention::AttentionSpec;
use autosp_kernels::attention::poisoned;
use autosp_kernels::simd::{set_simd, supported_paths, SimdPath};
use candle_core::{DType, Tensor};
use common::{inputs, spec, values, Case};

/// `(o, lse, [dq, dk, dv] without d_lse, [dq, dk, dv] with d_lse)` on the path in force.
fn run(c: &Case, seed: u64) -> Vec<Tensor> {
    let x = inputs(c, seed, DType::F32);
    let (o, lse) = poisoned::cpu_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
    let mut out = vec![o.clone(), lse.clone()];
    for d_lse in [None, Some(&x.d_lse)] {
        let (dq, dk, dv) = poisoned::cpu_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, d_lse, &c.spec).unwrap();
        out.extend([dq, dk, dv]);
    }
    out
}

/// f32 against f32 on the same inputs: the paths differ in FMA rounding and in the order the lanes of a row
/// sum are added, and the vector exp2 is within ~1 ulp; the tolerance is the one f32 flash has against the
/// naive reference today (`tests/flash_attention.rs`, 2e-5 relative to the largest value), which still
/// catches any wrong term (~1e-2).
const TOL: f64 = 2e-5;

#[test]
fn every_simd_path_matches_the_scalar_path() {
    let c = |b, nq, nk, h, hkv, d, spec| Case { b, nq, nk, h, hkv, d, spec };
    let cases = [
        c(1, 150, 150, 4, 4, 64, spec(true, 0, 0)),  // MHA causal, head_dim 64
        c(2, 70, 130, 4, 2, 80, spec(false, 0, 0)),  // GQA, full, head_dim 80
        c(1, 100, 90, 2, 2, 64, spec(true, 40, 60)), // offsets: query rows 0..20 see no key
        c(2, 33, 47, 6, 2, 36, spec(false, 0, 0)),   // head_dim not a multiple of 8
        c(1, 131, 131, 2, 1, 128, spec(true, 0, 0)), // MQA causal, head_dim 128
        c(1, 64, 128, 2, 2, 64, AttentionSpec { scale: Some(0.3), ..spec(true, 64, 0) }),
        // 10 tiles: forward tasks of several query tiles, backward tasks of several key groups.
        c(2, 600, 600, 4, 4, 64, spec(true, 0, 0)),
    ];
    let names = ["o", "lse", "dq", "dk", "dv", "dq (d_lse)", "dk (d_lse)", "dv (d_lse)"];
    set_simd(Some(SimdPath::Scalar)).unwrap();
    let want: Vec<Vec<Tensor>> = cases.iter().enumerate().map(|(i, c)| run(c, 100 + 10 * i as u64)).collect();
    let paths: Vec<SimdPath> = supported_paths().into_iter().filter(|&p| p != SimdPath::Scalar).collect();
    for &p in &paths {
        set_simd(Some(p)).unwrap();
        for (i, c) in cases.iter().enumerate() {
            let got = run(c, 100 + 10 * i as u64);
            for ((name, g), w) in names.iter().zip(&got).zip(&want[i]) {
                let (g, w) = (values(g), values(w));
                // max relative error = max_i |g_i - w_i| / max_i |w_i| over finite entries; -inf LSEs equal.
                let scale = w.iter().filter(|x| x.is_finite()).fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
                let mut err = 0f64;
                for (&a, &b) in g.iter().zip(&w) {
                    assert!(!a.is_nan(), "{p}: {name} has NaN, {c:?}");
                    if a != b {
                        err = err.max((a - b).abs() / scale);
                    }
                }
                assert!(err <= TOL, "{p}: {name} max relative error {err:e} > {TOL:e}, {c:?}");
            }
        }
    }
    set_simd(None).unwrap();
    eprintln!("vector paths checked against scalar: {paths:?}");
}
