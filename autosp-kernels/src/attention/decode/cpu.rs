//! The CPU kernel of decode attention over cached blocks ([`attention_over_blocks`](super::attention_over_blocks)
//! on the CPU): the few query rows of a decode step (`heads / kv_heads` per kv head, times `q_len`) against
//! every cached row, read once from the blocks in place (f32, or bf16 widened in registers' reach: 256 rows at
//! a time into a buffer that stays in L2), never copied into new tensors.
//!
//! The work is cut into tasks of at most [`ROWS_PER_TASK`] cached rows of one kv head, run on rayon's pool:
//! each task computes its scores `s = (scale · q) · kᵀ` row by row (one dot per query row, the key row read
//! once), their softmax in the log2 domain (max, then `2^((s - max) · log2 e)` and its sum), and `acc = p · v`
//! with the attention tile product ([`Real::gemm`]). Each task writes its part into its own slot of one
//! buffer per call, and the parts are merged in the tasks' fixed order by their maxima and sums (the LSE
//! merge), so the result does not depend on how rayon scheduled them. A task's working buffers (widened rows,
//! scores) are its worker thread's [`Scratch`], reused from task to task and call to call: a decode step
//! allocates per call, never per block or task. Accumulation in f32; `lse` in natural log.

use autosp_core::simd::SimdPath;
use candle_core::{CpuStorage, DType, Storage, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::host::tensor_from;
use crate::vector::Real;
use crate::Result;

/// Cached rows per task (of one kv head): 256 rows of head_dim 64 are 64 KiB of keys and as much of values.
pub(crate) const ROWS_PER_TASK: usize = 256;

/// One block's keys or values as the kernel reads them: the whole storage and where each head's rows start.
enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// One block: keys and values, the offset of head 0's first row, the stride between heads, its rows.
struct BlockRef<'a> {
    k: Rows<'a>,
    v: Rows<'a>,
    start: usize,
    head_stride: usize,
    rows: usize,
}

/// What a task returns for each of its `nr` query rows: the largest score `m` (scaled), the sum `l` of
/// `e^(s - m)`, and `acc = Σ e^(s - m) v` (`[nr, d]`). Views into the call's one buffer of every task's
/// part ([`Partial::split`]).
struct Partial<'a> {
    m: &'a mut [f32],
    l: &'a mut [f32],
    acc: &'a mut [f32],
}

impl<'a> Partial<'a> {
    /// Values a task's part takes for `nr` query rows of `d` values.
    fn len(nr: usize, d: usize) -> usize {
        nr * (d + 2)
    }

    /// `slot` (of [`Partial::len`] values) as `m`, `l`, `acc`.
    fn split(slot: &'a mut [f32], nr: usize) -> Self {
        let (m, rest) = slot.split_at_mut(nr);
        let (l, acc) = rest.split_at_mut(nr);
        Partial { m, l, acc }
    }
}

/// A worker thread's buffers for its tasks, kept for the thread's life and grown to the largest task it ran,
/// so that a decode step allocates nothing per task: the widened keys and values of a bf16 cache and the
/// scores. Every task overwrites what it reads of them, so what an earlier task left never reaches a result.
#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Whether the kernel serves `q` over blocks of `cache` dtype: f32 or bf16 queries and caches.
pub(crate) fn serves(q: DType, cache: DType) -> bool {
    matches!(q, DType::F32 | DType::BF16) && matches!(cache, DType::F32 | DType::BF16)
}

/// Elements `at..at + len` of `rows` as f32 (bf16 widened into `buf`: its bits are the high half of an f32's).
/// Not half's `convert_to_f32_slice`: for bf16 (half 2.7) that is a scalar loop that also quiets signalling
/// NaNs, 2.1x this loop's time (which the compiler vectorises) on a task's 256 × 64 values.
fn read<'a>(rows: &'a Rows<'_>, at: usize, len: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
    match rows {
        Rows::F32(s) => &s[at..at + len],
        Rows::Bf16(s) => {
            buf.clear();
            buf.extend(s[at..at + len].iter().map(|b| f32::from_bits((b.to_bits() as u32) << 16)));
            buf
        }
    }
}

/// `s[i · n + j] = q_i · k_j` for the `nr` rows of `q: [nr, d]` and the `n` rows of `k: [n, d]`: AVX-512's
/// score tree over whole groups of 8 key rows where `d` is a multiple of 16, [`Real::dots`] otherwise (and
/// for the last `n % 8` rows).
fn scores(path: SimdPath, q: &[f32], k: &[f32], d: usize, s: &mut [f32]) {
    let n = k.len() / d;
    #[cfg(target_arch = "x86_64")]
    if path == SimdPath::Avx512 && path.is_supported() && d.is_multiple_of(16) {
        let whole = n - n % 8;
        // SAFETY: AVX-512F detected; rows of d = 16·v elements, whole groups of 8 rows, scores in bounds.
        unsafe { avx512_scores(q, &k[..whole * d], d, s, n) };
        if whole < n {
            f32::dots(path, q, &k[whole * d..], d, &mut s[whole..], n);
        }
        return;
    }
    f32::dots(path, q, k, d, s, n);
}

