//! The chunked loss against an LM head sharded at `Gradients` or `Parameters` ([`autosp_core::shard`]), which
//! never makes the whole head nor its whole gradient. The head is taken one vocabulary tile at a time: at
//! `Parameters` each tile is gathered from the ranks whose flat slices hold it (an all-to-all of the pieces:
//! every rank receives the tile, `tile × d` elements, and nothing more), at `Gradients` it is a view of the
//! replicated head. The forward runs the log-sum-exp online over the tiles (a running max and a rescaled
//! running sum per row, in the statistics dtype: f32, f64 for f64) and picks each row's target logit from the
//! tile that holds it; it keeps each row's `lse` (`[m]`, the only extra state). The backward takes the tiles
//! again, in the same order: a tile of `dlogits = g · (exp(logits - lse) - onehot(target))` is final at once,
//! `d_hidden` accumulates over the tiles, and the tile's head gradient `dlogitsᵀ · h` goes at once, in pieces,
//! to the ranks whose slices hold it (an all-to-all), each rank summing the pieces it receives in rank order:
//! the head's gradient is reduce-scattered tile by tile, never whole on any rank.
//!
//! Tile size: the caller gives the elements one tile may hold (the largest decoder block's weights, so the
//! largest gathered tensor is at most one block's); the tile is that divided by the world size (at least one
//! row), because a rank receives one piece of each tile's gradient from every rank. Logits are computed in row
//! chunks of at most [`super::TILE_BYTES_CPU`] (CPU) or [`super::TILE_BYTES_GPU`] bytes per tile.
//!
//! Precision: the GEMMs run in the inputs' dtype and widen to the statistics dtype, as the generic kernel's
//! (`generic.rs`); the gradients sum over tiles in the statistics dtype; the head's slice gradient is in the
//! reduction dtype ([`Precision::reduce`]), as a reduce-scatter gives it. Results equal the unsharded loss's up
//! to the order of the sums (within 1e-6 relative in f32). Every collective is made in the same order on every
//! rank (the tile count depends only on the head's shape, the budget and the world size).

use std::ops::Range;
use std::sync::Arc;

use autosp_core::shard::{ParamShard, ShardLevel};
use autosp_core::{Error, NodeKind, Op, Param, Precision, Result, SavedTensors, Saves, Tape, Value};
use candle_core::{DType, Device, Tensor, D};

const OP: &str = "sharded_chunked_cross_entropy";

/// The op: inputs `hidden: [m, d]`, the head's slice `[chunk]` (its leaf on the tape), `targets: [m]` (i64 or
/// u32, negative = ignored); outputs the summed loss `[]` and each row's log-sum-exp `[m]` (statistics dtype).
/// Backward gives `d_hidden: [m, d]` and the slice's gradient `[chunk]` in the reduction dtype. Kind
/// [`NodeKind::Loss`]; collective over the shard's group in forward and backward.
#[derive(Debug)]
pub struct ShardedHeadLoss {
    /// The head's sharding (its whole shape `[vocab, d]`).
    pub shard: Arc<ParamShard>,
    /// The head as stored: whole at `Gradients` (tiles are its views), the slice at `Parameters`.
    pub stored: Tensor,
    /// Head rows per vocabulary tile (at least 1).
    pub tile_rows: usize,
}

impl ShardedHeadLoss {
    /// The op for `head`'s sharding, with tiles of at most `tile_elems / world` elements (see the module doc).
    pub fn new(shard: Arc<ParamShard>, stored: Tensor, tile_elems: usize) -> Result<Self> {
        let (_, d) = shard.shape.dims2()?;
        let per_rank = tile_elems / shard.layout.size.max(1);
        Ok(Self { tile_rows: (per_rank / d.max(1)).max(1), shard, stored })
    }

    /// The vocabulary tiles, in order.
    fn tiles(&self) -> Vec<Range<usize>> {
        let vocab = self.shard.shape.dims()[0];
        (0..vocab).step_by(self.tile_rows).map(|v0| v0..(v0 + self.tile_rows).min(vocab)).collect()
    }

