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
//! - Query blocks of `block` rows ([`block_for`] the device by default); each computes the keys its rows see
//!   ([`AttentionSpec::key_range`]: the causal mask and sliding window `max_distance` at the absolute positions
//!   `q_offset + i`, `k_offset + j`), in chunks of at most [`KEY_BLOCKS`] · `block` keys: the keys every row
//!   of the block sees without a mask, the keys only some rows see (the causal diagonal, the window's two
//!   edges) in chunks with a mask bias added (built from the rows' key intervals). Keys no row of the block sees are never computed, and the rows
//!   that see no key at all (a prefix before the first key, a suffix past the last key's window) are not
//!   computed either: lse = -inf, o = 0, and zero gradients.
//! - Repeated K/V are never materialised: a query block of the `group = heads / kv_heads` query heads of
//!   each kv head is stacked into `[batch, kv_heads, group · rows, head_dim]`, so one batched matmul per
//!   chunk covers every batch, kv head and group member against K, V in `[batch, kv_heads, k_len, head_dim]`
//!   (copied heads-major once).
//! - Forward: each row's scores are bounded first, `c_i = |q_i| · max_j |k_j| >= q_i · k_j` (Cauchy–Schwarz),
//!   and the chunks of a block give `P = exp([Q, -c] [K, 1]ᵀ)` in one product and `P [V, 1]` (P V and the
//!   row sums l) in another: no row max, no subtraction pass, no rescaling; `lse = c + ln l`. When a bound is
//!   so far above its row's scores that l falls below `k_len · 2^-100` (f32; the row's terms would near the
//!   subnormals), the block is done again with the online softmax of ALGORITHMS.md (running max m,
//!   accumulator rescaled by exp(m - m')); the blocks' flags are read back together, one device
//!   synchronisation per call. There the mask bias is the lowest finite value, not -inf: exp of it is 0 all
//!   the same, and a row that sees no key of one chunk stays finite (its garbage gets weight
//!   exp(lowest - m) = 0 once a later chunk shows it a key, and every computed row sees a key in some
//!   chunk). The bound saved about a sixth of the forward's time on the CPU (docs/BENCHMARKS.md).
//! - Backward (FlashAttention-2): per chunk `P = exp(S - lse)` recomputed from the saved LSE (a row with
//!   `lse = -inf` uses the largest finite value, so its P is 0 and its gradients are 0, never NaN),
//!   `dV += Pᵀ dO`, `dS = P ∘ (dP - D + d_lse)` with `dP = dO Vᵀ` and `D = rowsum(dO ∘ O)`, `dQ += dS K`,
//!   `dK += dSᵀ Q` (the stacked rows sum the GQA group into its kv head); dK and dV are summed in key cells
//!   of `block` keys, in query-block order. The per-row subtractions ride in the chunk products:
//!   `[Q, -lse] [K, 1]ᵀ = S - lse` and `[dO, -(D - d_lse)] [V, 1]ᵀ = dP - D + d_lse`. Q is scaled once per
//!   block, so `dK` needs no further scaling and `dQ` is scaled once.
//! - Memory: O(N · head_dim) per call (the heads-major K and V, the outputs, one accumulator per block) plus
//!   a few `[batch, heads, block, KEY_BLOCKS · block]` chunks; never an N × N tensor.
//! - Precision: f32 (f64 for f64 inputs); bf16/f16 blocks are converted to f32 as they are read and the
//!   results converted back to the input dtype; the LSE stays f32 (f64).
//! - Block size: 256 query rows × 1024 keys per chunk on the CPU, 1024 × 4096 on a GPU. Each chunk costs
//!   about a dozen candle ops (a kernel launch each on a GPU; on the CPU a pass over the chunk, a fresh
//!   allocation and a round of candle's thread pool). On the CPU (2-core Zen 5, shared, one thread, N = 4096
//!   causal, three interleaved runs; docs/BENCHMARKS.md "Generic attention (CPU)") forward + backward took
//!   1.53 – 1.55 CPU-s at 256 × 1024, 1.61 – 1.92 at 512 × 1024 and 1.82 – 1.97 with the 512 × 512 tiles
//!   before; at N = 8192 the work was the same as before (4.17 vs 4.13 CPU-s). Chunks above 32 MiB (glibc's
//!   largest mmap threshold) come back from the OS as fresh pages each time: at 512 × 4096 page clearing
//!   and faults took about a fifth of the time. candle-nn's fused `softmax_last_dim` was tried and lost
//!   (forward 1.85 vs 1.4 CPU-s, one thread, N = 8192): its pass costs about what max, sub and exp cost
//!   apart (the scalar `expf` is most of either), and the LSE then needs two more row reductions. The GPU
//!   sizes are not measured yet.
//!
use std::collections::HashMap;
use std::ops::Range;

