//! Flash attention backward on host slices, FlashAttention-2 style from the saved output and LSE, and
//! deterministic: one task per (batch, query head, chunk of key tiles) owns the dK/dV of its key tiles (one
//! buffer per query head) and a dQ buffer of its own; a last pass sums the dQ chunks and the dK/dV of each
//! GQA group in a fixed order. No float is ever added from two threads, so the bits never depend on the
//! scheduling.

use rayon::prelude::*;

use super::geometry::{pack_rows, Geometry, SharedOut, BC, BR};
use super::real::Real;

/// Tasks to aim for when batch × heads is small: the key tiles of a head are dealt round-robin to
/// `ceil(TARGET_TASKS / (batch · heads))` chunks (a function of the shapes only, never of the thread count).
const TARGET_TASKS: usize = 16;

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

/// Backward pass: writes every element of `dq: [b, nq, h, d]`, `dk, dv: [b, nk, hkv, d]`.
/// `fill` initialises the internal partial buffers (0 in use; NaN in the poison tests, which then show that
/// every element is written before it is read).
pub(crate) fn backward<T: Real>(
    g: &Geometry,
    x: &BackwardInputs<T>,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    fill: T,
) {
    let (d, nq, nk) = (g.d, g.nq, g.nk);
    let nkt = g.k_tiles();
    let chunks = TARGET_TASKS
        .div_ceil((g.b * g.h).max(1))
        .clamp(1, nkt.max(1));
    let log2e = std::f64::consts::LOG2_E;

    // Packed operands: Kᵀ and Vᵀ in tiles and K in contiguous rows once per kv head, Q and dO in contiguous
    // rows once per query head (O(N·d) each; see `pack_rows` for why).
    let kt_len = nkt * d * BC;
    let (k_len, q_len) = (nk * d, nq * d);
    let mut kt = vec![fill; g.b * g.hkv * kt_len];
    let mut vt = vec![fill; g.b * g.hkv * kt_len];
    let mut kc = vec![fill; g.b * g.hkv * k_len];
    if kt_len > 0 {
        kt.par_chunks_mut(kt_len)
            .zip(vt.par_chunks_mut(kt_len))
            .zip(kc.par_chunks_mut(k_len))
            .enumerate()
            .for_each(|(idx, ((kd, vd), kcd))| {
                let (bi, kh) = (idx / g.hkv, idx % g.hkv);
                g.pack_transposed(x.k, bi, kh, kd);
                g.pack_transposed(x.v, bi, kh, vd);
                pack_rows(x.k, g.k_base(bi, kh), g.k_rs, d, kcd);
            });
    }
    let mut qc = vec![fill; g.b * g.h * q_len];
    let mut doc = vec![fill; g.b * g.h * q_len];
    if q_len > 0 {
        qc.par_chunks_mut(q_len)
            .zip(doc.par_chunks_mut(q_len))
            .enumerate()
            .for_each(|(bh, (qd, dod))| {
                let base = g.q_base(bh / g.h, bh % g.h);
                pack_rows(x.q, base, g.q_rs, d, qd);
                pack_rows(x.d_o, base, g.q_rs, d, dod);
            });
    }

    // Per row: lse in log2 units (+inf for a row that sees no key, so its P is 0), and D - d_lse.
    let mut lse2 = vec![fill; g.b * g.h * nq];
    let mut delta = vec![fill; g.b * g.h * nq];
    if nq > 0 {
        lse2.par_chunks_mut(nq)
            .zip(delta.par_chunks_mut(nq))
            .enumerate()
            .for_each(|(bh, (l2, dl))| {
                let (bi, hi) = (bh / g.h, bh % g.h);
                for i in 0..nq {
                    let lse = x.lse[bh * nq + i];
                    l2[i] = if lse == T::NEG_INF {
                        T::from_f64(f64::INFINITY)
                    } else {
                        lse * T::from_f64(log2e)
                    };
                    let at = g.q_base(bi, hi) + i * g.q_rs;
                    let mut dsum = T::ZERO;
                    for (&a, &b) in x.d_o[at..at + d].iter().zip(&x.o[at..at + d]) {
                        dsum = dsum + a * b;
                    }
                    dl[i] = match x.d_lse {
                        Some(dl) => dsum - dl[bh * nq + i],
                        None => dsum,
                    };
                }
            });
    }

    // Partial results: dQ per (b, h, chunk), dK and dV per (b, query head).
    let mut dq_part = vec![fill; g.b * g.h * chunks * nq * d];
    let mut dk_part = vec![fill; g.b * g.h * nk * d];
    let mut dv_part = vec![fill; g.b * g.h * nk * d];
    let dq_out = SharedOut(dq_part.as_mut_ptr());
    let dk_out = SharedOut(dk_part.as_mut_ptr());
    let dv_out = SharedOut(dv_part.as_mut_ptr());
    let packs = Packed {
        kt: &kt,
        vt: &vt,
        kc: &kc,
        qc: &qc,
        doc: &doc,
    };
    let (lse2, delta) = (&lse2[..], &delta[..]);
    // Chunk 0 holds the first key tiles, which the most query tiles see under a causal mask: run it early.
    (0..g.b * g.h * chunks).into_par_iter().for_each(|idx| {
        // SAFETY: task (bi, hi, ch) alone writes dq_part[bi, hi, ch] and the rows of the key tiles
        // t ≡ ch (mod chunks) of dk_part[bi, hi] and dv_part[bi, hi].
        unsafe {
            key_chunk(
                g, &packs, lse2, delta, idx, chunks, &dq_out, &dk_out, &dv_out,
            )
        };
    });

    // Fixed-order sums: dQ over chunks (times the scale), dK/dV over each kv head's group.
    let scale = T::from_f64(g.scale);
    let dq_w = SharedOut(dq.as_mut_ptr());
    (0..g.b * g.h).into_par_iter().for_each(|bh| {
        let (bi, hi) = (bh / g.h, bh % g.h);
        for i in 0..nq {
            // SAFETY: task bh alone writes the rows of head hi of batch bi.
            let out = unsafe { dq_w.slice(g.q_base(bi, hi) + i * g.q_rs, d) };
            out.copy_from_slice(&dq_part[(bh * chunks * nq + i) * d..][..d]);
            for ch in 1..chunks {
                let part = &dq_part[((bh * chunks + ch) * nq + i) * d..][..d];
                for (o, &p) in out.iter_mut().zip(part) {
                    *o = *o + p;
                }
            }
            T::scale_row(out, scale);
        }
    });
    let dk_w = SharedOut(dk.as_mut_ptr());
    let dv_w = SharedOut(dv.as_mut_ptr());
    (0..g.b * g.hkv).into_par_iter().for_each(|bkh| {
        let (bi, kh) = (bkh / g.hkv, bkh % g.hkv);
        for j in 0..nk {
            let at = g.k_base(bi, kh) + j * g.k_rs;
            // SAFETY: task bkh alone writes the rows of kv head kh of batch bi.
            let (ok, ov) = unsafe { (dk_w.slice(at, d), dv_w.slice(at, d)) };
            let row_at = |gi: usize| ((bi * g.h + kh * g.group + gi) * nk + j) * d;
            ok.copy_from_slice(&dk_part[row_at(0)..][..d]);
            ov.copy_from_slice(&dv_part[row_at(0)..][..d]);
            for gi in 1..g.group {
                for (o, &p) in ok.iter_mut().zip(&dk_part[row_at(gi)..][..d]) {
                    *o = *o + p;
                }
                for (o, &p) in ov.iter_mut().zip(&dv_part[row_at(gi)..][..d]) {
                    *o = *o + p;
                }
            }
        }
    });
}