    /// The flat elements `[a, b)` of the head that rank `r` owns, as a range within `[a, b)` (maybe empty).
    fn overlap(&self, r: usize, flat: &Range<usize>) -> Range<usize> {
        let chunk = self.shard.layout.chunk;
        let numel = self.shard.layout.numel;
        let (start, end) = ((r * chunk).min(numel), ((r + 1) * chunk).min(numel));
        let (lo, hi) = (start.max(flat.start), end.min(flat.end));
        if lo < hi {
            lo..hi
        } else {
            flat.start..flat.start
        }
    }

    /// The head rows `rows` as `[rows, d]`: a view of the stored head at `Gradients`; at `Parameters` every
    /// rank's piece of them (its slice's overlap) gathered by one all-to-all. Collective at `Parameters`.
    fn tile(&self, slice: &Tensor, rows: &Range<usize>) -> Result<Tensor> {
        let (_, d) = self.shard.shape.dims2()?;
        if self.shard.level != ShardLevel::Parameters {
            return Ok(self.stored.narrow(0, rows.start, rows.len())?);
        }
        let group = self.shard.group.as_ref();
        let flat = rows.start * d..rows.end * d;
        let mine = self.overlap(group.rank(), &flat);
        let start = group.rank() * self.shard.layout.chunk;
        let piece = if mine.is_empty() {
            Tensor::zeros(0, slice.dtype(), slice.device())?
        } else {
            slice.narrow(0, mine.start - start, mine.len())?.contiguous()?
        };
        let pieces = group.all_to_all(vec![piece; group.size()])?;
        let tile = Tensor::cat(&pieces, 0)?.reshape((rows.len(), d))?;
        autosp_core::shard::note_gathered(&tile);
        Ok(tile)
    }

    /// Sums every rank's gradient of the head rows `rows` (`dw: [rows, d]`, statistics dtype) into the pieces
    /// their owners hold: returns this rank's piece (its overlap with the rows), summed in rank order, in the
    /// reduction dtype. Collective.
    fn reduce_tile(&self, dw: &Tensor, rows: &Range<usize>, reduce: DType) -> Result<Tensor> {
        let (_, d) = self.shard.shape.dims2()?;
        let group = self.shard.group.as_ref();
        let flat = rows.start * d..rows.end * d;
        let dw = dw.to_dtype(reduce)?.flatten_all()?;
        let outgoing = (0..group.size())
            .map(|r| {
                let o = self.overlap(r, &flat);
                Ok(dw.narrow(0, o.start - flat.start, o.len())?.contiguous()?)
            })
            .collect::<Result<Vec<_>>>()?;
        let incoming = group.all_to_all(outgoing)?;
        let mut sum = incoming[0].clone();
        for piece in &incoming[1..] {
            sum = (sum + piece)?;
        }
        Ok(sum)
    }

    /// Rows of hidden per logits chunk for a tile of `cols` columns.
    fn row_chunk(&self, device: &Device, acc: DType, m: usize, cols: usize) -> usize {
        let budget = if device.is_cpu() { super::TILE_BYTES_CPU } else { super::TILE_BYTES_GPU };
        (budget / acc.size_in_bytes() / cols.max(1)).clamp(1, m.max(1))
    }
}

/// `logits` of rows `rows` of `h` against the tile `w: [cols, d]`, widened to `acc`: `[rows, cols]`.
fn logits(h: &Tensor, w: &Tensor, rows: &Range<usize>, acc: DType) -> Result<Tensor> {
    Ok(h.narrow(0, rows.start, rows.len())?.matmul(&w.t()?)?.to_dtype(acc)?)
}

/// Per row of `t: [r]` (i64): `(t - v0` clamped into the tile as u32 `[r, 1]`, `1` where the target is in the
/// tile `[v0, v0 + cols)` else `0` as `acc` `[r, 1])`.
fn in_tile(t: &Tensor, v0: usize, cols: usize, acc: DType) -> Result<(Tensor, Tensor)> {
    let local = (t - v0 as f64)?;
    let mask = local.ge(0i64)?.mul(&local.lt(cols as i64)?)?;
    let idx = local.clamp(0i64, cols as i64 - 1)?.to_dtype(DType::U32)?.unsqueeze(1)?;
    Ok((idx, mask.to_dtype(acc)?.unsqueeze(1)?))
}

