//! Device-generic flash attention: the contract of the CPU kernel in [`crate::flash`] (forward with the LSE,
//! backward from the saved output and LSE, GQA/MQA, the masks, scale and position offsets of
//! [`AttentionSpec`]) written only with candle tensor ops, so it runs on CPU, CUDA and Metal alike.
//! [`crate::flash::flash_attention_forward`] / `_backward` call it for every tensor that is not served by the
//! fast CPU kernel.
//!
//! Layout: `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`, `o` like q,
//! `lse: [batch, heads, q_len]` (natural log; f32, f64 for f64 inputs). Query head `h` reads kv head
//! `h / (heads / kv_heads)`.
//!
//! How it works:
//! - Tiles of `block` query rows × `block` keys ([`block_for`] the device by default). Repeated K/V are never materialised:
//!   a query block of the `group = heads / kv_heads` query heads of each kv head is stacked into
//!   `[batch, kv_heads, group · rows, head_dim]`, so one batched matmul per tile covers every batch, kv head
//!   and group member against K, V in `[batch, kv_heads, k_len, head_dim]` (copied heads-major once).
//! - Forward: key blocks in order with the online softmax of ALGORITHMS.md (running max m, sum l, output
//!   accumulator). m starts at the dtype's lowest finite value rather than -inf, so `exp(S - m)` never sees
//!   `-inf - (-inf)`: a hidden score gives exactly 0, and a row that sees no key keeps `l = 0`, which gives
//!   `lse = m + ln 0 = -inf` and `o = 0 / max(l, tiny) = 0`.
//! - Backward (FlashAttention-2): per tile `P = exp(S - lse)` recomputed from the saved LSE (a row with
//!   `lse = -inf` uses the largest finite value, so its P is 0 and its gradients are 0, never NaN),
//!   `dV += Pᵀ dO`, `dS = P ∘ (dP - D + d_lse)` with `dP = dO Vᵀ` and `D = rowsum(dO ∘ O)`, `dQ += dS K`,
//!   `dK += dSᵀ Q` (the stacked rows sum the GQA group into its kv head). The per-row subtractions ride in the
//!   tile products: `[Q, -lse] [K, 1]ᵀ = S - lse` and `[dO, -(D - d_lse)] [V, 1]ᵀ = dP - D + d_lse`. Q is
//!   scaled once per block, so `dK` needs no further scaling and `dQ` is scaled once.
//! - Masks: under a causal mask the key blocks after a query block's last visible key are never computed;
//!   a tile whose every row sees every key needs no mask; the others add a 0 / -inf bias `[rows, cols]`,
//!   built once per (rows, cols, diagonal shift) from the spec's positions (`q_offset`, `k_offset`).
//! - Memory: O(N · head_dim) per call (the heads-major K and V, the outputs, one accumulator per block) plus
//!   a few `[batch, heads, block, block]` tiles; never an N × N tensor.
//! - Precision: f32 (f64 for f64 inputs); bf16/f16 blocks are converted to f32 as they are read and the
//!   results converted back to the input dtype; the LSE stays f32 (f64).
//! - Block size: 512 on the CPU, 1024 on a GPU. Each tile costs about a dozen candle ops (each a kernel launch
//!   on a GPU; on the CPU a pass over the tile, a fresh allocation and a round of candle's thread pool):
//!   large tiles amortise the launches and keep the matmuls large. Measured on the CPU (2-core Zen 5, shared;
//!   N = 8192, 8 heads, head_dim 64, causal, f32, forward + backward, docs/BENCHMARKS.md "Generic attention
//!   (CPU)"): 3.9 s at 512, 5.6 s at 256, 7.1 s at 1024 with both threads; with one thread 256 was a little
//!   faster than 512 (4.6 s vs 5.2 s), the thread pool's synchronisation per op being what larger tiles save.
//!   The GPU size is not measured yet.
//!
use std::collections::HashMap;

use autosp_core::ops::attention::{AttentionDims, AttentionSpec};
use candle_core::{DType, Device, Tensor, D};

use crate::flash::{check, check_backward, compute_dtype};
use crate::running_sum::add_to;
use crate::Result;

/// Query rows and keys per tile on the CPU (see the module doc for the measurements behind it).
pub const BLOCK_CPU: usize = 512;
/// Query rows and keys per tile on a GPU (CUDA, Metal): larger tiles, fewer kernel launches.
pub const BLOCK_GPU: usize = 1024;

/// The tile size [`attention_forward`] / [`attention_backward`] use on `device`.
pub fn block_for(device: &Device) -> usize {
    if device.is_cpu() {
        BLOCK_CPU
    } else {
        BLOCK_GPU
    }
}

