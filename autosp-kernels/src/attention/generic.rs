//! Device-generic attention: the contract of the CPU kernel (forward with the LSE, backward from the saved
//! output and LSE, GQA/MQA, the masks, scale and position offsets of [`AttentionSpec`]) written only with
//! candle tensor ops, so it runs on CPU, CUDA and Metal alike. The door (`mod.rs`) checks the inputs and
//! sends here every call the CPU kernel does not serve.
//!
//! Layout: `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`, `o` like q,
//! `lse: [batch, heads, q_len]` (natural log; f32, f64 for f64 inputs). Query head `h` reads kv head
//! `h / (heads / kv_heads)`.
//!
//! How it works:
//! - Query blocks of [`TileSize::rows`] rows; each computes the keys its rows see ([`AttentionSpec::key_range`]:
//!   the causal mask and sliding window `max_distance` at the absolute positions `q_offset + i`,
//!   `k_offset + j`), in chunks of at most [`TileSize::keys`] keys: the keys every row of the block sees without
//!   a mask, the keys only some rows see (the causal diagonal, the window's two edges) in chunks with a mask
//!   bias added (built from the rows' key intervals). Keys no row of the block sees are never computed, and
//!   the rows that see no key at all (a prefix before the first key, a suffix past the last key's window) are
//!   not computed either: lse = -inf, o = 0, and zero gradients.
//! - Repeated K/V are never materialised: a query block of the `group = heads / kv_heads` query heads of
//!   each kv head is stacked into `[batch, kv_heads, group · rows, head_dim]`, so one batched matmul per
//!   chunk covers every batch, kv head and group member against K, V in `[batch, kv_heads, k_len, head_dim]`
//!   (copied heads-major once). Every operand keeps head_dim as its last dimension: no column is appended,
//!   so the leading dimensions stay those of the inputs (64, 128, ...), aligned for the GEMMs.
//! - Forward: the online softmax of ALGORITHMS.md, per chunk the row max m, `P = exp(S - m)`, the accumulator
//!   and the row sum l rescaled by `exp(m - m')`; at the end `o = acc / l`, `lse = m + ln l`. The mask bias is
//!   the lowest finite value, not -inf: exp of it is 0 all the same, and a row that sees no key of one chunk
//!   stays finite (its garbage gets weight exp(lowest - m) = 0 once a later chunk shows it a key, and every
//!   computed row sees a key in some chunk).
//! - Backward (FlashAttention-2): per chunk `P = exp(S - lse)` recomputed from the saved LSE (a row with
//!   `lse = -inf` uses the largest finite value, so its P is 0 and its gradients are 0, never NaN),
//!   `dV += Pᵀ dO`, `dS = P ∘ (dP - (D - d_lse))` with `dP = dO Vᵀ` and `D = rowsum(dO ∘ O)`, `dQ += dS K`,
//!   `dK += dSᵀ Q` (the stacked rows sum the GQA group into its kv head); dK and dV are summed in key cells
//!   of `rows` keys, in query-block order. Q is scaled once per block (in f32, then rounded to the input
//!   dtype, exact when the scale is a power of two as for head_dim 16, 64 or 256), so `dK` needs no further
//!   scaling and `dQ` is scaled once.
//! - Precision: every tile product (`Q Kᵀ`, `P V`; `Pᵀ dO`, `dO Vᵀ`, `dS K`, `dSᵀ Q`) is a GEMM in the input
//!   dtype (bf16/f16 GEMMs use the tensor cores on CUDA, where candle's cuBLAS calls accumulate in f32), and
//!   its result is converted to f32 at once. The statistics (m, l, the LSE, D) and the softmax's exp are f32;
//!   P and dS are rounded to the input dtype only as GEMM operands; the accumulators (o, dq, dk, dv, summed
//!   over chunks) are f32 and converted to the input dtype once at the end; the LSE stays f32. No
//!   subtraction rides in a GEMM (an earlier version computed `S - c` as `[Q, -c] [K, 1]ᵀ`, which rounds a
//!   large offset c to the GEMM's precision under bf16 or TF32): m, lse and D are subtracted in f32 after the
//!   product. For a bf16 input the scores carry the bf16 rounding of the product (`|S| · 2^-9` absolute
//!   before the exp) and P, dS a relative `2^-9` as operands: about 1e-2 of the largest element for scores of
//!   a few units (tests/generic_attention.rs measures it against the f32 CPU kernel), more where scores are
//!   large: a sink key's score of 100 is off by up to 0.2 in the exponent (measured up to 1e-1 of the
//!   largest element). candle's GEMMs return their result in the input dtype, so a product cannot be kept
//!   in f32 as FlashAttention keeps S. f32 and f64 inputs compute in their own dtype throughout, as the CPU
//!   kernel does.
//! - No host synchronisation: nothing computed is read back to the host in forward or backward (the masks
//!   are built on the host from the spec and uploaded). An earlier forward first tried a pass with a
//!   Cauchy–Schwarz bound of each row's scores instead of the running max and redid a whole block online when
//!   one row's bound was too loose, deciding on the host after reading back a flag per block (one device
//!   synchronisation per call, so per layer). One high-norm key (the "sink" keys real checkpoints have at the
//!   first position) loosens the bound of every row of every block, so the forward paid the bounded pass and
//!   then the online pass. Measured here on the CPU (AMD EPYC Zen 3, 2 cores, AVX2, one thread, N = 8192
//!   causal, 8 heads, head_dim 64, f32; docs/BENCHMARKS.md "Generic attention (CPU)"), that forward took
//!   2.30 – 2.69 CPU-s on standard normal inputs and 6.44 – 6.78 CPU-s with key 0 scaled by 20 or 30: 2.4 –
//!   2.9 times as long, every block redone. The online pass alone takes 2.67 – 2.73 CPU-s with the sink and
//!   2.86 – 3.44 without. The bounded pass is gone: one pass whatever the keys, and no read-back.
//! - Memory: O(N · head_dim) per call (the heads-major K and V, the outputs, the f32 accumulators) plus a
//!   few score chunks of `batch · heads · rows · keys` elements; never an N × N tensor.
//! - Tile sizes ([`TileSize::for_call`]): 256 query rows × 1024 keys on the CPU, 1024 × 4096 on a GPU, each
//!   halved (keys first while they exceed the rows, so both stay multiples of 64) until one score chunk, f32
//!   plus its input-dtype copy, fits a per-device budget: [`CHUNK_BUDGET_CPU`] (32 MiB: above glibc's largest
//!   mmap threshold every chunk comes back from the OS as fresh pages, page clearing and faults took about a
//!   fifth of the time at 512 × 4096) and [`CHUNK_BUDGET_GPU`] (256 MiB: the backward holds three or four
//!   chunk-sized tensors at once, about 1 GiB, small against a training step's activations on a 40 – 80 GB
//!   GPU; with 32 heads in f32 the tiles are still 1024 × 2048, GEMMs large enough to fill the GPU and to
//!   amortise a chunk's dozen kernel launches, where the fixed 1024 × 4096 took 512 MiB per chunk there).
//!   Each chunk costs about a dozen candle ops (a kernel launch each on a GPU; on the CPU a pass over the
//!   chunk, a fresh allocation and a round of candle's thread pool). On the CPU (2-core Zen 5, shared, one
//!   thread, N = 4096 causal, three interleaved runs; docs/BENCHMARKS.md "Generic attention (CPU)") forward +
//!   backward took 1.53 – 1.55 CPU-s at 256 × 1024, 1.61 – 1.92 at 512 × 1024 and 1.82 – 1.97 with 512 × 512
//!   tiles. candle-nn's fused `softmax_last_dim` was tried and lost (forward 1.85 vs 1.4 CPU-s, one thread,
//!   N = 8192): its pass costs about what max, sub and exp cost apart (the scalar `expf` is most of either),
//!   and the LSE then needs two more row reductions. The GPU sizes and budget are not measured yet.
//!
use std::collections::HashMap;
use std::ops::Range;