impl Op for ShardedHeadLoss {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Loss
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (h, slice, t) = (i[0], i[1], &i[2].to_dtype(DType::I64)?);
        let m = h.dim(0)?;
        let acc = Precision::float(h.dtype()).accumulate();
        let tiles = self.tiles();
        let chunk = self.row_chunk(h.device(), acc, m, self.tile_rows);
        let chunks: Vec<Range<usize>> = (0..m).step_by(chunk).map(|r| r..(r + chunk).min(m)).collect();
        // Per row chunk: the running max, the running sum of exp(logit - max) and the target's logit.
        let mut state: Vec<(Tensor, Tensor, Tensor)> = chunks
            .iter()
            .map(|r| {
                let n = r.len();
                Ok((
                    Tensor::full(f32::NEG_INFINITY, (n, 1), h.device())?.to_dtype(acc)?,
                    Tensor::zeros((n, 1), acc, h.device())?,
                    Tensor::zeros((n, 1), acc, h.device())?,
                ))
            })
            .collect::<Result<_>>()?;
        for v in &tiles {
            let w = self.tile(slice, v)?;
            for (rows, (max, sum, picked)) in chunks.iter().zip(state.iter_mut()) {
                let l = logits(h, &w, rows, acc)?;
                let new_max = max.maximum(&l.max_keepdim(D::Minus1)?)?;
                let rescaled = (&*sum * (&*max - &new_max)?.exp()?)?;
                *sum = (rescaled + l.broadcast_sub(&new_max)?.exp()?.sum_keepdim(D::Minus1)?)?;
                *max = new_max;
                let (idx, mask) = in_tile(&t.narrow(0, rows.start, rows.len())?, v.start, v.len(), acc)?;
                *picked = (&*picked + (l.gather(&idx, 1)? * mask)?)?;
            }
        }
        let mut lse = Vec::with_capacity(chunks.len());
        let mut loss = Tensor::zeros((), acc, h.device())?;
        for (rows, (max, sum, picked)) in chunks.iter().zip(&state) {
            let l = (max + sum.log()?)?;
            let valid = t.narrow(0, rows.start, rows.len())?.ge(0i64)?.to_dtype(acc)?.unsqueeze(1)?;
            loss = (loss + ((&l - picked)? * valid)?.sum_all()?)?;
            lse.push(l.squeeze(1)?);
        }
        let lse = if lse.is_empty() { Tensor::zeros(0, acc, h.device())? } else { Tensor::cat(&lse, 0)? };
        Ok(vec![loss, lse])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1, 2]).and_outputs(&[1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 3]) };
        let (h, slice, t, lse) = (s.input(0)?, s.input(1)?, &s.input(2)?.to_dtype(DType::I64)?, s.output(1)?);
        let weight = s.needs_grad(1);
        let m = h.dim(0)?;
        let precision = Precision::float(h.dtype());
        let acc = precision.accumulate();
        let g = g.to_dtype(acc)?.to_device(h.device())?;
        let chunk = self.row_chunk(h.device(), acc, m, self.tile_rows);
        let chunks: Vec<Range<usize>> = (0..m).step_by(chunk).map(|r| r..(r + chunk).min(m)).collect();
        let mut dh: Vec<Option<Tensor>> = vec![None; chunks.len()];
        let mut pieces = Vec::new();
        for v in &self.tiles() {
            let w = self.tile(slice, v)?;
            let mut dw: Option<Tensor> = None;
            for (c, rows) in chunks.iter().enumerate() {
                let l = logits(h, &w, rows, acc)?;
                let tc = t.narrow(0, rows.start, rows.len())?;
                let (idx, mask) = in_tile(&tc, v.start, v.len(), acc)?;
                let p = l.broadcast_sub(&lse.narrow(0, rows.start, rows.len())?.unsqueeze(1)?)?.exp()?;
                let cols = Tensor::arange(0u32, v.len() as u32, h.device())?.unsqueeze(0)?;
                let onehot = cols.broadcast_eq(&idx)?.to_dtype(acc)?.broadcast_mul(&mask)?;
                let valid = tc.ge(0i64)?.to_dtype(acc)?.unsqueeze(1)?;
                let dl = (p - onehot)?.broadcast_mul(&valid)?.broadcast_mul(&g)?.to_dtype(h.dtype())?;
                let part = dl.matmul(&w)?.to_dtype(acc)?;
                dh[c] = Some(match dh[c].take() {
                    Some(sum) => (sum + part)?,
                    None => part,
                });
                if weight {
                    let hc = h.narrow(0, rows.start, rows.len())?;
                    let part = dl.t()?.matmul(&hc)?.to_dtype(acc)?;
                    dw = Some(match dw {
                        Some(sum) => (sum + part)?,
                        None => part,
                    });
                }
            }
            if weight {
                let (_, d) = self.shard.shape.dims2()?;
                let dw = match dw {
                    Some(dw) => dw,
                    None => Tensor::zeros((v.len(), d), acc, h.device())?,
                };
                pieces.push(self.reduce_tile(&dw, v, precision.reduce())?);
            }
        }
        let dh = match dh.into_iter().collect::<Option<Vec<_>>>() {
            Some(parts) if !parts.is_empty() => Tensor::cat(&parts, 0)?.to_dtype(h.dtype())?,
            _ => h.zeros_like()?,
        };
        let dslice = if weight {
            let owned = self.shard.layout.owned().len();
            let pad = self.shard.layout.chunk - owned;
            let joined = Tensor::cat(&pieces, 0)?;
            if joined.elem_count() != owned {
                return Err(Error::Internal(format!(
                    "{OP}: the head's tiles gave {} elements of this rank's {owned}",
                    joined.elem_count()
                )));
            }
            Some(if pad > 0 { joined.pad_with_zeros(0, 0, pad)? } else { joined })
        } else {
            None
        };
        Ok(vec![Some(dh), dslice, None])
    }
}