/// [`scores`] with AVX-512 over 8 key rows and up to 3 query rows at a time: 24 vector accumulators (one per
/// key and query row) fed by one load of each key vector and of each query vector, each query's 8 reduced
/// together by a transpose-and-add tree into 8 scores, instead of 8 horizontal sums. `k`: a whole number of
/// 8-row groups; `s` has row stride `ld`.
///
/// # Safety
/// AVX-512F must be available; `d` a multiple of 16; `q: [nr, d]`, `k: [8·groups, d]`, `s: [nr, ld]` with
/// `ld` at least k's rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_scores(q: &[f32], k: &[f32], d: usize, s: &mut [f32], ld: usize) {
    let (nr, rows) = (q.len() / d, k.len() / d);
    let mut i = 0;
    while i < nr {
        let (qp, sp) = (q.as_ptr().add(i * d), s.as_mut_ptr().add(i * ld));
        match nr - i {
            1 => scores_block::<1>(qp, k.as_ptr(), d, rows, sp, ld),
            2 => scores_block::<2>(qp, k.as_ptr(), d, rows, sp, ld),
            _ => scores_block::<3>(qp, k.as_ptr(), d, rows, sp, ld),
        }
        i += 3;
    }
}

/// [`avx512_scores`] for `Q` query rows at `q` (row stride `d`) against `rows` key rows at `k`, into `s`
/// (row stride `ld`).
///
/// # Safety
/// As [`avx512_scores`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)]
unsafe fn scores_block<const Q: usize>(q: *const f32, k: *const f32, d: usize, rows: usize, s: *mut f32, ld: usize) {
    use std::arch::x86_64::*;
    for j0 in (0..rows).step_by(8) {
        let kp = k.add(j0 * d);
        let mut acc = [[_mm512_setzero_ps(); 8]; Q];
        for c in (0..d).step_by(16) {
            let mut qv = [_mm512_setzero_ps(); Q];
            for i in 0..Q {
                qv[i] = _mm512_loadu_ps(q.add(i * d + c));
            }
            for r in 0..8 {
                let kv = _mm512_loadu_ps(kp.add(r * d + c));
                for i in 0..Q {
                    acc[i][r] = _mm512_fmadd_ps(kv, qv[i], acc[i][r]);
                }
            }
        }
        for i in 0..Q {
            let a = &acc[i];
            // Pairs of rows: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3].
            let mut x = [_mm512_setzero_ps(); 4];
            for p in 0..4 {
                x[p] = _mm512_add_ps(
                    _mm512_unpacklo_ps(a[2 * p], a[2 * p + 1]),
                    _mm512_unpackhi_ps(a[2 * p], a[2 * p + 1]),
                );
            }
            // Quads: per 128-bit lane, that lane's sums of rows 4p..4p + 4 in order.
            let mut y = [_mm512_setzero_ps(); 2];
            for p in 0..2 {
                let (a, b) = (_mm512_castps_pd(x[2 * p]), _mm512_castps_pd(x[2 * p + 1]));
                y[p] = _mm512_add_ps(
                    _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                    _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
                );
            }
            // Across the four 128-bit lanes: [y0.L0 + y0.L2, y0.L1 + y0.L3, y1.L0 + y1.L2, y1.L1 + y1.L3], then
            // lanes 0 + 1 and 2 + 3.
            let h = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(y[0], y[1]),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(y[0], y[1]),
            );
            let out =
                _mm512_add_ps(_mm512_shuffle_f32x4::<0b00_00_10_00>(h, h), _mm512_shuffle_f32x4::<0b00_00_11_01>(h, h));
            _mm256_storeu_ps(s.add(i * ld + j0), _mm512_castps512_ps256(out));
        }
    }
}