use autosp_core::ops::attention::{heads_major, seq_major, AttentionDims, AttentionSpec};
use autosp_core::Precision;
use candle_core::{DType, Device, Tensor, D};

use crate::running_sum::add_to;
use crate::Result;

/// The bytes one score chunk may take on the CPU (see the module doc).
pub const CHUNK_BUDGET_CPU: usize = 32 << 20;
/// The bytes one score chunk may take on a GPU (CUDA, Metal; see the module doc).
pub const CHUNK_BUDGET_GPU: usize = 256 << 20;

/// Keys per chunk, in query blocks, for [`TileSize::from_block`].
pub const KEY_BLOCKS: usize = 4;

/// The tiles of the generic kernel: query rows per block and keys per chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileSize {
    /// Query rows per block (the dK/dV cells are as many keys).
    pub rows: usize,
    /// Keys per chunk.
    pub keys: usize,
}

impl TileSize {
    /// `block` rows (at least 1) and `KEY_BLOCKS · block` keys: the tiles tests and benchmarks set.
    pub fn from_block(block: usize) -> Self {
        let rows = block.max(1);
        Self { rows, keys: KEY_BLOCKS * rows }
    }

    /// The default tiles of a call with `dims` in `dtype` on `device`: 256 rows × 1024 keys on the CPU, 1024 ×
    /// 4096 on a GPU, halved (keys first while there are more keys than rows; never below 64) until one score
    /// chunk, `batch · heads · rows · keys` elements in f32 (f64 for f64) plus their copy in `dtype` as a GEMM
    /// operand, fits [`CHUNK_BUDGET_CPU`] or [`CHUNK_BUDGET_GPU`].
    pub fn for_call(dims: &AttentionDims, dtype: DType, device: &Device) -> Self {
        let (mut t, budget) = if device.is_cpu() {
            (Self::from_block(256), CHUNK_BUDGET_CPU)
        } else {
            (Self::from_block(1024), CHUNK_BUDGET_GPU)
        };
        let compute = Precision::float(dtype).compute().size_in_bytes();
        let operand = if dtype.size_in_bytes() == compute { 0 } else { dtype.size_in_bytes() };
        let per_score = dims.batch * dims.heads * (compute + operand);
        while per_score * t.rows * t.keys > budget && t.keys.max(t.rows) > 64 {
            if t.keys > t.rows {
                t.keys /= 2;
            } else {
                t.rows /= 2;
            }
        }
        t
    }
}

