//! The chunked linear + cross-entropy in candle tensor ops, on any device: the device-generic twin of the CPU
//! kernel (`cpu.rs`), with its contracts and outputs, in `[rows, vocab]` tiles of the logits.
//!
//! **Algorithm.** Hidden is cut into row tiles and the head into vocabulary tiles ([`LossTiles`]). One pass
//! over the tiles, row tile by row tile and within it vocabulary tile by vocabulary tile, computes each row's
//! log-sum-exp online (a running max and a running sum rescaled to it) and picks its target's logit from the
//! tile that holds it: the forward's loss is the sum of `lse - logit[target]` over valid rows (target >= 0).
//! The backward makes that pass for the `lse` (recomputed: one more logits GEMM instead of a saved `[m]`
//! tensor) and then a second one, vocabulary tile by vocabulary tile and within it row tile by row tile: a
//! tile of `dlogits = g · (exp(logits - lse) - onehot(target))` needs only its rows' `lse`, so it is final
//! at once; `d_hidden += dlogits · W[tile]` accumulates per row tile over the vocabulary tiles, and
//! `d_lm_head[tile] = Σ_rows dlogitsᵀ · h` is complete when the vocabulary tile's rows are, and is written
//! once, with `slice_set`, into the one `[vocab, d]` gradient allocated for the call. Every sum runs in a
//! fixed order (tile by tile): the results repeat bit for bit.
//!
//! **Precision.** The GEMMs run in the inputs' dtype (bf16/f16 on a GPU: tensor cores, and no f32 copy of
//! the head): `logits = h · Wᵀ` in it, then each logits tile is widened to the statistics dtype (f32, f64 for
//! f64 inputs; [`Precision::accumulate`]) for the max, exp, sum and log; `dlogits` is computed there and
//! rounded to the inputs' dtype as the operand of both gradient GEMMs, whose products are summed in the
//! statistics dtype and rounded to the inputs' dtype once at the end. The loss stays in the statistics
//! dtype. Nothing on the device is f64 unless the inputs are. The upstream gradient `g` is a device tensor
//! (never read back); ignored rows contribute 0 to the loss and to both gradients (exactly: their `dlogits`
//! rows are 0).
//!
//! **Tiles and memory.** A logits tile is `rows × vocab` elements of the statistics dtype under a byte
//! budget per device ([`TILE_BYTES_CPU`], [`TILE_BYTES_GPU`]; [`LossTiles::for_inputs`]): as many
//! vocabulary columns as the budget gives with all rows in one tile (so a vocabulary tile's head gradient is
//! one GEMM), but at least [`MIN_VOCAB_TILE`]; then as many rows as the budget leaves. The caller's
//! `chunk_rows` (the CPU kernel's) is not used here. Transient memory: the logits tile in the inputs' dtype
//! and at most two tiles in the statistics dtype at a time (two to three budgets), the `[m, d]` `d_hidden`
//! sum and one `[vocab_tile, d]` head-gradient tile (statistics dtype), besides the `[vocab, d]` output. At
//! 8K tokens of Llama-3.2-1B on a GPU (bf16, vocabulary 128256, hidden 2048): 16 tiles of `[8192, 8192]`,
//! 64 MiB head-gradient tiles, and one bf16 `[128256, 2048]` gradient, where row chunks of 65 made a 1 GiB
//! f32 product and sum per chunk. The targets are trusted (the door checks them).

use candle_core::{DType, Device, Tensor, D};

use autosp_core::{Error, Precision, Result};

use crate::running_sum::add_to;

/// Bytes of one logits tile (statistics dtype) on the CPU: 32 MiB, what the Llama model's row chunks give
/// the CPU kernel (8 Mi f32 logits per chunk).
pub const TILE_BYTES_CPU: usize = 32 << 20;

/// Bytes of one logits tile (statistics dtype) on any other device (a GPU): 256 MiB; the backward's
/// transient memory is about three of them.
pub const TILE_BYTES_GPU: usize = 256 << 20;

/// The fewest vocabulary columns of a tile (fewer when the vocabulary is smaller): narrower tiles would make
/// thin, slow GEMMs; past it the rows are cut instead.
pub const MIN_VOCAB_TILE: usize = 1024;

/// The tile shape of the generic chunked loss: `rows` rows of hidden by `vocab` rows of the head (columns of
/// the logits). Both at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossTiles {
    /// Rows of hidden per tile.
    pub rows: usize,
    /// Vocabulary entries (head rows) per tile.
    pub vocab: usize,
}

