//! Flash attention forward on host slices: one task per (batch, head, group of up to [`query_tiles_per_task`] query
//! tiles), each owning its output rows and LSE entries; each query tile meets its key tiles in order with the online
//! softmax of ALGORITHMS.md, in the log2 domain (`2^(s·log2(e)·QKᵀ - m)`), so one FMA per score feeds the exponential;
//! a key tile is run against every query tile of the group that sees it before the next.

use rayon::prelude::*;

use super::buffer::LineBuf;
use super::prefetch::prefetch_rows;
use super::tiles::{pack_rows, Geometry, SharedOut, BC, BR, KT_LD};
use crate::vector::Real;

/// Forward pass. `q: [b, nq, h, d]`, `k, v: [b, nk, hkv, d]` (contiguous slices); writes every element of
/// `o: [b, nq, h, d]` and `lse: [b, h, nq]` (natural log; -inf and o = 0 for a row that sees no key).
/// Returns the number of (query tile, key tile) score products computed, summed over batch and heads: only
/// the key tiles a query tile sees (causal cut, sliding window) are visited.
pub(crate) fn forward<T: Real>(g: &Geometry, q: &[T], k: &[T], v: &[T], o: &mut [T], lse: &mut [T]) -> usize {
    let kt_len = g.k_tiles() * g.d * KT_LD;
    // Kᵀ in tiles and V in packed rows, once per kv head; the query heads of a GQA group share them.
    let ld = g.row_ld();
    let v_len = g.nk * ld;
    let mut kt = LineBuf::new(g.b * g.hkv * kt_len, T::ZERO);
    let mut vp = LineBuf::new(g.b * g.hkv * v_len, T::ZERO);
    if kt_len > 0 {
        kt.par_chunks_mut(kt_len).zip(vp.par_chunks_mut(v_len)).enumerate().for_each(|(idx, (kd, vd))| {
            let (bi, kh) = (idx / g.hkv, idx % g.hkv);
            g.pack_transposed(k, bi, kh, kd);
            pack_rows(v, g.k_base(bi, kh), g.k_rs, g.d, ld, vd);
        });
    }
    let nqt = g.q_tiles();
    // Up to `query_tiles_per_task` tiles per task, fewer when that would leave under 4 tasks per thread
    // (small inputs or few heads).
    let per_task =
        (g.b * g.h * nqt / (4 * rayon::current_num_threads()).max(1)).clamp(1, query_tiles_per_task::<T>(g.d));
    let groups = nqt.div_ceil(per_task);
    let o_out = SharedOut(o.as_mut_ptr());
    let lse_out = SharedOut(lse.as_mut_ptr());
    // The last query tiles see the most keys under a causal mask: hand their groups out first.
    (0..g.b * g.h * groups)
        .into_par_iter()
        .map(|idx| {
            let grp = groups - 1 - idx % groups;
            let bh = idx / groups;
            let (bi, hi) = (bh / g.h, bh % g.h);
            let kh = hi / g.group;
            let kt_head = &kt[(bi * g.hkv + kh) * kt_len..][..kt_len];
            let v_head = &vp[(bi * g.hkv + kh) * v_len..][..v_len];
            let tiles = grp * per_task..((grp + 1) * per_task).min(nqt);
            // SAFETY: task (bi, hi, grp) alone writes the rows of its query tiles of head hi of batch bi in o
            // and lse.
            unsafe { query_group(g, q, kt_head, v_head, bi, hi, tiles, &o_out, &lse_out) }
        })
        .sum()
}

/// Bytes of query-tile state (packed query rows and accumulators) a forward task keeps at most: 4 tiles at
/// d = 128 f32 (68 KiB each: 272 KiB), 8 at d = 64 (36 KiB each: 288 KiB). The task runs each key tile
/// against all of its query tiles that see it before it moves on, so a key tile (Kᵀ and V, 80 KiB at
/// d = 128) comes from L3 (or memory, when other processes share the L3) once per group rather than once per
/// query tile; the budget keeps the group's state and a key tile in a 512 KiB L2 (Zen 2/3; 1 MiB and more on
/// Zen 4/5 and recent Intel parts). Eight tiles at d = 64 ran the forward 2-3% faster than four on the AVX2
/// stand-in (docs/BENCHMARKS.md); eight at d = 128 (544 KiB) would not fit a Zen 2/3 L2. Each query tile
/// still meets its key tiles in order, so the bits do not depend on the grouping.
const QUERY_GROUP_BYTES: usize = 320 << 10;

/// Query tiles per forward task at most for head dim `d` in `T` (1 to 8; see [`QUERY_GROUP_BYTES`]; fewer
/// for small inputs, see [`forward`]).
fn query_tiles_per_task<T>(d: usize) -> usize {
    let per_tile = BR * (d + super::tiles::PAD + d) * std::mem::size_of::<T>();
    (QUERY_GROUP_BYTES / per_tile.max(1)).clamp(1, 8)
}