/// The packed operands of the backward pass: `kt, vt: [b, hkv, k_tiles, d, BC]`, `kc: [b, hkv, nk, d]`,
/// `qc, doc: [b, h, nq, d]`.
struct Packed<'a, T> {
    kt: &'a [T],
    vt: &'a [T],
    kc: &'a [T],
    qc: &'a [T],
    doc: &'a [T],
}

/// One backward task: the key tiles `t ≡ ch (mod chunks)` of query head `hi` of batch `bi`, each against
/// every query tile that sees it.
///
/// # Safety
/// No other task writes this task's parts of `dq_out`, `dk_out`, `dv_out` (see [`backward`]).
#[allow(clippy::too_many_arguments)]
unsafe fn key_chunk<T: Real>(
    g: &Geometry,
    pk: &Packed<T>,
    lse2: &[T],
    delta: &[T],
    idx: usize,
    chunks: usize,
    dq_out: &SharedOut<T>,
    dk_out: &SharedOut<T>,
    dv_out: &SharedOut<T>,
) {
    let (d, nq, nk) = (g.d, g.nq, g.nk);
    let ch = idx % chunks;
    let bh = idx / chunks;
    let (bi, hi) = (bh / g.h, bh % g.h);
    let kh = hi / g.group;
    let kt_len = g.k_tiles() * d * BC;
    let kt = &pk.kt[(bi * g.hkv + kh) * kt_len..][..kt_len];
    let vt = &pk.vt[(bi * g.hkv + kh) * kt_len..][..kt_len];
    let kc = &pk.kc[(bi * g.hkv + kh) * nk * d..][..nk * d];
    let qc = &pk.qc[bh * nq * d..][..nq * d];
    let doc = &pk.doc[bh * nq * d..][..nq * d];
    let c = T::from_f64(g.scale * std::f64::consts::LOG2_E);
    let scale = T::from_f64(g.scale);
    let lse2 = &lse2[bh * nq..][..nq];
    let delta = &delta[bh * nq..][..nq];

    let dq = dq_out.slice((bh * chunks + ch) * nq * d, nq * d);
    dq.fill(T::ZERO);
    let mut p = [T::ZERO; BR * BC];
    let mut ds = [T::ZERO; BR * BC];
    let mut dk_acc = vec![T::ZERO; BC * d];
    let mut dv_acc = vec![T::ZERO; BC * d];

    for t in (ch..g.k_tiles()).step_by(chunks) {
        let j0 = t * BC;
        let cols = (nk - j0).min(BC);
        dk_acc.fill(T::ZERO);
        dv_acc.fill(T::ZERO);
        let first_row = g.first_row_seeing(j0);
        let first_tile = if first_row >= nq {
            g.q_tiles()
        } else {
            first_row / BR
        };
        for qt in first_tile..g.q_tiles() {
            let i0 = qt * BR;
            let rows = (nq - i0).min(BR);
            let qp = qc.as_ptr().add(i0 * d);
            let dop = doc.as_ptr().add(i0 * d);
            let p = &mut p[..rows * BC];
            let ds = &mut ds[..rows * BC];

            // P = 2^(c · Q Kᵀ - lse2), hidden entries 0.
            T::gemm(
                false,
                rows,
                BC,
                d,
                qp,
                d,
                1,
                kt.as_ptr().add(t * d * BC),
                BC,
                p.as_mut_ptr(),
                BC,
            );
            if g.tile_needs_mask(i0, j0) {
                g.mask_tile(p, rows, i0, j0);
            }
            for r in 0..rows {
                T::exp2_row(&mut p[r * BC..(r + 1) * BC], c, lse2[i0 + r]);
            }
            // dV += Pᵀ dO.
            T::gemm(
                true,
                cols,
                d,
                rows,
                p.as_ptr(),
                1,
                BC,
                dop,
                d,
                dv_acc.as_mut_ptr(),
                d,
            );
            // dP = dO Vᵀ, then dS = P ∘ (dP - D + d_lse).
            T::gemm(
                false,
                rows,
                BC,
                d,
                dop,
                d,
                1,
                vt.as_ptr().add(t * d * BC),
                BC,
                ds.as_mut_ptr(),
                BC,
            );
            for r in 0..rows {
                T::ds_row(
                    &mut ds[r * BC..(r + 1) * BC],
                    &p[r * BC..(r + 1) * BC],
                    delta[i0 + r],
                );
            }
            // dQ += dS K (scaled in the final sum); dK += dSᵀ Q.
            let kp = kc.as_ptr().add(j0 * d);
            T::gemm(
                true,
                rows,
                d,
                cols,
                ds.as_ptr(),
                BC,
                1,
                kp,
                d,
                dq.as_mut_ptr().add(i0 * d),
                d,
            );
            T::gemm(
                true,
                cols,
                d,
                rows,
                ds.as_ptr(),
                1,
                BC,
                qp,
                d,
                dk_acc.as_mut_ptr(),
                d,
            );
        }
        let dk_rows = dk_out.slice((bh * nk + j0) * d, cols * d);
        let dv_rows = dv_out.slice((bh * nk + j0) * d, cols * d);
        for (o, &a) in dk_rows.iter_mut().zip(&dk_acc[..cols * d]) {
            *o = a * scale;
        }
        dv_rows.copy_from_slice(&dv_acc[..cols * d]);
    }
}
