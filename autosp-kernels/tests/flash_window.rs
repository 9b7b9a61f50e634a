//! The CPU flash attention with a sliding window (`AttentionSpec::max_distance`) against the naive reference
//! attention of autosp-core: output, LSE and dq/dk/dv in f64 and f32, causal and not, position offsets,
//! GQA/MQA, q_len != k_len, windows smaller than a tile, windows that hide whole tiles, a window of 0, and
//! rows whose window holds no key; the tiles the window hides are never computed (the kernels' own count of
//! tile products equals the count of tile pairs holding a visible (query, key) pair); a window that hides
//! nothing gives the unwindowed result bit for bit.

mod common;

use autosp_core::ops::attention::AttentionSpec;
use autosp_kernels::attention::{counted, poisoned};
use candle_core::DType;
use common::{check_against_naive, inputs, spec, values, Case};

fn windowed(causal: bool, q_offset: usize, k_offset: usize, w: usize) -> AttentionSpec {
    spec(causal, q_offset, k_offset).with_max_distance(w)
}

/// The windowed shapes (tiles are 64 × 64).
fn cases() -> Vec<Case> {
    let c = |b, nq, nk, h, hkv, d, spec| Case { b, nq, nk, h, hkv, d, spec };
    vec![
        c(1, 300, 300, 4, 2, 64, windowed(true, 0, 0, 10)), // GQA causal, window < a tile: hides whole tiles
        c(1, 200, 200, 2, 2, 64, windowed(false, 0, 0, 5)), // non-causal, both edges cut
        c(2, 150, 230, 4, 1, 32, windowed(true, 80, 0, 70)), // MQA, offsets, q_len != k_len
        c(1, 130, 90, 2, 2, 48, windowed(false, 0, 100, 40)), // rows 0..60 see no key
        c(1, 100, 300, 3, 3, 64, windowed(true, 250, 0, 0)), // window 0: itself only; rows 50.. see no key
        c(1, 70, 70, 2, 1, 16, windowed(false, 0, 0, 0)),   // non-causal window 0
        c(1, 256, 256, 2, 2, 64, windowed(true, 0, 0, 64)), // window = a tile
        c(1, 200, 140, 2, 1, 80, windowed(false, 30, 0, 100)), // wide non-causal window, offsets
        c(1, 1, 1, 1, 1, 16, windowed(true, 0, 0, 0)),      // one token
    ]
}

/// f64: the tolerance of `flash_attention.rs` (summation order and exp2 against exp: errors near 1e-13;
/// 1e-10 relative to the largest value still catches any wrong or missing term, ~1e-2 or more).
#[test]
fn f64_windows_match_naive() {
    check_against_naive(&cases(), DType::F64, 1e-10, 3000);
}

/// f32: the tolerance of `flash_attention.rs` (two f32 summation orders and a 1-ulp exp2, ~1e-6 relative;
/// 2e-5 relative to the largest value passes every time and still catches a wrong term).
#[test]
fn f32_windows_match_naive() {
    check_against_naive(&cases(), DType::F32, 2e-5, 4000);
}

/// Rows whose window holds no key get lse = -inf, o = 0 and zero dq; keys in no row's window get zero dk/dv.
#[test]
fn rows_whose_window_holds_no_key() {
    // Query positions 0..70 against keys at 100..170 with w = 40: rows 0..60 see nothing, keys 110.. none.
    let c = Case { b: 1, nq: 70, nk: 70, h: 2, hkv: 1, d: 32, spec: windowed(false, 0, 100, 40) };
    let x = inputs(&c, 17, DType::F64);
    let (o, lse) = poisoned::cpu_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
    let (lse_v, o_v) = (values(&lse), values(&o));
    let (dq, dk, dv) = poisoned::cpu_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, Some(&x.d_lse), &c.spec).unwrap();
    let (dq_v, dk_v, dv_v) = (values(&dq), values(&dk), values(&dv));
    let row = 2 * 32; // elements per query row (h · d); per key row h_kv · d = 32
    for hi in 0..2 {
        for i in 0..70 {
            let sees = i >= 60;
            let l = lse_v[hi * 70 + i];
            assert_eq!(l.is_finite(), sees, "head {hi} row {i}: lse {l}");
            let o_row = &o_v[i * row + hi * 32..][..32];
            let dq_row = &dq_v[i * row + hi * 32..][..32];
            if !sees {
                assert!(o_row.iter().chain(dq_row).all(|&v| v == 0.0), "row {i}");
            }
        }
    }
    for j in 0..70 {
        let seen = j < 10; // key position 100 + j is within 40 of query position 69 iff j <= 9
        let (dk_row, dv_row) = (&dk_v[j * 32..][..32], &dv_v[j * 32..][..32]);
        assert_eq!(dk_row.iter().chain(dv_row).any(|&v| v != 0.0), seen, "key {j}");
    }
}

