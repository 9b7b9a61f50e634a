//! Flash attention backward on host slices, FlashAttention-2 style from the saved output and LSE, and
//! deterministic: one task per (batch, kv head, chunk of key tiles) owns the dK/dV rows of its key tiles
//! (summing its GQA group's query heads in order) and a packed dQ partial per query head of its group. The
//! chunks run in waves sized to the thread count, and after each wave its partials are added to dQ in chunk
//! order, so the partials take a wave's worth of dQs, not one per chunk. No float is ever added from two
//! threads and every sum runs in chunk order, so the bits depend neither on the scheduling nor on the thread
//! count.

use rayon::prelude::*;

use super::buffer::LineBuf;
use super::prefetch::prefetch_rows;
use super::tiles::{pack_rows, Geometry, SharedOut, BC, BR, KT_LD};
use crate::vector::Real;

/// Tasks to aim for when batch × kv heads is small: the key tiles of a kv head are dealt round-robin to
/// `ceil(TARGET_TASKS / (batch · kv_heads))` chunks (a function of the shapes only, never of the thread
/// count), which also balances the causal work (early key tiles are seen by more queries).
const TARGET_TASKS: usize = 8;

/// The slices the backward pass reads: `q, do, o: [b, nq, h, d]`, `k, v: [b, nk, hkv, d]`, `lse: [b, h, nq]`
/// (natural log), `d_lse: [b, h, nq]` when the LSE has an incoming gradient.
pub(crate) struct BackwardInputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub o: &'a [T],
    pub lse: &'a [T],
    pub d_o: &'a [T],
    pub d_lse: Option<&'a [T]>,
}

/// Backward pass: writes every element of `dq: [b, nq, h, d]`, `dk, dv: [b, nk, hkv, d]`. Returns the number
/// of (query tile, key tile) products computed, summed over batch and query heads: only the query tiles that
/// see a key tile (causal cut, sliding window) are visited.
/// `fill` initialises the internal partial buffers (0 in use; NaN in the poison tests, which then show that
/// every element is written before it is read).
pub(crate) fn backward<T: Real>(
    g: &Geometry,
    x: &BackwardInputs<T>,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    fill: T,
) -> usize {
    let (d, nq) = (g.d, g.nq);
    let nkt = g.k_tiles();
    let chunks = TARGET_TASKS.div_ceil((g.b * g.hkv).max(1)).clamp(1, nkt.max(1));
    let log2e = std::f64::consts::LOG2_E;

    // Q and dO in contiguous rows once per query head (O(N·d) each; see `pack_rows` for why); the key tiles
    // are packed by the one task that owns them.
    let ld = g.row_ld();
    let q_len = nq * ld;
    let mut qc = LineBuf::new(g.b * g.h * q_len, fill);
    let mut doc = LineBuf::new(g.b * g.h * q_len, fill);
    if q_len > 0 {
        qc.par_chunks_mut(q_len).zip(doc.par_chunks_mut(q_len)).enumerate().for_each(|(bh, (qd, dod))| {
            let base = g.q_base(bh / g.h, bh % g.h);
            pack_rows(x.q, base, g.q_rs, d, ld, qd);
            pack_rows(x.d_o, base, g.q_rs, d, ld, dod);
        });
    }

    // Per row: lse in log2 units (+inf for a row that sees no key, so its P is 0), and D - d_lse.
    let mut lse2 = vec![fill; g.b * g.h * nq];
    let mut delta = vec![fill; g.b * g.h * nq];
    if nq > 0 {
        lse2.par_chunks_mut(nq).zip(delta.par_chunks_mut(nq)).enumerate().for_each(|(bh, (l2, dl))| {
            let (bi, hi) = (bh / g.h, bh % g.h);
            for i in 0..nq {
                let lse = x.lse[bh * nq + i];
                l2[i] = if lse == T::NEG_INF { T::from_f64(f64::INFINITY) } else { lse * T::from_f64(log2e) };
                let at = g.q_base(bi, hi) + i * g.q_rs;
                let mut dsum = T::ZERO;
                for (&a, &b) in x.d_o[at..at + d].iter().zip(&x.o[at..at + d]) {
                    dsum += a * b;
                }
                dl[i] = match x.d_lse {
                    Some(dl) => dsum - dl[bh * nq + i],
                    None => dsum,
                };
            }
        });
    }

    // dK/dV go straight into the outputs. dQ is accumulated in packed partials (`[b, h, wave, nq, row_ld]`:
    // O(N·d) per slot), never in the `[b, nq, h, d]` output itself, whose row stride of `heads · d` (4 KiB at
    // 8 × 128) puts a register block's rows of C in one L1 set (the dQ product at d = 128, Zen 4, AVX2:
    // 109 -> 90 GFLOP/s strided). The chunks run in waves of `wave` consecutive chunks (enough tasks per wave
    // to keep every thread busy); after each wave its partials are added to dQ in chunk order (chunk 0's
    // copied) before the next wave reuses the slots, and dQ is scaled after the last. The sum order per
    // element is c0 + c1 + c2 + … whatever the wave size, so the bits do not depend on the thread count; the
    // partials' memory is `wave` dQs, not `chunks`.
    let wave = rayon::current_num_threads().div_ceil((g.b * g.hkv).max(1)).clamp(1, chunks);
    let mut dq_part = LineBuf::new(g.b * g.h * wave * nq * ld, fill);
    let dq_dst = DqParts { buf: SharedOut(dq_part.as_mut_ptr()), slots: wave };
    let dk_out = SharedOut(dk.as_mut_ptr());
    let dv_out = SharedOut(dv.as_mut_ptr());
    let packs = Packed { qc: &qc, doc: &doc, lse2: &lse2, delta: &delta };
    let dq_w = SharedOut(dq.as_mut_ptr());
    let mut computed = 0;
    for first in (0..chunks).step_by(wave) {
        let in_wave = wave.min(chunks - first);
        computed += (0..g.b * g.hkv * in_wave)
            .into_par_iter()
            .map(|i| {
                let (bkh, ch) = (i / in_wave, first + i % in_wave);
                // SAFETY: task (bi, kh, ch) alone writes the partial slot of chunk ch of the query heads of kv
                // head kh of batch bi, and the rows of the key tiles t ≡ ch (mod chunks) of that kv head in dk,
                // dv; the waves run one after the other.
                unsafe { key_chunk(g, x, &packs, bkh * chunks + ch, chunks, &dq_dst, &dk_out, &dv_out) }
            })
            .sum::<usize>();
        // Add this wave's partials in chunk order; scale after the last wave.
        let last = first + in_wave == chunks;
        let scale = T::from_f64(g.scale);
        (0..g.b * g.h).into_par_iter().for_each(|bh| {
            let (bi, hi) = (bh / g.h, bh % g.h);
            for i in 0..nq {
                // SAFETY: task bh alone writes the rows of head hi of batch bi.
                let out = unsafe { dq_w.slice(g.q_base(bi, hi) + i * g.q_rs, d) };
                for ch in first..first + in_wave {
                    let part = &dq_part[((bh * wave + ch % wave) * nq + i) * ld..][..d];
                    if ch == 0 {
                        out.copy_from_slice(part);
                    } else {
                        for (o, &p) in out.iter_mut().zip(part) {
                            *o += p;
                        }
                    }
                }
                if last {
                    T::scale_row(g.path, out, scale);
                }
            }
        });
    }
    computed
}