impl LossTiles {
    /// The tiles for `m` rows against a `vocab`-word head in `dtype` on `device`: a `rows × vocab` logits tile
    /// in the statistics dtype (4 bytes, 8 for f64) within [`TILE_BYTES_CPU`] on the CPU or
    /// [`TILE_BYTES_GPU`] elsewhere; all `m` rows when the budget gives them at least [`MIN_VOCAB_TILE`]
    /// columns (at 8K rows, 256 MiB: tiles of `[8192, 8192]`), else `MIN_VOCAB_TILE` columns and the rows the
    /// budget leaves.
    pub fn for_inputs(device: &Device, dtype: DType, m: usize, vocab: usize) -> Self {
        Self::for_budget(if device.is_cpu() { TILE_BYTES_CPU } else { TILE_BYTES_GPU }, dtype, m, vocab)
    }

    /// The tiles of [`for_inputs`](Self::for_inputs) for a logits tile of at most `budget` bytes (at least one
    /// row of `MIN_VOCAB_TILE` columns, whatever the budget).
    pub fn for_budget(budget: usize, dtype: DType, m: usize, vocab: usize) -> Self {
        let elements = (budget / Precision::float(dtype).accumulate().size_in_bytes()).max(1);
        let vocab_tile = (elements / m.max(1)).clamp(MIN_VOCAB_TILE.min(vocab).max(1), vocab.max(1));
        Self { rows: (elements / vocab_tile).clamp(1, m.max(1)), vocab: vocab_tile }
    }
}

/// The checked inputs in the layout the tiles read: `h: [m, d]` and `w: [vocab, d]` contiguous in their own
/// dtype, `ids: [m, 1]` i64 targets (negative = ignored), `valid: [m, 1]` 1 for a valid row, 0 else, in the
/// statistics dtype `sd`.
struct Inputs {
    h: Tensor,
    w: Tensor,
    ids: Tensor,
    valid: Tensor,
    sd: DType,
    tiles: LossTiles,
}

/// `(start, len)` of each tile of `len` elements over `0..total`, the last one partial.
fn spans(total: usize, len: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..total).step_by(len).map(move |s| (s, len.min(total - s)))
}

impl Inputs {
    fn new(hidden: &Tensor, lm_head: &Tensor, targets: &Tensor, tiles: LossTiles) -> Result<Self> {
        if tiles.rows == 0 || tiles.vocab == 0 {
            return Err(Error::InvalidArgument {
                op: super::OP,
                msg: format!("loss tiles must be at least 1 x 1, got {tiles:?}"),
            });
        }
        let sd = Precision::float(hidden.dtype()).accumulate();
        let ids = targets.to_dtype(DType::I64)?.unsqueeze(1)?;
        let valid = ids.ge(0i64)?.to_dtype(sd)?;
        Ok(Self { h: hidden.contiguous()?, w: lm_head.contiguous()?, ids, valid, sd, tiles })
    }

    /// The logits tile `h[r0..r0+rows] · W[v0..v0+vocab]ᵀ`, the GEMM in the inputs' dtype, widened to the
    /// statistics dtype: `[rows, vocab]`.
    fn logits(&self, (r0, rows): (usize, usize), (v0, vocab): (usize, usize)) -> Result<Tensor> {
        let w = self.w.narrow(0, v0, vocab)?;
        Ok(self.h.narrow(0, r0, rows)?.matmul(&w.t()?)?.to_dtype(self.sd)?)
    }

    /// Where each row's target falls in the vocabulary tile `(v0, vocab)`: `(hit: [rows, 1]` 1 when it is in
    /// the tile, 0 else (ignored rows never are), in the statistics dtype, `index: [rows, 1]` u32, the
    /// target's column in the tile, 0 where not hit`)`.
    fn targets_in(&self, (r0, rows): (usize, usize), (v0, vocab): (usize, usize)) -> Result<(Tensor, Tensor)> {
        let local = self.ids.narrow(0, r0, rows)?.affine(1.0, -(v0 as f64))?;
        let hit = (local.ge(0i64)? * local.lt(vocab as i64)?)?;
        let index = hit.where_cond(&local, &local.zeros_like()?)?.to_dtype(DType::U32)?;
        Ok((hit.to_dtype(self.sd)?, index))
    }

    /// Per row tile, `(lse: [rows, 1], logit of the target: [rows, 1]` (0 on ignored rows)`)` in the
    /// statistics dtype, over the vocabulary tiles in order (online log-sum-exp). The backward uses only the
    /// lse; the target's logit costs it a `[rows, 1]` gather per tile.
    fn row_stats(&self) -> Result<Vec<(Tensor, Tensor)>> {
        let (m, vocab) = (self.h.dim(0)?, self.w.dim(0)?);
        spans(m, self.tiles.rows)
            .map(|r| {
                // (running max, sum of exp(logits - running max), target logit)
                let mut run: Option<(Tensor, Tensor, Tensor)> = None;
                for v in spans(vocab, self.tiles.vocab) {
                    let logits = self.logits(r, v)?;
                    let (hit, index) = self.targets_in(r, v)?;
                    let picked = (logits.gather(&index, 1)? * hit)?;
                    let tile_max = logits.max_keepdim(D::Minus1)?;
                    let (mx, rescaled, target) = match run.take() {
                        None => (tile_max, None, picked),
                        Some((mx, sum, target)) => {
                            let new_max = mx.maximum(&tile_max)?;
                            let rescaled = ((mx - &new_max)?.exp()? * sum)?;
                            (new_max, Some(rescaled), (target + picked)?)
                        }
                    };
                    // One tile besides the logits at a time: each step replaces the last.
                    let mut e = logits.broadcast_sub(&mx)?;
                    drop(logits);
                    e = e.exp()?;
                    let tile_sum = e.sum_keepdim(D::Minus1)?;
                    let sum = match rescaled {
                        None => tile_sum,
                        Some(r) => (r + tile_sum)?,
                    };
                    run = Some((mx, sum, target));
                }
                let (mx, sum, target) =
                    run.ok_or_else(|| Error::Internal(format!("{}: a vocabulary of 0 has no loss", super::OP)))?;
                Ok(((sum.log()? + mx)?, target))
            })
            .collect()
    }
}