use autosp_core::ops::attention::{heads_major, seq_major, AttentionDims, AttentionSpec};
use autosp_core::Precision;
use candle_core::{DType, Device, Tensor, D};

use crate::running_sum::add_to;
use crate::Result;

/// Query rows per block on the CPU (see the module doc for the measurements behind it).
pub const BLOCK_CPU: usize = 256;
/// Query rows per block on a GPU (CUDA, Metal): larger blocks, fewer kernel launches.
pub const BLOCK_GPU: usize = 1024;

/// The query block the generic kernel uses on `device`.
pub fn block_for(device: &Device) -> usize {
    if device.is_cpu() {
        BLOCK_CPU
    } else {
        BLOCK_GPU
    }
}

/// Keys per chunk, in query blocks: a query block computes its keys in chunks of `KEY_BLOCKS · block`
/// (see the module doc for the measurements behind it).
pub const KEY_BLOCKS: usize = 4;

/// Attention forward of checked inputs (`dims` from the door's checks) with `block` query rows per block (at
/// least 1; the key chunks are a multiple of it). `q: [batch, q_len, heads, head_dim]`, `k, v: [batch,
/// k_len, kv_heads, head_dim]`; returns `(o: [batch, q_len, heads, head_dim]` in q's dtype, `lse: [batch,
/// heads, q_len]` in f32 (f64 for f64 inputs)`)` on q's device; a row that sees no key has `lse = -inf` and
/// `o = 0`.
pub(crate) fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    dims: AttentionDims,
    block: usize,
) -> Result<(Tensor, Tensor)> {
    let cd = Precision::float(q.dtype()).compute();
    let t = Tiles::new(dims, *spec, block, cd, q.device());
    let (b, h, d) = (dims.batch, dims.heads, dims.head_dim);
    let seeing = t.rows_that_see_keys();
    if seeing.is_empty() {
        // No query, no key, or no query that sees a key: lse -inf and o 0 everywhere.
        let o = Tensor::zeros(q.shape(), q.dtype(), q.device())?;
        return Ok((o, t.full((b, h, dims.q_len), f64::NEG_INFINITY)?));
    }
    let (kh, vh) = (heads_major(k, cd)?, heads_major(v, cd)?);
    // The largest key norm of each kv head, `[b, kv_heads, 1, 1]`, for the bound of the bounded pass.
    let key_norm = kh.sqr()?.sum_keepdim(3)?.sqrt()?.max_keepdim(2)?;
    // K and V with a column of ones, `[b, kv_heads, nk, d + 1]`: against a query block with a column -c the
    // chunk product gives S - c, and P [V, 1] gives P V and the row sums of P in one product.
    let ones = t.full((b, dims.kv_heads, dims.k_len, 1), 1.0)?;
    let (kh1, vh1) = (Tensor::cat(&[&kh, &ones], 3)?, Tensor::cat(&[&vh, &ones], 3)?);
    drop((kh, vh, ones));
    let mut masks = Masks::default();
    let (mut o_blocks, mut lse_blocks) = (Vec::new(), Vec::new());
    // The rows before and after `seeing` see no key.
    let blind = |rows: usize, o_blocks: &mut Vec<Tensor>, lse_blocks: &mut Vec<Tensor>| -> Result<()> {
        if rows > 0 {
            o_blocks.push(Tensor::zeros((b, h, rows, d), cd, q.device())?);
            lse_blocks.push(t.full((b, h, rows), f64::NEG_INFINITY)?);
        }
        Ok(())
    };
    blind(seeing.start, &mut o_blocks, &mut lse_blocks)?;
    // Every block takes the bounded pass; its flags are read back once, after all of them (one device
    // synchronisation per call), and the blocks whose bound was too loose are done again by the online pass.
    let blocks: Vec<(usize, usize)> = t.query_blocks(seeing.clone()).collect();
    let block = |i0: usize, rows: usize| -> Result<Block> {
        Ok(Block { qb: t.stacked(q, i0, rows, Some(t.scale))?, i0, rows, kh1: &kh1, vh1: &vh1 })
    };
    let mut done = Vec::with_capacity(blocks.len());
    let mut flags = Vec::with_capacity(blocks.len());
    for &(i0, rows) in &blocks {
        let (shift, acc, ok) = block(i0, rows)?.bounded(&t, &key_norm, &mut masks)?;
        done.push((shift, acc));
        flags.push(ok);
    }
    let flags = Tensor::cat(&flags, 0)?.to_vec1::<u8>()?;
    for (((shift, acc), &(i0, rows)), ok) in done.into_iter().zip(&blocks).zip(flags) {
        // (c, [P V, l]) with P = exp(S - c): o = P V / l and lse = c + ln l.
        let (shift, acc) = if ok == 1 { (shift, acc) } else { block(i0, rows)?.online(&t, &mut masks)? };
        let l = acc.narrow(3, d, 1)?;
        o_blocks.push(acc.narrow(3, 0, d)?.broadcast_div(&l)?.reshape((b, h, rows, d))?);
        lse_blocks.push((shift + l.log()?)?.reshape((b, h, rows))?);
    }
    blind(dims.q_len - seeing.end, &mut o_blocks, &mut lse_blocks)?;
    let o = seq_major(&Tensor::cat(&o_blocks, 2)?, q.dtype())?;
    Ok((o, Tensor::cat(&lse_blocks, 2)?))
}