/// Where a task accumulates dQ: chunk `ch` into slot `ch % slots` of the `[b, h, slots, nq, row_ld]`
/// partials.
struct DqParts<T> {
    buf: SharedOut<T>,
    slots: usize,
}

impl<T> DqParts<T> {
    /// The buffer, offset and row stride of head `bh = bi·h + hi`'s dQ rows for chunk `ch`.
    fn rows(&self, g: &Geometry, bh: usize, ch: usize) -> (&SharedOut<T>, usize, usize) {
        (&self.buf, (bh * self.slots + ch % self.slots) * g.nq * g.row_ld(), g.row_ld())
    }
}

/// The per-query-head operands of the backward pass: `qc, doc: [b, h, nq, row_ld]`, and per query row
/// `lse2` (LSE in log2 units, +inf for rows that see no key) and `delta` (`rowsum(dO ∘ O) - d_lse`),
/// `[b, h, nq]`.
struct Packed<'a, T> {
    qc: &'a [T],
    doc: &'a [T],
    lse2: &'a [T],
    delta: &'a [T],
}

impl<T> Packed<'_, T> {
    /// Prefetches share `part` of `parts` (`share`) of the rows that the visit `(bh, qt)` (query tile `qt` of
    /// head `bh`) reads and writes in chunk `ch`: its Q and dO rows and its dQ partial (108 KiB at d = 128
    /// f32, from L3 or memory). A task calls it once per key tile it runs against the current query tile, so
    /// the next tile's rows arrive while the current tile's products run: the backward reads them once per
    /// group of key tiles, too seldom for them to stay in L2. With the forward's prefetch of the next key
    /// tile: forward + backward 0.96 of the time without, at N = 4K-16K, d = 128 (AVX2 on Zen 4;
    /// docs/BENCHMARKS.md, "Software prefetch").
    fn prefetch(&self, g: &Geometry, dq: &DqParts<T>, ch: usize, (bh, qt): (usize, usize), share: (usize, usize)) {
        let (part, parts) = share;
        let (ld, i0) = (g.row_ld(), qt * BR);
        let rows = (g.nq - i0).min(BR);
        let at = (bh * g.nq + i0) * ld;
        prefetch_rows(self.qc[at..].as_ptr(), rows, g.d, ld, part, parts);
        prefetch_rows(self.doc[at..].as_ptr(), rows, g.d, ld, part, parts);
        let (buf, base, rs) = dq.rows(g, bh, ch);
        prefetch_rows(buf.0.wrapping_add(base + i0 * rs).cast_const(), rows, g.d, rs, part, parts);
    }
}