/// The summed loss `[]` in the statistics dtype (f32, f64 for f64) of checked inputs `hidden: [m, d]`,
/// `lm_head: [vocab, d]` (one dtype), `targets: [m]` (i64 or u32, in range or negative) in `tiles`.
pub(crate) fn forward(hidden: &Tensor, lm_head: &Tensor, targets: &Tensor, tiles: LossTiles) -> Result<Tensor> {
    let x = Inputs::new(hidden, lm_head, targets, tiles)?;
    let mut total = None;
    for ((lse, target), (r0, rows)) in x.row_stats()?.into_iter().zip(spans(hidden.dim(0)?, tiles.rows)) {
        add_to(&mut total, ((lse - target)? * x.valid.narrow(0, r0, rows)?)?.sum_all()?)?;
    }
    Ok(match total {
        Some(t) => t,
        None => Tensor::zeros((), x.sd, hidden.device())?,
    })
}

/// The gradients of `g · loss` for checked inputs (as [`forward`]'s) in `tiles`: `(d_hidden: [m, d],
/// d_lm_head: [vocab, d]` only when `weight`; a frozen head skips its GEMMs`)` in the inputs' dtype. `grad`:
/// `g`, a one-element tensor of any float dtype on the inputs' device (it stays there).
pub(crate) fn backward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    tiles: LossTiles,
    grad: &Tensor,
    weight: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let x = Inputs::new(hidden, lm_head, targets, tiles)?;
    let ((m, d), vocab, dtype) = (hidden.dims2()?, lm_head.dim(0)?, hidden.dtype());
    let g = grad.to_dtype(x.sd)?.reshape(())?;
    let lse: Vec<Tensor> = x.row_stats()?.into_iter().map(|(lse, _)| lse).collect();
    // Per row tile: the valid mask times g ([rows, 1]).
    let scales: Vec<Tensor> = spans(m, tiles.rows)
        .map(|(r0, rows)| x.valid.narrow(0, r0, rows)?.broadcast_mul(&g))
        .collect::<candle_core::Result<_>>()?;
    let mut dh: Vec<Option<Tensor>> = vec![None; lse.len()];
    let dw = if weight { Some(Tensor::zeros((vocab, d), dtype, hidden.device())?) } else { None };
    for v in spans(vocab, tiles.vocab) {
        let w = x.w.narrow(0, v.0, v.1)?;
        let mut dw_tile = None;
        for (((r, lse), scale), dh) in spans(m, tiles.rows).zip(&lse).zip(&scales).zip(dh.iter_mut()) {
            // dlogits = g·softmax - g·onehot on valid rows, 0 on ignored ones, in the statistics dtype (each
            // step replaces the last tile), then rounded to the inputs' dtype for the GEMMs.
            let dl = {
                let mut dl = x.logits(r, v)?;
                dl = dl.broadcast_sub(lse)?;
                dl = dl.exp()?;
                dl = dl.broadcast_mul(scale)?;
                let (hit, index) = x.targets_in(r, v)?;
                dl.scatter_add_set(&index, &hit.broadcast_mul(&g)?.neg()?, 1)?;
                dl.to_dtype(dtype)?
            };
            add_to(dh, dl.matmul(&w)?.to_dtype(x.sd)?)?;
            if weight {
                add_to(&mut dw_tile, dl.t()?.matmul(&x.h.narrow(0, r.0, r.1)?)?.to_dtype(x.sd)?)?;
            }
        }
        if let (Some(dw), Some(tile)) = (&dw, dw_tile) {
            dw.slice_set(&tile.to_dtype(dtype)?, 0, v.0)?;
        }
    }
    let dh = match dh.into_iter().collect::<Option<Vec<_>>>() {
        Some(parts) if !parts.is_empty() => Tensor::cat(&parts, 0)?.to_dtype(dtype)?,
        _ => hidden.zeros_like()?,
    };
    Ok((dh, dw))
}