/// The online-softmax state of one query tile: its rows packed (`[rows, row_ld]`), the running max `m` and
/// sum `l` per row (log2 domain) and the unnormalised output `acc: [rows, d]`.
struct QueryTile<T> {
    i0: usize,
    rows: usize,
    keys: std::ops::Range<usize>,
    qc: LineBuf<T>,
    m: [T; BR],
    l: [T; BR],
    acc: LineBuf<T>,
}

/// Attention of the query tiles `tiles` of head `hi` against every key tile they see; `kt` is the packed Kᵀ
/// and `v` the packed `[nk, row_ld]` values of its kv head. Returns the number of (query tile, key tile)
/// products computed.
///
/// # Safety
/// No other task writes the rows of these tiles in `o` and `lse`.
#[allow(clippy::too_many_arguments)]
unsafe fn query_group<T: Real>(
    g: &Geometry,
    q: &[T],
    kt: &[T],
    v: &[T],
    bi: usize,
    hi: usize,
    tiles: std::ops::Range<usize>,
    o_out: &SharedOut<T>,
    lse_out: &SharedOut<T>,
) -> usize {
    let (d, ld) = (g.d, g.row_ld());
    // Each tile's query rows packed: read in place, their `heads · d` stride maps a 64-row tile onto 8 of the
    // 64 L1 sets (with 8 ways: 64 lines for its 256 at d = 64), so every column panel of `S = Q Kᵀ` refetched
    // them from L2. Measured on Zen 3 (AVX2, 64 × 64 × 64): 56 → 78 GFLOP/s for that product. The set mapping
    // is that of any 32 KiB or 48 KiB 8/12-way L1 (Zen 2-5, Intel since Skylake).
    let mut group: Vec<QueryTile<T>> = tiles
        .map(|qt| {
            let i0 = qt * BR;
            let rows = (g.nq - i0).min(BR);
            let mut qc = LineBuf::new(rows * ld, T::ZERO);
            pack_rows(q, g.q_base(bi, hi) + i0 * g.q_rs, g.q_rs, d, ld, &mut qc);
            let keys = g.key_tiles_seen(i0, rows);
            QueryTile {
                i0,
                rows,
                keys,
                qc,
                m: [T::NEG_INF; BR],
                l: [T::ZERO; BR],
                acc: LineBuf::new(rows * d, T::ZERO),
            }
        })
        .collect();
    let first = group.iter().map(|t| t.keys.start).min().unwrap_or(0);
    let end = group.iter().map(|t| t.keys.end).max().unwrap_or(0);
    let c = T::from_f64(g.scale * std::f64::consts::LOG2_E);
    let mut s = LineBuf::new(BR * BC, T::ZERO);
    let mut computed = 0;
    for t in first..end {
        let j0 = t * BC;
        let cols = (g.nk - j0).min(BC);
        let seen = group.iter().filter(|qt| qt.keys.contains(&t)).count();
        for (qi, qt) in group.iter_mut().filter(|qt| qt.keys.contains(&t)).enumerate() {
            computed += 1;
            if t + 1 < end {
                // The next key tile's Kᵀ and V (80 KiB at d = 128 f32, from L3 or memory), in shares over this
                // tile's products, so they are in L2 when it starts (as the backward's query rows).
                let next = (t + 1) * BC;
                prefetch_rows(kt.as_ptr().wrapping_add((t + 1) * d * KT_LD), d, BC, KT_LD, qi, seen);
                prefetch_rows(v.as_ptr().wrapping_add(next * ld), (g.nk - next).min(BC), d, ld, qi, seen);
            }
            let (i0, rows) = (qt.i0, qt.rows);
            let s = &mut s[..rows * BC];
            let kp = kt.as_ptr().add(t * d * KT_LD);
            T::gemm(g.path, false, rows, BC, d, qt.qc.as_ptr(), ld, 1, kp, KT_LD, s.as_mut_ptr(), BC);
            if g.tile_needs_mask(i0, rows, j0) {
                g.mask_tile(s, rows, i0, j0);
            }
            T::online_softmax(g.path, s, BC, c, &mut qt.m[..rows], &mut qt.l[..rows], &mut qt.acc, d);
            let vp = v.as_ptr().add(j0 * ld);
            T::gemm(g.path, true, rows, d, cols, s.as_ptr(), BC, 1, vp, ld, qt.acc.as_mut_ptr(), d);
        }
    }

    let ln2 = T::from_f64(std::f64::consts::LN_2);
    for qt in &group {
        let lse_row = lse_out.slice((bi * g.h + hi) * g.nq + qt.i0, qt.rows);
        for (r, lse) in lse_row.iter_mut().enumerate() {
            let out = o_out.slice(g.q_base(bi, hi) + (qt.i0 + r) * g.q_rs, d);
            if qt.l[r] == T::ZERO {
                out.fill(T::ZERO);
                *lse = T::NEG_INF;
            } else {
                let inv = T::from_f64(1.0) / qt.l[r];
                for (o, &a) in out.iter_mut().zip(&qt.acc[r * d..(r + 1) * d]) {
                    *o = a * inv;
                }
                *lse = (qt.m[r] + qt.l[r].log2()) * ln2;
            }
        }
    }
    computed
}