/// Attention forward of checked inputs (`dims` from the door's checks) with `tiles`. `q: [batch, q_len,
/// heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`; returns `(o: [batch, q_len, heads,
/// head_dim]` in q's dtype, `lse: [batch, heads, q_len]` in f32 (f64 for f64 inputs)`)` on q's device; a row
/// that sees no key has `lse = -inf` and `o = 0`.
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    dims: AttentionDims,
    tiles: TileSize,
) -> Result<(Tensor, Tensor)> {
    let t = Tiles::new(dims, spec.clone(), tiles, q.dtype(), q.device());
    let (b, h, d) = (dims.batch, dims.heads, dims.head_dim);
    let seeing = t.rows_that_see_keys();
    if seeing.is_empty() {
        // No query, no key, or no query that sees a key: lse -inf and o 0 everywhere.
        let o = Tensor::zeros(q.shape(), q.dtype(), q.device())?;
        return Ok((o, t.full((b, h, dims.q_len), f64::NEG_INFINITY)?));
    }
    // K and V heads-major in the input dtype, `[b, kv_heads, nk, d]`: GEMM operands.
    let (kh, vh) = (heads_major(k, t.dt)?, heads_major(v, t.dt)?);
    let lowest = t.full((), -t.max_finite())?;
    let (mut o_blocks, mut lse_blocks) = (Vec::new(), Vec::new());
    // The rows before and after `seeing` see no key.
    let blind = |rows: usize, o_blocks: &mut Vec<Tensor>, lse_blocks: &mut Vec<Tensor>| -> Result<()> {
        if rows > 0 {
            o_blocks.push(Tensor::zeros((b, h, rows, d), t.cd, q.device())?);
            lse_blocks.push(t.full((b, h, rows), f64::NEG_INFINITY)?);
        }
        Ok(())
    };
    blind(seeing.start, &mut o_blocks, &mut lse_blocks)?;
    let mut masks = Masks::default();
    for (i0, rows) in t.query_blocks(seeing.clone()) {
        let qb = t.stacked(q, i0, rows, Some(t.scale))?;
        // The online softmax: (row max m, row sum l, accumulator P V), all f32 (f64), `[b, kv_heads, group ·
        // rows, 1 | 1 | d]`.
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        for ch in t.chunks(i0, rows) {
            let s = t.chunk_scores(&qb, &kh, i0, rows, ch, &mut masks)?;
            let chunk_max = s.max_keepdim(D::Minus1)?;
            let m_new = match &state {
                None => chunk_max.broadcast_maximum(&lowest)?,
                Some((m, _, _)) => m.maximum(&chunk_max)?,
            };
            let p = s.broadcast_sub(&m_new)?.exp()?;
            let pv = t.product(&p.to_dtype(t.dt)?, &vh.narrow(2, ch.j0, ch.len)?)?;
            let l_c = p.sum_keepdim(D::Minus1)?;
            state = Some(match state.take() {
                None => (m_new, l_c, pv),
                Some((m, l, acc)) => {
                    let alpha = (m - &m_new)?.exp()?;
                    (m_new, (l * &alpha + l_c)?, (acc.broadcast_mul(&alpha)? + pv)?)
                }
            });
        }
        let (m, l, acc) = state.expect("a row that sees a key has at least one chunk");
        o_blocks.push(acc.broadcast_div(&l)?.reshape((b, h, rows, d))?);
        lse_blocks.push((m + l.log()?)?.reshape((b, h, rows))?);
    }
    blind(dims.q_len - seeing.end, &mut o_blocks, &mut lse_blocks)?;
    let o = seq_major(&Tensor::cat(&o_blocks, 2)?, q.dtype())?;
    Ok((o, Tensor::cat(&lse_blocks, 2)?))
}