/// One query block of the forward against the keys it sees: the stacked, scaled rows `qb: [b, kv_heads,
/// group · rows, d]` of query rows `i0..i0 + rows`, and K, V with their column of ones.
struct Block<'a> {
    qb: Tensor,
    i0: usize,
    rows: usize,
    kh1: &'a Tensor,
    vh1: &'a Tensor,
}

impl Block<'_> {
    /// `P [V, 1]` summed over the block's chunks, with `P = exp([Q, -c] [K, 1]ᵀ + mask)` for the per-row
    /// column `c: [b, kv_heads, group · rows, 1]`.
    fn accumulate(&self, t: &Tiles, c: &Tensor, masks: &mut Masks) -> Result<Tensor> {
        let qc = Tensor::cat(&[&self.qb, &c.neg()?], 3)?;
        let mut acc = None;
        for ch in t.chunks(self.i0, self.rows) {
            let s = t.chunk_scores(&qc, self.kh1, self.i0, self.rows, ch, masks)?;
            add_to(&mut acc, s.exp()?.matmul(&self.vh1.narrow(2, ch.j0, ch.len)?)?)?;
        }
        Ok(acc.expect("a row that sees a key has at least one chunk"))
    }

    /// The bounded pass: one product per chunk and no running max. Each row's `c` is an upper bound of its
    /// scores, `|q_i| · max_j |k_j| >= q_i · k_j` (Cauchy–Schwarz; `key_norm: [b, kv_heads, 1, 1]` is the
    /// largest key norm of each kv head), so exp never overflows. Returns `(c, [P V, l], ok)`; `ok: [1]` (u8,
    /// on the device) is 0 when a row's sum `l = sum_j exp(s_ij - c_i)` is below [`Tiles::min_bounded_sum`]
    /// (or not a number): the bound was so far above the row's largest score that its terms would lose
    /// precision near the subnormals, and the block must take the online pass. Otherwise the largest term is
    /// at least `l / k_len`, a normal number, and the result has the online pass's precision.
    fn bounded(&self, t: &Tiles, key_norm: &Tensor, masks: &mut Masks) -> Result<(Tensor, Tensor, Tensor)> {
        let bound = self.qb.sqr()?.sum_keepdim(3)?.sqrt()?.broadcast_mul(key_norm)?;
        let acc = self.accumulate(t, &bound, masks)?;
        let l = acc.narrow(3, t.dims.head_dim, 1)?;
        // `ge` is false for NaN, so a NaN sum also falls back.
        let ok = l.ge(t.min_bounded_sum())?.flatten_all()?.min_keepdim(0)?;
        Ok((bound, acc, ok))
    }

    /// The online pass (ALGORITHMS.md): per chunk the row max m, the accumulator rescaled by exp(m - m').
    /// The mask bias is the lowest finite value, not -inf: exp of it is 0 all the same, and a row that sees
    /// no key of one chunk stays finite (its garbage gets weight exp(lowest - m) = 0 once a later chunk
    /// shows it a key, and every computed row sees a key in some chunk).
    fn online(&self, t: &Tiles, masks: &mut Masks) -> Result<(Tensor, Tensor)> {
        // [Q, 0] [K, 1]ᵀ = S.
        let qb0 = Tensor::cat(&[&self.qb, &self.qb.narrow(3, 0, 1)?.zeros_like()?], 3)?;
        let lowest = t.full((), -t.max_finite())?;
        let mut state: Option<(Tensor, Tensor)> = None;
        for ch in t.chunks(self.i0, self.rows) {
            let s = t.chunk_scores(&qb0, self.kh1, self.i0, self.rows, ch, masks)?;
            let chunk_max = s.max_keepdim(D::Minus1)?;
            let vc = self.vh1.narrow(2, ch.j0, ch.len)?;
            state = Some(match state.take() {
                None => {
                    let m = chunk_max.broadcast_maximum(&lowest)?;
                    let acc = s.broadcast_sub(&m)?.exp()?.matmul(&vc)?;
                    (m, acc)
                }
                Some((m, acc)) => {
                    let m_new = m.maximum(&chunk_max)?;
                    let alpha = (m - &m_new)?.exp()?;
                    let acc = (acc.broadcast_mul(&alpha)? + s.broadcast_sub(&m_new)?.exp()?.matmul(&vc)?)?;
                    (m_new, acc)
                }
            });
        }
        Ok(state.expect("a row that sees a key has at least one chunk"))
    }
}