const FWD: &str = "generic::attention_forward";
const BWD: &str = "generic::attention_backward";

/// Attention forward on any device. `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads,
/// head_dim]` (one dtype: f32, f64, bf16 or f16; one device). Returns `(o: [batch, q_len, heads, head_dim]`
/// in q's dtype, `lse: [batch, heads, q_len]` in f32 (f64 for f64 inputs)`)` on q's device; a row that sees
/// no key has `lse = -inf` and `o = 0`. The contract of [`crate::flash::flash_attention_forward`].
pub fn attention_forward(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<(Tensor, Tensor)> {
    attention_forward_with_block(q, k, v, spec, block_for(q.device()))
}

/// [`attention_forward`] with `block` query rows and keys per tile (at least 1), so that tests run many
/// tiles, diagonal tiles and skipped tiles on small shapes. Not part of the stable API.
#[doc(hidden)]
pub fn attention_forward_with_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    block: usize,
) -> Result<(Tensor, Tensor)> {
    let dims = check(FWD, q, k, v, spec, usize::MAX)?;
    let cd = compute_dtype(FWD, q.dtype())?;
    let t = Tiles::new(dims, *spec, block, cd, q.device());
    let (b, h, d) = (dims.batch, dims.heads, dims.head_dim);
    if q.elem_count() == 0 || k.elem_count() == 0 {
        // No query, or no key to see: every row is a row that sees no key.
        let o = Tensor::zeros(q.shape(), q.dtype(), q.device())?;
        return Ok((o, t.full((b, h, dims.q_len), f64::NEG_INFINITY)?));
    }
    let (kh, vh) = (heads_major(k, cd)?, heads_major(v, cd)?);
    let lowest = t.full((), if cd == DType::F64 { f64::MIN } else { f32::MIN as f64 })?;
    let tiny = t.full((), if cd == DType::F64 { f64::MIN_POSITIVE } else { f32::MIN_POSITIVE as f64 })?;
    let mut masks = Masks::default();
    let (mut o_blocks, mut lse_blocks) = (Vec::new(), Vec::new());
    for (i0, rows) in t.query_blocks() {
        let key_blocks = t.key_blocks(i0, rows);
        if key_blocks == 0 {
            o_blocks.push(Tensor::zeros((b, h, rows, d), cd, q.device())?);
            lse_blocks.push(t.full((b, h, rows), f64::NEG_INFINITY)?);
            continue;
        }
        let qb = t.stacked(q, i0, rows, Some(t.scale))?;
        // (m, l, acc): running max and sum `[b, kv_heads, group·rows, 1]`, output `[.., group·rows, d]`.
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        for jb in 0..key_blocks {
            let (j0, cols) = t.key_block(jb);
            let (kb, vb) = (kh.narrow(2, j0, cols)?, vh.narrow(2, j0, cols)?);
            let s = masks.apply(&t, qb.matmul(&kb.t()?)?, i0, rows, j0, cols)?;
            let tile_max = s.max_keepdim(D::Minus1)?;
            state = Some(match state.take() {
                None => {
                    let m = tile_max.broadcast_maximum(&lowest)?;
                    let p = s.broadcast_sub(&m)?.exp()?;
                    (m, p.sum_keepdim(D::Minus1)?, p.matmul(&vb)?)
                }
                Some((m, l, acc)) => {
                    let m_new = m.maximum(&tile_max)?;
                    let alpha = (m - &m_new)?.exp()?;
                    let p = s.broadcast_sub(&m_new)?.exp()?;
                    let l = ((l * &alpha)? + p.sum_keepdim(D::Minus1)?)?;
                    let acc = (acc.broadcast_mul(&alpha)? + p.matmul(&vb)?)?;
                    (m_new, l, acc)
                }
            });
        }
        let (m, l, acc) = state.expect("key_blocks > 0: at least one tile ran");
        let o = acc.broadcast_div(&l.broadcast_maximum(&tiny)?)?;
        o_blocks.push(o.reshape((b, h, rows, d))?);
        lse_blocks.push((m + l.log()?)?.reshape((b, h, rows))?);
    }
    let o = seq_major(&Tensor::cat(&o_blocks, 2)?, q.dtype())?;
    Ok((o, Tensor::cat(&lse_blocks, 2)?))
}