/// One task: the `nr` query rows `q: [nr, d]` (already scaled) against rows `r0..r0 + n` of head `h` of
/// `block`, into `out` (written whole), on this thread's [`Scratch`].
#[allow(clippy::too_many_arguments)]
fn task(path: SimdPath, q: &[f32], d: usize, block: &BlockRef<'_>, h: usize, r0: usize, n: usize, out: Partial<'_>) {
    SCRATCH.with(|scratch| {
        let Scratch { k: kbuf, v: vbuf, s } = &mut *scratch.borrow_mut();
        let nr = q.len() / d;
        let at = block.start + h * block.head_stride + r0 * d;
        let k = read(&block.k, at, n * d, kbuf);
        if s.len() < nr * n {
            s.resize(nr * n, 0.0);
        }
        let s = &mut s[..nr * n];
        scores(path, q, k, d, s);
        for (i, row) in s.chunks_exact_mut(n).enumerate() {
            let mx = f32::max_row(path, row);
            out.m[i] = mx;
            out.l[i] = f32::exp2_row(path, row, std::f32::consts::LOG2_E, mx * std::f32::consts::LOG2_E);
        }
        let v = read(&block.v, at, n * d, vbuf);
        // SAFETY: s is [nr, n] (row stride n), v is [n, d] (row stride d), acc is [nr, d] (row stride d).
        unsafe { f32::gemm(path, false, nr, d, n, s.as_ptr(), n, 1, v.as_ptr(), d, out.acc.as_mut_ptr(), d) };
    })
}

/// Merges `b` into `a` (the same query rows over disjoint keys): `m = max`, `l` and `acc` rescaled and added.
fn merge(a: &mut Partial<'_>, b: &Partial<'_>, d: usize) {
    for i in 0..a.m.len() {
        let m = a.m[i].max(b.m[i]);
        let (ca, cb) = ((a.m[i] - m).exp(), (b.m[i] - m).exp());
        a.m[i] = m;
        a.l[i] = a.l[i] * ca + b.l[i] * cb;
        for (x, &y) in a.acc[i * d..(i + 1) * d].iter_mut().zip(&b.acc[i * d..(i + 1) * d]) {
            *x = *x * ca + y * cb;
        }
    }
}

/// A block view's storage as [`Rows`].
fn rows_of<'a>(storage: &'a Storage) -> Option<Rows<'a>> {
    match storage {
        Storage::Cpu(CpuStorage::F32(v)) => Some(Rows::F32(v)),
        Storage::Cpu(CpuStorage::BF16(v)) => Some(Rows::Bf16(v)),
        _ => None,
    }
}

/// Decode attention of `q: [1, nq, h, d]` over the blocks `views` (`(k, v)`, each `[hkv, rows, d]` with rows
/// of `d` contiguous elements), scale `scale`: `(o: [1, nq, h, d]` in q's dtype, `lse: [1, h, nq]` f32`)`,
/// or `None` when a block is not laid out so (the caller then takes the tensor-op path).
pub(crate) fn attend(
    path: SimdPath,
    q: &Tensor,
    views: &[(Tensor, Tensor)],
    scale: f64,
) -> Result<Option<(Tensor, Tensor)>> {
    let (_, nq, h, d) = q.dims4()?;
    let hkv = views[0].0.dim(0)?;
    let g = h / hkv;
    let nr = g * nq;
    // The query rows of kv head kh, scaled: row j · nq + t is head kh · g + j at query position t.
    let qv: Vec<f32> = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut qs = vec![0f32; hkv * nr * d];
    for t in 0..nq {
        for head in 0..h {
            let (kh, j) = (head / g, head % g);
            let dst = (kh * nr + j * nq + t) * d;
            let src = (t * h + head) * d;
            for (x, &y) in qs[dst..dst + d].iter_mut().zip(&qv[src..src + d]) {
                *x = y * scale as f32;
            }
        }
    }
    let guards: Vec<_> = views.iter().map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout())).collect();
    let mut blocks = Vec::with_capacity(views.len());
    for ((kg, kl), (vg, vl)) in &guards {
        let (Some(k), Some(v)) = (rows_of(kg), rows_of(vg)) else { return Ok(None) };
        let (ks, vs) = (kl.stride(), vl.stride());
        let laid_out = ks == vs && ks.len() == 3 && ks[1] == d && ks[2] == 1 && kl.start_offset() == vl.start_offset();
        if !laid_out || kl.dims() != vl.dims() {
            return Ok(None);
        }
        blocks.push(BlockRef { k, v, start: kl.start_offset(), head_stride: ks[0], rows: kl.dims()[1] });
    }
    // Tasks in a fixed order: kv head, block, rows; each writes its own slot of one buffer.
    let mut tasks = Vec::new();
    for kh in 0..hkv {
        for (b, block) in blocks.iter().enumerate() {
            for r0 in (0..block.rows).step_by(ROWS_PER_TASK) {
                tasks.push((kh, b, r0, ROWS_PER_TASK.min(block.rows - r0)));
            }
        }
    }
    let len = Partial::len(nr, d);
    let mut parts = vec![0f32; tasks.len() * len];
    parts.par_chunks_mut(len).zip(&tasks).for_each(|(slot, &(kh, b, r0, n))| {
        task(path, &qs[kh * nr * d..(kh + 1) * nr * d], d, &blocks[b], kh, r0, n, Partial::split(slot, nr))
    });
    drop(guards);
    let (mut o, mut lse) = (vec![0f32; nq * h * d], vec![0f32; h * nq]);
    // Each kv head's tasks are consecutive: merged in order into the first.
    let mut slots = parts.chunks_exact_mut(len).zip(&tasks).peekable();
    for kh in 0..hkv {
        let Some((first, _)) = slots.next_if(|(_, t)| t.0 == kh) else { return Ok(None) };
        let mut p = Partial::split(first, nr);
        while let Some((slot, _)) = slots.next_if(|(_, t)| t.0 == kh) {
            merge(&mut p, &Partial::split(slot, nr), d);
        }
        for j in 0..g {
            for t in 0..nq {
                let (i, head) = (j * nq + t, kh * g + j);
                let dst = (t * h + head) * d;
                for (x, &a) in o[dst..dst + d].iter_mut().zip(&p.acc[i * d..(i + 1) * d]) {
                    *x = a / p.l[i];
                }
                lse[head * nq + t] = p.m[i] + p.l[i].ln();
            }
        }
    }
    let o = tensor_from(o, (1, nq, h, d))?.to_dtype(q.dtype())?;
    Ok(Some((o, tensor_from(lse, (1, h, nq))?)))
}
#[cfg(test)]
mod tests {
    use super::*;

