//! What the attention tests share: an attention shape and mask ([`Case`]), seeded random inputs for it
//! (q, k, v, and the gradients dO and dLSE), a tensor's values as f64, and the check of the CPU flash kernel
//! (through its poisoned entry points) against the naive reference.
#![allow(dead_code)]

use autosp_core::ops::attention::{naive_attention_backward, naive_attention_forward, AttentionSpec};
use autosp_kernels::attention::poisoned;
use candle_core::{DType, Device, Tensor};

/// One attention shape and mask.
#[derive(Clone, Debug)]
pub struct Case {
    pub b: usize,
    pub nq: usize,
    pub nk: usize,
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    pub spec: AttentionSpec,
}

pub fn spec(causal: bool, q_offset: usize, k_offset: usize) -> AttentionSpec {
    AttentionSpec { causal, scale: None, q_offset, k_offset, max_distance: None, documents: None }
}

/// Uniform numbers in [-2, 2) from a seeded splitmix64: every check gets its own fresh inputs.
pub fn random(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

pub struct Inputs {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub d_o: Tensor,
    pub d_lse: Tensor,
}

pub fn inputs(c: &Case, seed: u64, dtype: DType) -> Inputs {
    Inputs {
        q: random(&[c.b, c.nq, c.h, c.d], seed, dtype),
        k: random(&[c.b, c.nk, c.hkv, c.d], seed + 1, dtype),
        v: random(&[c.b, c.nk, c.hkv, c.d], seed + 2, dtype),
        d_o: random(&[c.b, c.nq, c.h, c.d], seed + 3, dtype),
        d_lse: random(&[c.b, c.h, c.nq], seed + 4, if dtype == DType::F64 { DType::F64 } else { DType::F32 }),
    }
}

pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Asserts `|got - want| <= tol · max(1, max |want|)` elementwise (equal infinities pass), and that `got`
/// holds no NaN.
pub fn assert_close(what: &str, c: &Case, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what} shape, {c:?}");
    let (g, w) = (values(got), values(want));
    let scale = w.iter().filter(|x| x.is_finite()).fold(1f64, |m, x| m.max(x.abs()));
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        assert!(!a.is_nan(), "{what}[{i}] is NaN (poison not overwritten?), {c:?}");
        if a == b {
            continue;
        }
        assert!((a - b).abs() <= tol * scale, "{what}[{i}]: got {a}, want {b} (tol {tol} x {scale}), {c:?}");
    }
}

/// Forward and backward (with and without d_lse) against the naive reference, through the poisoned entry
/// points, so a NaN in any output means an element was never written.
pub fn check_against_naive(cases: &[Case], dtype: DType, tol: f64, seed0: u64) {
    for (n, c) in cases.iter().enumerate() {
        let x = inputs(c, seed0 + 10 * n as u64, dtype);
        let (o, lse) = poisoned::cpu_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
        let (o_ref, lse_ref) = naive_attention_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
        assert_eq!(o.dtype(), dtype);
        assert_eq!(lse.dtype(), if dtype == DType::F64 { DType::F64 } else { DType::F32 });
        assert_close("o", c, &o, &o_ref, tol);
        assert_close("lse", c, &lse, &lse_ref, tol);
        for d_lse in [None, Some(&x.d_lse)] {
            let got = poisoned::cpu_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, d_lse, &c.spec).unwrap();
            let want =
                naive_attention_backward(&x.q, &x.k, &x.v, &o_ref, &lse_ref, Some(&x.d_o), d_lse, &c.spec).unwrap();
            assert_close("dq", c, &got.0, &want.0, tol);
            assert_close("dk", c, &got.1, &want.1, tol);
            assert_close("dv", c, &got.2, &want.2, tol);
        }
    }
}