/// Attention backward on any device, from the forward's saved `o: [batch, q_len, heads, head_dim]` and
/// `lse: [batch, heads, q_len]`. `d_o` (like o) is the gradient of o; `d_lse: [batch, heads, q_len]`, when
/// given, the gradient of lse (it adds `P ∘ d_lse` to dS). lse and d_lse may be f32 or f64. Returns
/// `(dq, dk, dv)` shaped and typed like `q, k, v`; the dk/dv of a kv head sum its query-head group. The
/// contract of [`crate::flash::flash_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    attention_backward_with_block(q, k, v, o, lse, d_o, d_lse, spec, block_for(q.device()))
}

/// [`attention_backward`] with `block` query rows and keys per tile (at least 1), for tests. Not part of
/// the stable API.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_with_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
    block: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = check(BWD, q, k, v, spec, usize::MAX)?;
    check_backward(q, o, lse, d_o, d_lse, &dims)?;
    let cd = compute_dtype(BWD, q.dtype())?;
    let t = Tiles::new(dims, *spec, block, cd, q.device());
    if q.elem_count() == 0 || k.elem_count() == 0 {
        return Ok((q.zeros_like()?, k.zeros_like()?, v.zeros_like()?));
    }
    let (b, h, hkv, d) = (dims.batch, dims.heads, dims.kv_heads, dims.head_dim);
    let (kh, vh) = (heads_major(k, cd)?, heads_major(v, cd)?);
    // K and V with a column of ones, `[b, kv_heads, nk, d + 1]`: against Q with a column -lse (dO with a
    // column -D) the tile product gives S - lse (dP - D) directly, one tile-sized pass less each.
    let ones = t.full((b, hkv, dims.k_len, 1), 1.0)?;
    let (kh1, vh1) = (Tensor::cat(&[&kh, &ones], 3)?, Tensor::cat(&[&vh, &ones], 3)?);
    drop(ones);
    // Per row `[b, h, nq]`: the LSE, with the largest finite value for rows that see no key (their P is then
    // exp(S - MAX) = 0; -inf would meet a 0 in the tile product), and D - d_lse with D = rowsum(dO ∘ O).
    let lse = lse.to_dtype(cd)?;
    let lse = lse.eq(f64::NEG_INFINITY)?.where_cond(&t.full(lse.shape(), t.max_finite())?, &lse)?;
    let delta = (d_o.to_dtype(cd)? * o.to_dtype(cd)?)?.sum(D::Minus1)?.transpose(1, 2)?;
    let delta = match d_lse {
        Some(d_lse) => (delta - d_lse.to_dtype(cd)?)?,
        None => delta.contiguous()?,
    };
    let n_key_blocks = dims.k_len.div_ceil(t.block);
    let (mut dk_blocks, mut dv_blocks) = (vec![None; n_key_blocks], vec![None; n_key_blocks]);
    let mut masks = Masks::default();
    let mut dq_blocks = Vec::new();
    for (i0, rows) in t.query_blocks() {
        let key_blocks = t.key_blocks(i0, rows);
        let mut dq = None;
        if key_blocks > 0 {
            let qb = t.stacked(q, i0, rows, Some(t.scale))?;
            let dob = t.stacked(d_o, i0, rows, None)?;
            let minus_per_row = |x: &Tensor| -> Result<Tensor> {
                Ok(x.narrow(2, i0, rows)?.neg()?.reshape((b, hkv, t.group() * rows, 1))?)
            };
            let qb1 = Tensor::cat(&[&qb, &minus_per_row(&lse)?], 3)?;
            let dob1 = Tensor::cat(&[&dob, &minus_per_row(&delta)?], 3)?;
            for jb in 0..key_blocks {
                let (j0, cols) = t.key_block(jb);
                let s = masks.apply(&t, qb1.matmul(&kh1.narrow(2, j0, cols)?.t()?)?, i0, rows, j0, cols)?;
                let p = s.exp()?;
                add_to(&mut dv_blocks[jb], p.t()?.matmul(&dob)?)?;
                let ds = (p * dob1.matmul(&vh1.narrow(2, j0, cols)?.t()?)?)?;
                let kb = kh.narrow(2, j0, cols)?;
                add_to(&mut dq, ds.matmul(&kb)?)?;
                add_to(&mut dk_blocks[jb], ds.t()?.matmul(&qb)?)?;
            }
        }
        dq_blocks.push(match dq {
            Some(dq) => (dq * t.scale)?.reshape((b, h, rows, d))?,
            None => Tensor::zeros((b, h, rows, d), cd, q.device())?,
        });
    }
    let key_side = |blocks: Vec<Option<Tensor>>, dtype: DType| -> Result<Tensor> {
        let blocks = blocks
            .into_iter()
            .enumerate()
            .map(|(jb, x)| match x {
                Some(x) => Ok(x),
                None => Ok(Tensor::zeros((b, hkv, t.key_block(jb).1, d), cd, q.device())?),
            })
            .collect::<Result<Vec<_>>>()?;
        seq_major(&Tensor::cat(&blocks, 2)?, dtype)
    };
    let dq = seq_major(&Tensor::cat(&dq_blocks, 2)?, q.dtype())?;
    Ok((dq, key_side(dk_blocks, k.dtype())?, key_side(dv_blocks, v.dtype())?))
}