    /// The scores on every vector path this CPU has against the scalar loops, for 45 key rows (five groups
    /// of 8 for AVX-512's tree and a tail of 5) and 4 query rows (a block of 3 and one of 1) or 5 (a block of
    /// 3 and one of 2, so every block size of the tree runs): within 1e-4 relative (f32 dot products of 64
    /// terms near 20, summed in other orders).
    #[test]
    fn scores_on_every_path_equal_the_scalar_dots() {
        let (d, n) = (64, 45);
        for nr in [4, 5] {
            let q: Vec<f32> = (0..nr * d).map(|i| ((i * 7) % 13) as f32 * 0.1 - 0.5).collect();
            let k: Vec<f32> = (0..n * d).map(|i| ((i * 5) % 11) as f32 * 0.1).collect();
            let mut want = vec![0f32; nr * n];
            scores(SimdPath::Scalar, &q, &k, d, &mut want);
            for path in autosp_core::simd::supported_paths() {
                let mut got = vec![0f32; nr * n];
                scores(path, &q, &k, d, &mut got);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{path:?} {nr} rows, score {i}: {a} against {b}");
                }
            }
        }
    }

    /// The result does not depend on how rayon schedules the tasks nor on what earlier tasks left in a worker's
    /// [`Scratch`]: on every path, f32 and bf16 caches, a block of 600 rows (three tasks, the last partial) and
    /// a narrowed one of 7, the same bits on a fresh one-thread pool and on three threads whose buffers a
    /// larger call (more query rows, longer blocks, other values) filled first.
    #[test]
    fn the_result_does_not_depend_on_the_threads_or_earlier_calls() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let val = |len: usize, salt: usize| -> Vec<f32> {
            (0..len).map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0).collect()
        };
        let (h, hkv, d) = (6, 2, 64);
        let pool = |threads| rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
        let (one, three) = (pool(1), pool(3));
        let bits = |(o, lse): (Tensor, Tensor)| -> Result<Vec<u32>> {
            let o = o.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            Ok(o.iter().chain(&lse.flatten_all()?.to_vec1::<f32>()?).map(|x| x.to_bits()).collect())
        };
        for dtype in [DType::F32, DType::BF16] {
            let rows =
                |n: usize, salt: usize| Tensor::from_vec(val(hkv * n * d, salt), (hkv, n, d), &dev)?.to_dtype(dtype);
            let (k, v) = (rows(600, 2)?, rows(600, 3)?);
            let views = [(k.clone(), v.clone()), (k.narrow(1, 5, 7)?, v.narrow(1, 5, 7)?)];
            let q = Tensor::from_vec(val(2 * h * d, 1), (1, 2, h, d), &dev)?.to_dtype(dtype)?;
            let (big_k, big_v) = (rows(1100, 4)?, rows(1100, 5)?);
            let big_q = Tensor::from_vec(val(5 * h * d, 6), (1, 5, h, d), &dev)?.to_dtype(dtype)?;
            for path in autosp_core::simd::supported_paths() {
                let want = bits(one.install(|| attend(path, &q, &views, 0.125))?.expect("laid out for the kernel"))?;
                three.install(|| attend(path, &big_q, &[(big_k.clone(), big_v.clone())], 0.3))?;
                let got = bits(three.install(|| attend(path, &q, &views, 0.125))?.expect("laid out for the kernel"))?;
                assert!(got == want, "{path:?} {dtype:?}: other bits on three threads after a larger call");
            }
        }
        Ok(())
    }
}