/// The chunked loss of `hidden: [m, d]` against the LM head `head` (a parameter, `[vocab, d]`) and `targets:
/// [m]` (i64 or u32, negative ignored): `(sum of token losses: []`, valid count`)`, as
/// [`super::chunked_cross_entropy`]. A head sharded at `Gradients` or `Parameters` goes through
/// [`ShardedHeadLoss`] in vocabulary tiles of at most `tile_elems` elements (pass the largest decoder block's
/// weight count: no larger tensor of the head is ever whole), on recording and inference tapes alike; any
/// other head through [`super::chunked_cross_entropy`] with `chunk_rows`. Collective when sharded.
pub fn chunked_cross_entropy_param(
    tape: &Tape,
    hidden: &Value,
    head: &Param,
    targets: &Value,
    chunk_rows: usize,
    tile_elems: usize,
) -> Result<(Value, usize)> {
    let Some(shard) = head.shard().filter(|s| s.level >= ShardLevel::Gradients) else {
        return super::chunked_cross_entropy(tape, hidden, &tape.param(head)?, targets, chunk_rows);
    };
    let (vocab, d) = shard.shape.dims2()?;
    let (h, t) = (hidden.tensor(), targets.tensor());
    if h.rank() != 2 || h.dim(1)? != d || t.dims() != [h.dim(0)?] {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "hidden {:?} and targets {:?} for a head of [{vocab}, {d}]: hidden must be [m, {d}] and targets \
                 [m]",
                h.dims(),
                t.dims()
            ),
        });
    }
    if h.dtype() != head.tensor().dtype() {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "hidden is {:?} but the head is {:?}; convert them to one dtype",
                h.dtype(),
                head.tensor().dtype()
            ),
        });
    }
    let count = super::read_targets(t, vocab, autosp_core::dispatch::Route::Generic)?;
    let leaf = match tape.param_slice(head)? {
        Some((leaf, _)) => leaf,
        // An inference tape: the slice as a constant (at `Gradients` the op reads the stored head).
        None => Value::constant(head.tensor()),
    };
    let op = ShardedHeadLoss::new(shard, head.tensor(), tile_elems)?;
    Ok((tape.apply(op, &[hidden, &leaf, targets])?.remove(0), count))
}