/// Attention backward of checked inputs with `tiles`, from the forward's saved `o: [batch, q_len, heads,
/// head_dim]` and `lse: [batch, heads, q_len]`. `d_o` (like o) is the gradient of o; `d_lse: [batch, heads,
/// q_len]`, when given, the gradient of lse (it adds `P ∘ d_lse` to dS). lse and d_lse may be f32 or f64.
/// Returns `(dq, dk, dv)` shaped and typed like `q, k, v`; the dk/dv of a kv head sum its query-head group.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
    dims: AttentionDims,
    tiles: TileSize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let t = Tiles::new(dims, spec.clone(), tiles, q.dtype(), q.device());
    let seeing = t.rows_that_see_keys();
    if seeing.is_empty() {
        return Ok((q.zeros_like()?, k.zeros_like()?, v.zeros_like()?));
    }
    let (b, h, hkv, d) = (dims.batch, dims.heads, dims.kv_heads, dims.head_dim);
    let cd = t.cd;
    let (kh, vh) = (heads_major(k, t.dt)?, heads_major(v, t.dt)?);
    // Per row `[b, h, nq]`, in f32 (f64): the LSE, with the largest finite value where it is -inf (a row that
    // saw no key elsewhere; its P is then exp(S - MAX) = 0, never NaN), and D - d_lse with D = rowsum(dO ∘ O).
    let lse = lse.to_dtype(cd)?;
    let lse = lse.eq(f64::NEG_INFINITY)?.where_cond(&t.full(lse.shape(), t.max_finite())?, &lse)?;
    let delta = (d_o.to_dtype(cd)? * o.to_dtype(cd)?)?.sum(D::Minus1)?.transpose(1, 2)?;
    let delta = match d_lse {
        Some(d_lse) => (delta - d_lse.to_dtype(cd)?)?,
        None => delta.contiguous()?,
    };
    // dK and dV in key cells of `rows` keys, summed over the query blocks in order.
    let (mut dk_cells, mut dv_cells) = (t.cells(), t.cells());
    let mut masks = Masks::default();
    let mut dq_blocks = Vec::new();
    let zero_rows = |rows: usize| Tensor::zeros((b, h, rows, d), cd, q.device());
    if seeing.start > 0 {
        dq_blocks.push(zero_rows(seeing.start)?);
    }
    for (i0, rows) in t.query_blocks(seeing.clone()) {
        let qb = t.stacked(q, i0, rows, Some(t.scale))?;
        let dob = t.stacked(d_o, i0, rows, None)?;
        let per_row =
            |x: &Tensor| -> Result<Tensor> { Ok(x.narrow(2, i0, rows)?.reshape((b, hkv, t.group() * rows, 1))?) };
        let (lse_b, delta_b) = (per_row(&lse)?, per_row(&delta)?);
        let mut dq = None;
        for c in t.chunks(i0, rows) {
            // P and dS in f32 (f64), rounded to the input dtype as GEMM operands.
            let p = t.chunk_scores(&qb, &kh, i0, rows, c, &mut masks)?.broadcast_sub(&lse_b)?.exp()?;
            let p_op = p.to_dtype(t.dt)?;
            t.add_to_cells(&mut dv_cells, c.j0, t.product(&p_op.t()?, &dob)?)?;
            let dp = t.product(&dob, &vh.narrow(2, c.j0, c.len)?.t()?)?;
            let ds = (p * dp.broadcast_sub(&delta_b)?)?.to_dtype(t.dt)?;
            add_to(&mut dq, t.product(&ds, &kh.narrow(2, c.j0, c.len)?)?)?;
            t.add_to_cells(&mut dk_cells, c.j0, t.product(&ds.t()?, &qb)?)?;
        }
        let dq = dq.expect("a row that sees a key has at least one chunk");
        dq_blocks.push((dq * t.scale)?.reshape((b, h, rows, d))?);
    }
    if seeing.end < dims.q_len {
        dq_blocks.push(zero_rows(dims.q_len - seeing.end)?);
    }
    let key_side = |cells: Vec<Option<Tensor>>, dtype: DType| -> Result<Tensor> {
        let cells = cells
            .into_iter()
            .enumerate()
            .map(|(c, x)| match x {
                Some(x) => Ok(x),
                None => Ok(Tensor::zeros((b, hkv, t.cell(c).len(), d), cd, q.device())?),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(seq_major(&Tensor::cat(&cells, 2)?, dtype)?)
    };
    let dq = seq_major(&Tensor::cat(&dq_blocks, 2)?, q.dtype())?;
    Ok((dq, key_side(dk_cells, k.dtype())?, key_side(dv_cells, v.dtype())?))
}

/// A run of keys `j0..j0 + len` that a query block computes at once; `masked` when some row of the block does
/// not see every key of it.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Chunk {
    j0: usize,
    len: usize,
    masked: bool,
}