/// Attention backward of checked inputs with `block` query rows per block, from the forward's saved
/// `o: [batch, q_len, heads, head_dim]` and `lse: [batch, heads, q_len]`. `d_o` (like o) is the gradient of
/// o; `d_lse: [batch, heads, q_len]`, when given, the gradient of lse (it adds `P ∘ d_lse` to dS). lse and
/// d_lse may be f32 or f64. Returns `(dq, dk, dv)` shaped and typed like `q, k, v`; the dk/dv of a kv head
/// sum its query-head group.
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
    block: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let cd = Precision::float(q.dtype()).compute();
    let t = Tiles::new(dims, *spec, block, cd, q.device());
    let seeing = t.rows_that_see_keys();
    if seeing.is_empty() {
        return Ok((q.zeros_like()?, k.zeros_like()?, v.zeros_like()?));
    }
    let (b, h, hkv, d) = (dims.batch, dims.heads, dims.kv_heads, dims.head_dim);
    let (kh, vh) = (heads_major(k, cd)?, heads_major(v, cd)?);
    // K and V with a column of ones, `[b, kv_heads, nk, d + 1]`: against Q with a column -lse (dO with a
    // column -D) the tile product gives S - lse (dP - D) directly, one tile-sized pass less each.
    let ones = t.full((b, hkv, dims.k_len, 1), 1.0)?;
    let (kh1, vh1) = (Tensor::cat(&[&kh, &ones], 3)?, Tensor::cat(&[&vh, &ones], 3)?);
    drop(ones);
    // Per row `[b, h, nq]`: the LSE, with the largest finite value where it is -inf (a row that saw no key
    // elsewhere; its P is then exp(S - MAX) = 0, never NaN), and D - d_lse with D = rowsum(dO ∘ O).
    let lse = lse.to_dtype(cd)?;
    let lse = lse.eq(f64::NEG_INFINITY)?.where_cond(&t.full(lse.shape(), t.max_finite())?, &lse)?;
    let delta = (d_o.to_dtype(cd)? * o.to_dtype(cd)?)?.sum(D::Minus1)?.transpose(1, 2)?;
    let delta = match d_lse {
        Some(d_lse) => (delta - d_lse.to_dtype(cd)?)?,
        None => delta.contiguous()?,
    };
    // dK and dV in key cells of `block` keys, summed over the query blocks in order.
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
        let minus_per_row = |x: &Tensor| -> Result<Tensor> {
            Ok(x.narrow(2, i0, rows)?.neg()?.reshape((b, hkv, t.group() * rows, 1))?)
        };
        let qb1 = Tensor::cat(&[&qb, &minus_per_row(&lse)?], 3)?;
        let dob1 = Tensor::cat(&[&dob, &minus_per_row(&delta)?], 3)?;
        let mut dq = None;
        for c in t.chunks(i0, rows) {
            let p = t.chunk_scores(&qb1, &kh1, i0, rows, c, &mut masks)?.exp()?;
            t.add_to_cells(&mut dv_cells, c.j0, p.t()?.matmul(&dob)?)?;
            let ds = (p * dob1.matmul(&vh1.narrow(2, c.j0, c.len)?.t()?)?)?;
            add_to(&mut dq, ds.matmul(&kh.narrow(2, c.j0, c.len)?)?)?;
            t.add_to_cells(&mut dk_cells, c.j0, ds.t()?.matmul(&qb)?)?;
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

/// The blocking of one call: dimensions, mask, block size, compute dtype and device.
struct Tiles {
    dims: AttentionDims,
    spec: AttentionSpec,
    block: usize,
    key_chunk: usize,
    cd: DType,
    device: Device,
    scale: f64,
}

impl Tiles {
    fn new(dims: AttentionDims, spec: AttentionSpec, block: usize, cd: DType, device: &Device) -> Self {
        let scale = spec.scale_for(dims.head_dim);
        let block = block.max(1);
        let key_chunk = block * KEY_BLOCKS;
        Self { dims, spec, block, key_chunk, cd, device: device.clone(), scale }
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

    /// `x [K, 1]ᵀ` for the keys of chunk `ch` (`x: [b, kv_heads, group · rows, d + 1]`, the stacked query
    /// rows `i0..i0 + rows` with a per-row column; `kh1: [b, kv_heads, nk, d + 1]`, K with a column of ones),
    /// with the entries the spec hides pushed to the lowest finite value when the chunk is masked.
    fn chunk_scores(
        &self,
        x: &Tensor,
        kh1: &Tensor,
        i0: usize,
        rows: usize,
        ch: Chunk,
        masks: &mut Masks,
    ) -> Result<Tensor> {
        let s = x.matmul(&kh1.narrow(2, ch.j0, ch.len)?.t()?)?;
        if ch.masked {
            masks.apply(self, s, i0, rows, ch.j0, ch.len)
        } else {
            Ok(s)
        }
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

    /// The smallest row sum the bounded forward pass accepts: `k_len · 2^-100` in f32 (`k_len · 2^-1000`
    /// in f64), so that the row's largest term, at least `l / k_len`, is 2^-100 or more, far above the
    /// subnormals (2^-126; 2^-1022 in f64).
    fn min_bounded_sum(&self) -> f64 {
        let floor = if self.cd == DType::F64 { 2f64.powi(-1000) } else { 2f64.powi(-100) };
        self.dims.k_len as f64 * floor
    }

    /// The largest finite value of the compute dtype.
    fn max_finite(&self) -> f64 {
        if self.cd == DType::F64 {
            f64::MAX
        } else {
            f32::MAX as f64
        }
    }

    /// Rows `i0..i0 + rows` of `x: [b, n, heads, d]` stacked per kv head, `[b, kv_heads, group · rows, d]`
    /// (row `gi · rows + r` is query head `kv_head · group + gi`, row `i0 + r`), in the compute dtype, times
    /// `mul` when given.
    fn stacked(&self, x: &Tensor, i0: usize, rows: usize, mul: Option<f64>) -> Result<Tensor> {
        let x = x.narrow(1, i0, rows)?.transpose(1, 2)?.to_dtype(self.cd)?;
        let x = match mul {
            Some(mul) => x.affine(mul, 0.0)?,
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