/// Bytes of key-tile state (packed Kᵀ, Vᵀ and K, and the dK, dV accumulators) a backward task keeps per
/// group of key tiles: 2 tiles at d = 128 f32 (188 KiB each), 3 at d = 64 (102 KiB). The task runs each query
/// tile against all the key tiles of its group that it sees before it moves on, so the query side (Q and dO
/// rows and the dQ partial, 108 KiB at d = 128, from L3 or memory) is fetched once per group rather than once
/// per key tile; the budget leaves room for those and the score tiles in a 512 KiB L2 (Zen 2/3; 1 MiB or more
/// on Zen 4/5 and recent Intel parts). A budget sized to Zen 4's 1 MiB L2 (4 tiles at d = 128) measured no
/// better there (docs/BENCHMARKS.md).
const KEY_GROUP_BYTES: usize = 384 << 10;

/// Key tiles per group for head dim `d` in `T` (1 to 4; see [`KEY_GROUP_BYTES`]).
fn key_group<T>(d: usize) -> usize {
    let per_tile = (2 * d * KT_LD + 3 * BC * (d + super::tiles::PAD)) * std::mem::size_of::<T>();
    (KEY_GROUP_BYTES / per_tile.max(1)).clamp(1, 4)
}

/// The state of one key tile of a backward task's group: its packed Kᵀ, Vᵀ (`[d, KT_LD]`) and K rows
/// (`[BC, row_ld]`), the query tiles that see it, and its dK, dV accumulators (`[BC, row_ld]`).
struct KeyTile<T> {
    t: usize,
    q_tiles: std::ops::Range<usize>,
    kt: LineBuf<T>,
    vt: LineBuf<T>,
    kc: LineBuf<T>,
    dk: LineBuf<T>,
    dv: LineBuf<T>,
}