/// The blocking of one call: dimensions, mask, tiles, input and compute dtypes, device.
struct Tiles {
    dims: AttentionDims,
    spec: AttentionSpec,
    block: usize,
    key_chunk: usize,
    /// The input dtype: the GEMMs' operands.
    dt: DType,
    /// The compute dtype (f32; f64 for f64 inputs): scores, statistics, accumulators.
    cd: DType,
    device: Device,
    scale: f64,
}

impl Tiles {
    fn new(dims: AttentionDims, spec: AttentionSpec, tiles: TileSize, dt: DType, device: &Device) -> Self {
        let scale = spec.scale_for(dims.head_dim);
        let (block, key_chunk) = (tiles.rows.max(1), tiles.keys.max(1));
        let cd = Precision::float(dt).compute();
        Self { dims, spec, block, key_chunk, dt, cd, device: device.clone(), scale }
    }

    fn group(&self) -> usize {
        self.dims.group()
    }

    /// The keys query row `i` sees ([`AttentionSpec::key_range`]); both ends never decrease with `i`.
    fn visible_keys(&self, i: usize) -> Range<usize> {
        self.spec.key_range(i, self.dims.k_len)
    }

    /// The query rows that see at least one key: one run (the rows before see no key yet, the rows after
    /// are past every key's window), empty when none does.
    fn rows_that_see_keys(&self) -> Range<usize> {
        let nq = self.dims.q_len;
        let first = (0..nq).find(|&i| !self.visible_keys(i).is_empty());
        match first {
            None => 0..0,
            Some(first) => first..(first..nq).find(|&i| self.visible_keys(i).is_empty()).unwrap_or(nq),
        }
    }