/// The tiling of one call: dimensions, mask, block size, compute dtype and device.
struct Tiles {
    dims: AttentionDims,
    spec: AttentionSpec,
    block: usize,
    cd: DType,
    device: Device,
    scale: f64,
}

impl Tiles {
    fn new(dims: AttentionDims, spec: AttentionSpec, block: usize, cd: DType, device: &Device) -> Self {
        let scale = spec.scale_for(dims.head_dim);
        Self { dims, spec, block: block.max(1), cd, device: device.clone(), scale }
    }

    fn group(&self) -> usize {
        self.dims.group()
    }

    /// `(first row, rows)` of each query block.
    fn query_blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.dims.q_len).step_by(self.block).map(|i0| (i0, self.block.min(self.dims.q_len - i0)))
    }

    /// `(first key, keys)` of key block `jb`.
    fn key_block(&self, jb: usize) -> (usize, usize) {
        let j0 = jb * self.block;
        (j0, self.block.min(self.dims.k_len - j0))
    }

    /// How many keys (a prefix) query row `i` sees.
    fn visible_keys(&self, i: usize) -> usize {
        if self.spec.causal {
            (self.spec.q_offset + i + 1).saturating_sub(self.spec.k_offset).min(self.dims.k_len)
        } else {
            self.dims.k_len
        }
    }

    /// The key blocks the query block `i0..i0 + rows` computes: those up to its last row's last visible key
    /// (0: no row of the block sees a key).
    fn key_blocks(&self, i0: usize, rows: usize) -> usize {
        self.visible_keys(i0 + rows - 1).div_ceil(self.block)
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

/// `x: [b, n, kv_heads, d]` as `[b, kv_heads, n, d]`, contiguous, in `cd`.
fn heads_major(x: &Tensor, cd: DType) -> Result<Tensor> {
    Ok(x.transpose(1, 2)?.to_dtype(cd)?.contiguous()?)
}

/// `x: [b, heads, n, d]` back to `[b, n, heads, d]`, contiguous, in `dtype`.
fn seq_major(x: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(x.transpose(1, 2)?.to_dtype(dtype)?.contiguous()?)
}

/// The causal masks of one call: a 0 / -inf bias `[rows, cols]` per (rows, cols, diagonal shift), built
/// on the device the first time a tile needs it.
#[derive(Default)]
struct Masks {
    bias: HashMap<(usize, usize, i64), Tensor>,
}

impl Masks {
    /// The scores `s: [b, kv_heads, group · rows, cols]` of query rows from `i0` against keys from `j0`,
    /// with the entries the spec hides set to -inf (`s` itself when the tile hides nothing).
    fn apply(&mut self, t: &Tiles, s: Tensor, i0: usize, rows: usize, j0: usize, cols: usize) -> Result<Tensor> {
        if t.visible_keys(i0) >= j0 + cols {
            return Ok(s);
        }
        // Query row i0 + r sees key j0 + c iff c - r <= shift; clamped, the shift stays exact in f32.
        let shift = (t.spec.q_offset + i0) as i64 - (t.spec.k_offset + j0) as i64;
        let shift = shift.clamp(-(rows as i64), cols as i64);
        let bias = match self.bias.entry((rows, cols, shift)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(causal_bias(t, rows, cols, shift)?),
        };
        let (b, hkv, group_rows, _) = s.dims4()?;
        Ok(s.reshape((b, hkv, group_rows / rows, rows, cols))?
            .broadcast_add(bias)?
            .reshape((b, hkv, group_rows, cols))?)
    }
}

/// `[rows, cols]`: 0 where `c - r <= shift` (the key is visible), -inf elsewhere, in the compute dtype.
fn causal_bias(t: &Tiles, rows: usize, cols: usize, shift: i64) -> Result<Tensor> {
    let r = Tensor::arange(0f32, rows as f32, &t.device)?.reshape((rows, 1))?;
    let c = Tensor::arange(0f32, cols as f32, &t.device)?.reshape((1, cols))?;
    let hidden = c.broadcast_sub(&r)?.gt(shift as f64)?;
    Ok(hidden.where_cond(&t.full((rows, cols), f64::NEG_INFINITY)?, &t.full((rows, cols), 0.0)?)?)
}