/// The (query tile, key tile) pairs holding at least one visible (query, key) pair, times batch × heads: the
/// tile products a kernel that skips every hidden tile computes.
fn visible_tile_pairs(c: &Case) -> usize {
    let (br, bc) = counted::TILE;
    let mut n = 0;
    for qt in 0..c.nq.div_ceil(br) {
        for kt in 0..c.nk.div_ceil(bc) {
            let rows = qt * br..(qt * br + br).min(c.nq);
            if rows.into_iter().any(|i| (kt * bc..(kt * bc + bc).min(c.nk)).any(|j| c.spec.visible(i, j))) {
                n += 1;
            }
        }
    }
    n * c.b * c.h
}

/// The forward and the backward compute exactly the tile products that hold a visible pair: the window's
/// hidden tiles are skipped, not computed and masked. At N = 512 with w = 10 causal that is 8 + 7 = 15 of
/// the 36 tiles the causal mask alone leaves.
#[test]
fn hidden_tiles_are_never_computed() {
    let mut all = cases();
    let c = |nq, nk, spec| Case { b: 1, nq, nk, h: 2, hkv: 1, d: 16, spec };
    all.extend([
        c(512, 512, windowed(true, 0, 0, 10)),
        c(512, 512, spec(true, 0, 0)),
        c(512, 512, windowed(false, 0, 0, 70)),
        c(512, 512, spec(false, 0, 0)),
        c(100, 100, spec(true, 0, 120)), // no row sees a key: nothing computed
    ]);
    for c in &all {
        let x = inputs(c, 5, DType::F32);
        let (o, lse, fwd) = counted::cpu_forward(&x.q, &x.k, &x.v, &c.spec).unwrap();
        let (_, _, _, bwd) = counted::cpu_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, None, &c.spec).unwrap();
        let want = visible_tile_pairs(c);
        assert_eq!(fwd, want, "forward tile products, {c:?}");
        assert_eq!(bwd, want, "backward tile products, {c:?}");
    }
    let per_head = |c: Case| visible_tile_pairs(&c) / 2;
    assert_eq!(per_head(c(512, 512, windowed(true, 0, 0, 10))), 15);
    assert_eq!(per_head(c(512, 512, spec(true, 0, 0))), 36);
    assert_eq!(per_head(c(512, 512, windowed(false, 0, 0, 70))), 8 + 2 * 7 + 2 * 6);
    assert_eq!(per_head(c(100, 100, spec(true, 0, 120))), 0);
}

/// A window that hides nothing (at least the largest distance between a query and a key) runs the same tiles
/// with the same masks as no window: the same bits, forward and backward.
#[test]
fn a_window_that_hides_nothing_gives_the_same_bits() {
    for (causal, qo, ko) in [(true, 0, 0), (false, 0, 0), (true, 100, 0), (false, 0, 50)] {
        let c = Case { b: 1, nq: 150, nk: 200, h: 4, hkv: 2, d: 32, spec: spec(causal, qo, ko) };
        let x = inputs(&c, 23, DType::F32);
        let run = |s: &AttentionSpec| {
            let (o, lse) = poisoned::cpu_forward(&x.q, &x.k, &x.v, s).unwrap();
            let (dq, dk, dv) = poisoned::cpu_backward(&x.q, &x.k, &x.v, &o, &lse, &x.d_o, Some(&x.d_lse), s).unwrap();
            [o, lse, dq, dk, dv].map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        };
        let plain = run(&c.spec);
        for w in [250, 1000, usize::MAX] {
            let got = run(&c.spec.clone().with_max_distance(w));
            for (a, b) in plain.iter().zip(&got) {
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "w {w}, {c:?}");
            }
        }
    }
}
