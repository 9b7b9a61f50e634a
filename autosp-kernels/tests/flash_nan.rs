//! A NaN in a query or key row reaches the attention output and LSE of exactly the rows that see it, on every
//! vector path this CPU runs (AVX-512, AVX2+FMA, NEON) and on the scalar one alike (the AVX-512 `exp2` used to
//! clamp NaN scores to -200, turning them into zero weights). This binary holds one test because it switches
//! the process-wide path (`autosp_kernels::simd::set_simd`).

use autosp_core::ops::attention::AttentionSpec;
use autosp_kernels::attention_forward;
use autosp_kernels::simd::{set_simd, supported_paths};
use candle_core::{Device, Tensor};

const N: usize = 100; // two query and key tiles of 64
const H: usize = 2;
const HKV: usize = 1; // both query heads read kv head 0
const D: usize = 32;

fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `(o: [N][H][D], lse: [H][N])` of causal attention with NaN at `q[row, head, 5]` or `k[key, 0, 3]`.
fn attend(q_nan: Option<(usize, usize)>, k_nan: Option<usize>) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>) {
    let mut q = values(1, N * H * D);
    let mut k = values(2, N * HKV * D);
    let v = values(3, N * HKV * D);
    if let Some((row, head)) = q_nan {
        q[(row * H + head) * D + 5] = f32::NAN;
    }
    if let Some(key) = k_nan {
        k[key * HKV * D + 3] = f32::NAN;
    }
    let t = |x: Vec<f32>, h: usize| Tensor::from_vec(x, (1, N, h, D), &Device::Cpu).unwrap();
    let (o, lse) = attention_forward(&t(q, H), &t(k, HKV), &t(v, HKV), &AttentionSpec::causal()).unwrap();
    (o.squeeze(0).unwrap().to_vec3().unwrap(), lse.squeeze(0).unwrap().to_vec2().unwrap())
}

/// Rows `(row, head)` where `nan(row, head)` must be NaN in every element of `o` and in `lse`, the others
/// finite.
fn check(path: &str, what: &str, out: &(Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>), nan: impl Fn(usize, usize) -> bool) {
    let (o, lse) = out;
    for row in 0..N {
        for head in 0..H {
            let want_nan = nan(row, head);
            let (o_row, l) = (&o[row][head], lse[head][row]);
            if want_nan {
                assert!(o_row.iter().all(|x| x.is_nan()), "{path}, {what}: o row {row} head {head} is {o_row:?}");
                assert!(l.is_nan(), "{path}, {what}: lse row {row} head {head} is {l}");
            } else {
                assert!(o_row.iter().all(|x| x.is_finite()), "{path}, {what}: o row {row} head {head} not finite");
                assert!(l.is_finite(), "{path}, {what}: lse row {row} head {head} is {l}");
            }
        }
    }
}

#[test]
fn nan_in_q_or_k_propagates_on_every_simd_path() {
    for p in supported_paths() {
        set_simd(Some(p)).unwrap();
        let path = p.name();
        // A NaN query element: that query row of that head alone.
        check(path, "NaN in q[70, head 1]", &attend(Some((70, 1)), None), |r, h| r == 70 && h == 1);
        check(path, "NaN in q[3, head 0]", &attend(Some((3, 0)), None), |r, h| r == 3 && h == 0);
        // A NaN key element: every row that sees key 30 under the causal mask (rows >= 30), in both heads of
        // its GQA group; earlier rows, whose scores for it are masked, stay finite.
        check(path, "NaN in k[30]", &attend(None, Some(30)), |r, _| r >= 30);
        check(path, "NaN in k[90]", &attend(None, Some(90)), |r, _| r >= 90);
    }
    set_simd(None).unwrap();
}