/// Logits of `hidden: [m, d]` against `head: [vocab, d]` sharded at `Parameters`, `[m, vocab]` in hidden's dtype,
/// without the whole head: it is gathered a vocabulary tile at a time (tiles of at most `tile_elems / world`
/// elements, as the loss takes them), each tile's logits made and the tile freed before the next. Forward only,
/// for evaluation and generation (no gradient). Collective over the head's group: every rank calls it, with
/// its own `m` (0 too). `None` when the head is not sharded at `Parameters`: use the whole head then.
pub fn sharded_head_logits(hidden: &Tensor, head: &Param, tile_elems: usize) -> Result<Option<Tensor>> {
    let Some(shard) = head.shard().filter(|s| s.level == ShardLevel::Parameters) else { return Ok(None) };
    let (vocab, d) = shard.shape.dims2()?;
    let slice = head.tensor();
    if hidden.rank() != 2 || hidden.dim(1)? != d || hidden.dtype() != slice.dtype() {
        return Err(Error::InvalidArgument {
            op: "sharded_head_logits",
            msg: format!(
                "hidden {:?} of {:?} for a head of [{vocab}, {d}] in {:?}: hidden must be [m, {d}] in the head's dtype",
                hidden.dims(),
                hidden.dtype(),
                slice.dtype()
            ),
        });
    }
    let op = ShardedHeadLoss::new(shard, slice.clone(), tile_elems)?;
    // Each tile's logits written into the result as they come: `[m, vocab]` once, never the tiles beside it.
    let m = hidden.dim(0)?;
    let out = Tensor::zeros((m, vocab), hidden.dtype(), hidden.device())?;
    for v in op.tiles() {
        // Every rank takes every tile (collective), whatever its rows.
        let w = op.tile(&slice, &v)?;
        if m > 0 {
            out.slice_set(&logits(hidden, &w, &(0..m), hidden.dtype())?, 1, v.start)?;
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use autosp_core::comm::run_ranks;
    use autosp_core::{CheckpointPolicy, Param};

    use super::*;

    /// A 37 x 5 head (185 elements: slices of 93, the second padded) in tiles of 7 rows (a budget of 70
    /// elements over 2 ranks: 35 per rank, 7 rows of 5; the last tile 2 rows), two ranks with 6 and 0 rows (a rank with no tokens still takes part in
    /// every collective), some targets ignored, at `Gradients` and `Parameters`, f64: the loss, `d_hidden` and
    /// each rank's slice of the head's gradient equal the one-rank chunked loss's within 1e-12.
    #[test]
    fn tiles_give_the_whole_heads_loss_and_gradients() {
        let (vocab, d) = (37usize, 5usize);
        let head: Vec<f64> = (0..vocab * d).map(|i| (i as f64 * 0.31).sin()).collect();
        let head = Tensor::from_vec(head, (vocab, d), &Device::Cpu).unwrap();
        let rows_of = |rank: usize| if rank == 0 { 6 } else { 0 };
        let hidden_of = |rank: usize| {
            let m = rows_of(rank);
            let v: Vec<f64> = (0..m * d).map(|i| ((i + 3 * rank) as f64 * 0.77).cos()).collect();
            Tensor::from_vec(v, (m, d), &Device::Cpu).unwrap()
        };
        let targets_of = |rank: usize| {
            let t: Vec<i64> = [3i64, -100, 36, 0, 20, 7][..rows_of(rank)].to_vec();
            Tensor::from_vec(t.clone(), t.len(), &Device::Cpu).unwrap()
        };
        // One rank: the plain chunked loss over every row.
        let tape = Tape::new(CheckpointPolicy::None);
        let h = tape.leaf(hidden_of(0));
        let w = tape.leaf(head.clone());
        let t = tape.constant(targets_of(0));
        let (loss, _) = super::super::chunked_cross_entropy(&tape, &h, &w, &t, 4).unwrap();
        tape.backward(&loss).unwrap();
        let want_loss = loss.tensor().to_scalar::<f64>().unwrap();
        let want_dh = tape.grad(&h).unwrap().unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let want_dw = tape.grad(&w).unwrap().unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for level in [ShardLevel::Gradients, ShardLevel::Parameters] {
            let out = run_ranks(2, Duration::from_secs(30), |pg| {
                let p = Param::new("lm_head.weight", head.clone());
                p.shard_over(level, pg.clone()).unwrap();
                let rank = pg.rank();
                let tape = Tape::new(CheckpointPolicy::None);
                let h = tape.leaf(hidden_of(rank));
                let t = tape.constant(targets_of(rank));
                let (loss, n) = chunked_cross_entropy_param(&tape, &h, &p, &t, 4, 70).unwrap();
                let got_loss = loss.tensor().to_scalar::<f64>().unwrap();
                tape.backward(&loss).unwrap();
                let dh = tape.grad(&h).unwrap().unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
                let dslice = tape.param_grads().get(&p).unwrap().to_vec1::<f64>().unwrap();
                (got_loss, n, dh, dslice)
            });
            for (rank, got) in out.into_iter().enumerate() {
                let (loss, n, dh, dslice) = got.unwrap();
                let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
                if rank == 0 {
                    assert!(close(loss, want_loss), "{level}: loss {loss} vs {want_loss}");
                    assert_eq!(n, 5, "{level}: valid targets");
                    assert!(dh.iter().zip(&want_dh).all(|(&a, &b)| close(a, b)), "{level}: d_hidden");
                } else {
                    assert_eq!((loss, n, dh.len()), (0.0, 0, 0), "{level}: the rank with no rows");
                }
                assert_eq!(dslice.len(), 93, "{level}: a slice of ceil(185 / 2)");
                for (j, &v) in dslice.iter().enumerate() {
                    let w = want_dw.get(rank * 93 + j).copied().unwrap_or(0.0);
                    assert!(close(v, w), "{level} rank {rank} element {j}: {v} vs {w}");
                }
            }
        }
    }

    /// `sharded_head_logits` on 2 ranks (the 37 x 5 head in tiles of 7 rows, 6 rows on rank 0 and none on rank
    /// 1, which still takes part in every tile's gather) against the whole head's `hidden · headᵀ` on one rank,
    /// in each dtype the model computes in: f64 and f32 within 1e-12 and 1e-6 of the largest logit (the same
    /// dot products; only the GEMM's blocking may differ), bf16 within 1e-2 (8 bits of mantissa, rounded once
    /// per tile or once whole). A head below `Parameters` gives `None`, and a hidden in another dtype is refused.
    #[test]
    fn head_logits_in_tiles_equal_the_whole_heads_in_every_dtype() {
        let (vocab, d) = (37usize, 5usize);
        let head: Vec<f64> = (0..vocab * d).map(|i| (i as f64 * 0.31).sin()).collect();
        let head = Tensor::from_vec(head, (vocab, d), &Device::Cpu).unwrap();
        let hidden: Vec<f64> = (0..6 * d).map(|i| (i as f64 * 0.77).cos()).collect();
        let hidden = Tensor::from_vec(hidden, (6, d), &Device::Cpu).unwrap();
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let (head, hidden) = (head.to_dtype(dtype).unwrap(), hidden.to_dtype(dtype).unwrap());
            let want = hidden.matmul(&head.t().unwrap()).unwrap().to_dtype(DType::F64).unwrap();
            let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
            let out = run_ranks(2, Duration::from_secs(30), |pg| {
                let p = Param::new("lm_head.weight", head.clone());
                p.shard_over(ShardLevel::Parameters, pg.clone()).unwrap();
                let mine = if pg.rank() == 0 { hidden.clone() } else { hidden.narrow(0, 0, 0).unwrap() };
                let wrong = sharded_head_logits(&mine.to_dtype(DType::F16).unwrap(), &p, 70).unwrap_err();
                (sharded_head_logits(&mine, &p, 70).unwrap().expect("sharded at Parameters"), wrong.to_string())
            });
            for (rank, got) in out.into_iter().enumerate() {
                let (logits, wrong) = got.unwrap();
                assert!(wrong.contains("in the head's dtype"), "{wrong}");
                assert_eq!(logits.dtype(), dtype);
                if rank == 1 {
                    assert_eq!(logits.dims(), &[0, vocab]);
                    continue;
                }
                let e = (logits.to_dtype(DType::F64).unwrap() - &want).unwrap().abs().unwrap();
                let e = e.max_all().unwrap().to_scalar::<f64>().unwrap() / scale;
                assert!(e <= tol, "{dtype:?}: {e:e} of the largest logit");
            }
        }
        let whole = Param::new("lm_head.weight", head);
        assert!(sharded_head_logits(&Tensor::zeros((1, d), DType::F64, &Device::Cpu).unwrap(), &whole, 70)
            .unwrap()
            .is_none());
    }
}