/// One backward task: the key tiles `t ≡ ch (mod chunks)` of kv head `kh` of batch `bi`, in groups of
/// [`key_group`] tiles, each packed here (only this task reads it) and run against every query tile of
/// every query head of its group that sees it (group heads in order, then query tiles, then the group's key
/// tiles: every dQ row still receives its key tiles in order and every dK/dV row its heads and query tiles
/// in order, so the bits do not depend on the grouping). Returns the number of (query tile, key tile)
/// products computed.
///
/// # Safety
/// No other task writes this task's parts of `dq`, `dk_out`, `dv_out` (see [`backward`]).
#[allow(clippy::too_many_arguments)]
unsafe fn key_chunk<T: Real>(
    g: &Geometry,
    x: &BackwardInputs<T>,
    pk: &Packed<T>,
    idx: usize,
    chunks: usize,
    dq: &DqParts<T>,
    dk_out: &SharedOut<T>,
    dv_out: &SharedOut<T>,
) -> usize {
    let (d, nq, nk, ld) = (g.d, g.nq, g.nk, g.row_ld());
    let mut computed = 0;
    let ch = idx % chunks;
    let bkh = idx / chunks;
    let (bi, kh) = (bkh / g.hkv, bkh % g.hkv);
    let c = T::from_f64(g.scale * std::f64::consts::LOG2_E);
    let scale = T::from_f64(g.scale);
    let heads: Vec<usize> = (0..g.group).map(|gi| bi * g.h + kh * g.group + gi).collect();
    for &bh in &heads {
        let (buf, base, rs) = dq.rows(g, bh, ch);
        for i in 0..nq {
            buf.slice(base + i * rs, d).fill(T::ZERO);
        }
    }

    let mut p = LineBuf::new(BR * BC, T::ZERO);
    let mut ds = LineBuf::new(BR * BC, T::ZERO);
    let mine: Vec<usize> = (ch..g.k_tiles()).step_by(chunks).collect();
    let size = key_group::<T>(d).min(mine.len());
    let mut group: Vec<KeyTile<T>> = (0..size)
        .map(|_| KeyTile {
            t: 0,
            q_tiles: 0..0,
            kt: LineBuf::new(d * KT_LD, T::ZERO),
            vt: LineBuf::new(d * KT_LD, T::ZERO),
            kc: LineBuf::new(BC * ld, T::ZERO),
            dk: LineBuf::new(BC * ld, T::ZERO),
            dv: LineBuf::new(BC * ld, T::ZERO),
        })
        .collect();
    for tiles in mine.chunks(size.max(1)) {
        let group = &mut group[..tiles.len()];
        for (kt, &t) in group.iter_mut().zip(tiles) {
            let j0 = t * BC;
            let cols = (nk - j0).min(BC);
            kt.t = t;
            kt.q_tiles = g.query_tiles_seeing(j0, cols);
            kt.dk.fill(T::ZERO);
            kt.dv.fill(T::ZERO);
            if !kt.q_tiles.is_empty() {
                g.pack_tile_transposed(x.k, bi, kh, t, &mut kt.kt);
                g.pack_tile_transposed(x.v, bi, kh, t, &mut kt.vt);
                pack_rows(x.k, g.k_base(bi, kh) + j0 * g.k_rs, g.k_rs, d, ld, &mut kt.kc[..cols * ld]);
            }
        }
        let q_first = group.iter().map(|k| k.q_tiles.start).min().unwrap_or(0);
        let q_end = group.iter().map(|k| k.q_tiles.end).max().unwrap_or(0);
        for (hn, &bh) in heads.iter().enumerate() {
            let qc = &pk.qc[bh * nq * ld..][..nq * ld];
            let doc = &pk.doc[bh * nq * ld..][..nq * ld];
            let lse2 = &pk.lse2[bh * nq..][..nq];
            let delta = &pk.delta[bh * nq..][..nq];
            let (dq_buf, dq_base, dq_rs) = dq.rows(g, bh, ch);
            for qt in q_first..q_end {
                let i0 = qt * BR;
                let rows = (nq - i0).min(BR);
                let qp = qc.as_ptr().add(i0 * ld);
                let dop = doc.as_ptr().add(i0 * ld);
                let dqp = dq_buf.slice(dq_base + i0 * dq_rs, 0).as_mut_ptr();
                let p = &mut p[..rows * BC];
                let ds = &mut ds[..rows * BC];
                // The visit after this one (the next query tile, or the next head's first), whose rows are
                // prefetched in one share per key tile this one runs against.
                let next = if qt + 1 < q_end { Some((bh, qt + 1)) } else { heads.get(hn + 1).map(|&h| (h, q_first)) };
                let seen = group.iter().filter(|k| k.q_tiles.contains(&qt)).count();
                for (ki, k) in group.iter_mut().filter(|k| k.q_tiles.contains(&qt)).enumerate() {
                    computed += 1;
                    if let Some(next) = next {
                        pk.prefetch(g, dq, ch, next, (ki, seen));
                    }
                    let j0 = k.t * BC;
                    let cols = (nk - j0).min(BC);
                    // P = 2^(c · Q Kᵀ - lse2), hidden entries 0.
                    T::gemm(g.path, false, rows, BC, d, qp, ld, 1, k.kt.as_ptr(), KT_LD, p.as_mut_ptr(), BC);
                    if g.tile_needs_mask(i0, rows, j0) {
                        g.mask_tile(p, rows, i0, j0);
                    }
                    T::exp2_tile(g.path, p, BC, c, &lse2[i0..i0 + rows]);
                    // dV += Pᵀ dO.
                    T::gemm(g.path, true, cols, d, rows, p.as_ptr(), 1, BC, dop, ld, k.dv.as_mut_ptr(), ld);
                    // dP = dO Vᵀ, then dS = P ∘ (dP - D + d_lse).
                    T::gemm(g.path, false, rows, BC, d, dop, ld, 1, k.vt.as_ptr(), KT_LD, ds.as_mut_ptr(), BC);
                    T::ds_tile(g.path, ds, p, BC, &delta[i0..i0 + rows]);
                    // dQ += dS K (scaled at the end); dK += dSᵀ Q.
                    T::gemm(g.path, true, rows, d, cols, ds.as_ptr(), BC, 1, k.kc.as_ptr(), ld, dqp, dq_rs);
                    T::gemm(g.path, true, cols, d, rows, ds.as_ptr(), 1, BC, qp, ld, k.dk.as_mut_ptr(), ld);
                }
            }
        }
        for k in group.iter() {
            let j0 = k.t * BC;
            for cc in 0..(nk - j0).min(BC) {
                let at = g.k_base(bi, kh) + (j0 + cc) * g.k_rs;
                let (ok, ov) = (dk_out.slice(at, d), dv_out.slice(at, d));
                for (o, &a) in ok.iter_mut().zip(&k.dk[cc * ld..][..d]) {
                    *o = a * scale;
                }
                ov.copy_from_slice(&k.dv[cc * ld..][..d]);
            }
        }
    }
    computed
}