    /// `(first row, rows)` of each query block of `rows`.
    fn query_blocks(&self, rows: Range<usize>) -> impl Iterator<Item = (usize, usize)> + '_ {
        let end = rows.end;
        rows.step_by(self.block).map(move |i0| (i0, self.block.min(end - i0)))
    }

    /// The key chunks of query block `i0..i0 + rows` (every row of which sees a key): the keys every row
    /// sees in chunks of at most `key_chunk` without a mask, the keys only some rows see (the causal
    /// diagonal, the window's edges) in masked chunks; the keys no row sees are never computed.
    fn chunks(&self, i0: usize, rows: usize) -> Vec<Chunk> {
        let (first, last) = (self.visible_keys(i0), self.visible_keys(i0 + rows - 1));
        // Every row sees first.end.. up to last.start.. : the keys last.start..first.end (when not empty).
        let all = last.start..first.end;
        let mut cuts = vec![first.start, last.end];
        if !all.is_empty() {
            cuts.extend([all.start, all.end]);
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut chunks = Vec::new();
        for w in cuts.windows(2) {
            let masked = all.is_empty() || w[0] < all.start || w[1] > all.end;
            for j0 in (w[0]..w[1]).step_by(self.key_chunk) {
                chunks.push(Chunk { j0, len: self.key_chunk.min(w[1] - j0), masked });
            }
        }
        chunks
    }

    /// The scores `x Kᵀ` for the keys of chunk `ch`, `[b, kv_heads, group · rows, ch.len]` in the compute
    /// dtype (`x: [b, kv_heads, group · rows, d]`, the stacked, scaled query rows `i0..i0 + rows`; `kh: [b,
    /// kv_heads, nk, d]`; both in the input dtype), with the entries the spec hides pushed to the lowest finite
    /// value when the chunk is masked.
    fn chunk_scores(
        &self,
        x: &Tensor,
        kh: &Tensor,
        i0: usize,
        rows: usize,
        ch: Chunk,
        masks: &mut Masks,
    ) -> Result<Tensor> {
        let s = self.product(x, &kh.narrow(2, ch.j0, ch.len)?.t()?)?;
        if ch.masked {
            masks.apply(self, s, i0, rows, ch.j0, ch.len)
        } else {
            Ok(s)
        }
    }

    /// The tile product `a b` of two operands in the input dtype (a bf16/f16 GEMM for bf16/f16 inputs),
    /// converted to the compute dtype.
    fn product(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Ok(a.matmul(b)?.to_dtype(self.cd)?)
    }

    /// Empty accumulators, one per key cell of `block` keys.
    fn cells(&self) -> Vec<Option<Tensor>> {
        vec![None; self.dims.k_len.div_ceil(self.block)]
    }

    /// The keys of cell `c`.
    fn cell(&self, c: usize) -> Range<usize> {
        c * self.block..(c * self.block + self.block).min(self.dims.k_len)
    }

    /// Adds `x: [b, kv_heads, len, d]`, the rows of keys `j0..j0 + len`, to the cells they fall in (a cell
    /// the keys cover in part gets them padded with zeros).
    fn add_to_cells(&self, cells: &mut [Option<Tensor>], j0: usize, x: Tensor) -> Result<()> {
        let len = x.dim(2)?;
        let first = j0 / self.block;
        for (c, acc) in cells.iter_mut().enumerate().take((j0 + len).div_ceil(self.block)).skip(first) {
            let cell = self.cell(c);
            let (a, e) = (cell.start.max(j0), cell.end.min(j0 + len));
            let part = x.narrow(2, a - j0, e - a)?.pad_with_zeros(2, a - cell.start, cell.end - e)?;
            add_to(acc, part)?;
        }
        Ok(())
    }

    /// A tensor of `shape` filled with `value` in the compute dtype on the call's device (made in f32 unless
    /// the compute dtype is f64: Metal has no f64).
    fn full(&self, shape: impl Into<candle_core::Shape>, value: f64) -> Result<Tensor> {
        Ok(match self.cd {
            DType::F64 => Tensor::full(value, shape, &self.device)?,
            _ => Tensor::full(value as f32, shape, &self.device)?,
        })
    }

    /// The largest finite value of the compute dtype.
    fn max_finite(&self) -> f64 {
        if self.cd == DType::F64 {
            f64::MAX
        } else {
            f32::MAX as f64
        }
    }

    /// Rows `i0..i0 + rows` of `x: [b, n, heads, d]` (in the input dtype) stacked per kv head, `[b, kv_heads,
    /// group · rows, d]` (row `gi · rows + r` is query head `kv_head · group + gi`, row `i0 + r`), in the input
    /// dtype; times `mul` when given (in the compute dtype, then rounded to the input dtype once).
    fn stacked(&self, x: &Tensor, i0: usize, rows: usize, mul: Option<f64>) -> Result<Tensor> {
        let x = x.narrow(1, i0, rows)?.transpose(1, 2)?;
        let x = match mul {
            Some(mul) => x.to_dtype(self.cd)?.affine(mul, 0.0)?.to_dtype(self.dt)?,
            None => x.contiguous()?,
        };
        let AttentionDims { batch, kv_heads, head_dim, .. } = self.dims;
        Ok(x.reshape((batch, kv_heads, self.group() * rows, head_dim))?)
    }
}

