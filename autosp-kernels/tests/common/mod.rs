//! What the attention tests share: an attention shape and mask ([`Case`]), seeded random inputs for it
//! (q, k, v, and the gradients dO and dLSE), and a tensor's values as f64.
#![allow(dead_code)]

use autosp_core::ops::attention::AttentionSpec;
use candle_core::{DType, Device, Tensor};

/// One attention shape and mask.
#[derive(Clone, Copy, Debug)]
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
    AttentionSpec { causal, scale: None, q_offset, k_offset, max_distance: None }
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