/// The masks of one call: a bias `[rows, cols]` (0 where the key is visible, the lowest finite value where
/// it is not) per pattern of the rows' visible keys in chunk coordinates, built on the device the first time a
/// chunk needs it (a causal diagonal or a window edge repeats its pattern from block to block).
#[derive(Default)]
struct Masks {
    bias: HashMap<(usize, Vec<(u32, u32)>), Tensor>,
}

impl Masks {
    /// The scores `s: [b, kv_heads, group · rows, cols]` of query rows from `i0` against keys from `j0`,
    /// with the entries the spec hides pushed to the lowest finite value: exp of it is 0 like exp(-inf),
    /// and a row that sees no key of the chunk stays finite (its softmax is then uniform, its lse about the
    /// lowest value: weight 0 in the merge), where -inf would give NaN.
    fn apply(&mut self, t: &Tiles, s: Tensor, i0: usize, rows: usize, j0: usize, cols: usize) -> Result<Tensor> {
        // Row i0 + r sees keys j0 + lo .. j0 + hi of the chunk (the spec's interval, clipped to the chunk).
        let clip = |x: usize| (x.saturating_sub(j0).min(cols)) as u32;
        let pattern: Vec<(u32, u32)> = (i0..i0 + rows)
            .map(|i| {
                let r = t.visible_keys(i);
                (clip(r.start), clip(r.end))
            })
            .collect();
        let bias = match self.bias.entry((cols, pattern)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let b = interval_bias(t, &e.key().1, cols)?;
                e.insert(b)
            }
        };
        let (b, hkv, group_rows, _) = s.dims4()?;
        Ok(s.reshape((b, hkv, group_rows / rows, rows, cols))?
            .broadcast_add(bias)?
            .reshape((b, hkv, group_rows, cols))?)
    }
}

/// `[rows, cols]`: 0 where `lo_r <= c < hi_r` (row r sees key c), the lowest finite value elsewhere, in the
/// compute dtype. Positions are exact in f32 (chunks are far below 2^24 keys).
fn interval_bias(t: &Tiles, pattern: &[(u32, u32)], cols: usize) -> Result<Tensor> {
    let rows = pattern.len();
    let lo: Vec<f32> = pattern.iter().map(|p| p.0 as f32).collect();
    let hi: Vec<f32> = pattern.iter().map(|p| p.1 as f32).collect();
    let lo = Tensor::from_vec(lo, (rows, 1), &t.device)?;
    let hi = Tensor::from_vec(hi, (rows, 1), &t.device)?;
    let c = Tensor::arange(0f32, cols as f32, &t.device)?.reshape((1, cols))?;
    let lowest = t.full((rows, cols), -t.max_finite())?;
    let zeros = t.full((rows, cols), 0.0)?;
    let below = c.broadcast_lt(&lo)?.where_cond(&lowest, &zeros)?;
    Ok(c.broadcast_ge(&hi)?.where_cond(&lowest, &below)?)
}
