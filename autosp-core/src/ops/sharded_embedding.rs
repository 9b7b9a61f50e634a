//! Embedding lookup from a table sharded at `Gradients` or `Parameters` ([`crate::shard`]), whose forward
//! never gathers the whole table and whose backward never makes the whole table's gradient. At `Parameters`
//! the forward all-gathers the ranks' ids (`tokens` numbers per rank), each rank fills the parts of those rows
//! that lie in its own slice (zeros elsewhere) and a reduce-scatter hands every rank its own tokens' rows: each
//! element is one rank's value plus zeros, so the rows equal the whole table's bit for bit, and what moves is
//! `tokens × hidden` per rank, never `vocab × hidden`. The plain path (a [`ShardedParam`](super::shard_param::ShardedParam)
//! gather, then [`Embedding`]) scatter-adds every rank's token gradients into a whole `[vocab, hidden]`
//! gradient and reduce-scatters it: 1 GiB per rank and per step for a 128K × 2048 f32 table, for a few
//! thousand rows that changed. Here backward all-gathers the tokens' ids and gradients over the shard's group
//! (`tokens × hidden` numbers per rank) and each rank adds, in rank order, the rows that fall into its own
//! slice of the flattened table (a row may straddle two slices; each rank takes its part), with the
//! embedding's row-sum kernel ([`super::embedding_grad`]: no `index_add`).
//!
//! The sum is taken in the accumulation dtype and rounded once to the gradient's dtype, as one rank's
//! [`Embedding`] backward rounds its sum, then widened to the reduction dtype the optimizer gets. The lookups of
//! a padding row (`padding_idx`) add nothing, as in [`Embedding`].

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::embedding::Embedding;
use super::embedding_grad::row_sums;
use crate::precision::Precision;
use crate::shard::{ParamShard, ShardLevel};
use crate::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// `table[ids]` for a sharded table: inputs `ids: [..]` (u32 or i64) and this rank's slice `[chunk]` (the
/// parameter's leaf) -> `[.., hidden]`; backward gives the slice's gradient `[chunk]` in the reduction dtype.
/// Forward and backward are collective over the shard's group.
#[derive(Debug)]
pub struct ShardedEmbedding {
    /// The table's sharding (its whole shape is `[vocab, hidden]`).
    pub shard: Arc<ParamShard>,
    /// The table as stored (whole at `Gradients`, where forward reads it instead of gathering).
    pub stored: Tensor,
    /// The row whose lookups add nothing to the gradient (`nn.Embedding`'s `padding_idx`).
    pub padding_idx: Option<usize>,
}

impl Op for ShardedEmbedding {
    fn name(&self) -> &'static str {
        "sharded_embedding"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Embedding
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        match self.shard.level {
            ShardLevel::Parameters => Ok(vec![slice_rows(&self.shard, i[0], i[1])?]),
            _ => Embedding { padding_idx: self.padding_idx }.forward(&[i[0], &self.stored]),
        }
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        Ok(vec![None, Some(slice_grad(&self.shard, &s.input(0)?.flatten_all()?, g, self.padding_idx)?)])
    }
}

/// The rows of `ids: [..]` (u32 or i64) from a table sharded at `Parameters`, `slice: [chunk]` this rank's
/// slice -> `[.., hidden]` in the table's dtype, without the whole table: every rank's ids are gathered, each
/// rank fills the parts of those rows its slice holds, and a reduce-scatter sums the parts (one rank's value
/// and zeros: exact) into each rank's own rows. Collective over the shard's group; `ids` must be below the
/// vocabulary (checked by the caller).
pub fn slice_rows(shard: &ParamShard, ids: &Tensor, slice: &Tensor) -> Result<Tensor> {
    let (vocab, hidden) = shard.shape.dims2()?;
    let group = shard.group.as_ref();
    let t = ids.elem_count();
    // The ids as floats of the accumulation dtype (exact below 2^24 in f32), padded with -1 to the most any
    // rank holds.
    let acc = Precision::float(slice.dtype()).accumulate();
    if vocab as f64 >= f64::from(1u32 << 24) && acc == DType::F32 {
        return Err(Error::InvalidArgument {
            op: "sharded_embedding",
            msg: format!(
                "a table of {vocab} rows is past the ids f32 carries exactly: use an f64 model or --shard optimizer"
            ),
        });
    }
    // The counts are host data (made and gathered on the host).
    let counts = group.all_gather(&Tensor::new(&[t as f64], &Device::Cpu)?, 0)?.to_vec1::<f64>()?;
    let most = counts.iter().fold(0.0f64, |a, &b| a.max(b)) as usize;
    let mut mine = ids.flatten_all()?.to_dtype(acc)?;
    if most > t {
        mine = Tensor::cat(&[&mine, &Tensor::full(-1.0f32, most - t, ids.device())?.to_dtype(acc)?], 0)?;
    }
    let all = group.all_gather(&mine.contiguous()?, 0)?;
    let owned = shard.layout.owned();
    let part = owned_parts(&all, &slice.narrow(0, 0, owned.len())?, owned.start, hidden)?;
    // Summed in the accumulation dtype (every back end reduces it) and narrowed back: exact, as each element
    // is one rank's value and zeros.
    let parts = part.to_dtype(acc)?.reshape((group.size(), most, hidden))?;
    let rows = group.reduce_scatter(&parts, 0, crate::comm::ReduceOp::Sum)?.reshape((most, hidden))?;
    let rows = rows.to_dtype(slice.dtype())?;
    let mut dims = ids.dims().to_vec();
    dims.push(hidden);
    Ok(rows.narrow(0, 0, t)?.contiguous()?.reshape(dims)?)
}

/// This rank's slice `[chunk]` of the table's gradient, summed over every rank's tokens but those of
/// `padding_idx`: `ids: [t]`, `g: [.., hidden]` with `t` rows. Collective over the shard's group.
fn slice_grad(shard: &ParamShard, ids: &Tensor, g: &Tensor, padding_idx: Option<usize>) -> Result<Tensor> {
    let (vocab, hidden) = shard.shape.dims2()?;
    let precision = Precision::float(g.dtype());
    let acc = precision.accumulate();
    let group = shard.group.as_ref();
    let t = ids.elem_count();
    // Ranks may hold different token counts: pad every rank's rows to the largest with the id -1. The counts
    // are host data (made and gathered on the host).
    // The counts are host data (made and gathered on the host).
    let counts = group.all_gather(&Tensor::new(&[t as f64], &Device::Cpu)?, 0)?.to_vec1::<f64>()?;
    let most = counts.iter().fold(0.0f64, |a, &b| a.max(b)) as usize;
    if vocab as f64 >= f64::from(1u32 << 24) && acc == DType::F32 {
        return Err(Error::InvalidArgument {
            op: "sharded_embedding",
            msg: format!(
                "a table of {vocab} rows is past the ids f32 carries exactly: use an f64 model or --shard optimizer"
            ),
        });
    }
    // One [most, hidden + 1] block per rank: the gradient rows and, last, the id (as a float of `acc`).
    let rows = g.reshape((t, hidden))?.to_dtype(acc)?;
    let id_col = ids.to_dtype(acc)?.reshape((t, 1))?;
    let mut block = Tensor::cat(&[&rows, &id_col], 1)?;
    if most > t {
        let pad_ids = Tensor::full(-1.0f32, (most - t, 1), g.device())?.to_dtype(acc)?;
        let pad = Tensor::cat(&[&Tensor::zeros((most - t, hidden), acc, g.device())?, &pad_ids], 1)?;
        block = Tensor::cat(&[&block, &pad], 0)?;
    }
    let all = group.all_gather(&block.contiguous()?, 0)?;
    // The rows of the table this rank's flat slice touches: [lo, hi).
    let owned = shard.layout.owned();
    let (lo, hi) = (owned.start / hidden, owned.end.div_ceil(hidden));
    // Every gathered row is added on the device (no host read): a row whose id falls in [lo, hi) to its row of
    // the part, the others (and the pad, id -1) sent to the spare id past the end, where they add nothing. Ids
    // are exact in `acc` (checked above), so `id - lo` is an exact whole number.
    let ids = all.narrow(1, hidden, 1)?.flatten_all()?;
    let mut inside = ids.ge(lo as f64)?.mul(&ids.lt(hi as f64)?)?;
    if let Some(p) = padding_idx.filter(|&p| (lo..hi).contains(&p)) {
        // The padding row's lookups go to the spare row too.
        inside = inside.mul(&ids.ne(p as f64)?)?;
    }
    let spare = Tensor::full((hi - lo) as f32, ids.shape(), g.device())?.to_dtype(acc)?;
    let local = inside.where_cond(&(ids - lo as f64)?, &spare)?.to_dtype(DType::U32)?;
    let rows = all.narrow(1, 0, hidden)?.contiguous()?;
    // Each row's sum in `acc`, rounded once to the gradient's dtype (the spare id, hi - lo, adds nothing).
    let part = row_sums(&local, &rows, hi - lo, g.dtype())?;
    // The owned elements of those rows, padded to the slice's length.
    let part = part.flatten_all()?.narrow(0, owned.start - lo * hidden, owned.len())?;
    let part = part.to_dtype(precision.reduce())?;
    let pad = shard.layout.chunk - owned.len();
    Ok(if pad > 0 { part.pad_with_zeros(0, 0, pad)? } else { part.contiguous()? })
}

/// The parts of the table rows `ids: [t]` (row numbers as floats; negative: none) that the flat slice `owned:
/// [len]`, starting at flat element `start` of a table of `hidden` columns, holds: `[t, hidden]` in the slice's
/// dtype, zero wherever the slice does not reach. Two ways with the same bits, whichever allocates less: while
/// the rows are fewer than the slice holds ([`picked_parts`]: about three `[t, hidden]` buffers), only they
/// are copied; at long context, where they are more, the slice is padded to whole rows once
/// ([`padded_parts`]: the slice's length and one `[t, hidden]`).
fn owned_parts(ids: &Tensor, owned: &Tensor, start: usize, hidden: usize) -> Result<Tensor> {
    if 3 * ids.elem_count() * hidden <= owned.elem_count() {
        picked_parts(ids, owned, start, hidden)
    } else {
        padded_parts(ids, owned, start, hidden)
    }
}

/// [`owned_parts`] from the slice padded with zeros to the whole rows it touches, plus one zero row (the
/// spare) for the ids of other rows and the padding.
fn padded_parts(ids: &Tensor, owned: &Tensor, start: usize, hidden: usize) -> Result<Tensor> {
    let (lo, hi) = (start / hidden, (start + owned.elem_count()).div_ceil(hidden));
    let before = start - lo * hidden;
    let after = (hi + 1 - lo) * hidden - before - owned.elem_count();
    let part = owned.pad_with_zeros(0, before, after)?.reshape((hi + 1 - lo, hidden))?;
    let inside = ids.ge(lo as f64)?.mul(&ids.lt(hi as f64)?)?;
    let spare = Tensor::full((hi - lo) as f32, ids.shape(), ids.device())?.to_dtype(ids.dtype())?;
    let local = inside.where_cond(&(ids - lo as f64)?, &spare)?.to_dtype(DType::U32)?;
    Ok(part.index_select(&local, 0)?)
}

/// [`owned_parts`] copying only the rows asked for: the rows wholly inside the slice are picked from a view of
/// it, and the one or two rows it cuts (at its two ends) are padded alone.
fn picked_parts(ids: &Tensor, owned: &Tensor, start: usize, hidden: usize) -> Result<Tensor> {
    let t = ids.elem_count();
    let end = start + owned.elem_count();
    let mut out = Tensor::zeros((t, hidden), owned.dtype(), owned.device())?;
    if end == start {
        return Ok(out);
    }
    let mask = |m: Tensor| -> Result<Tensor> { Ok(m.unsqueeze(1)?.broadcast_as((t, hidden))?) };
    // Rows [f0, f1) lie wholly inside the slice.
    let (f0, f1) = (start.div_ceil(hidden), end / hidden);
    if f1 > f0 {
        let whole = owned.narrow(0, f0 * hidden - start, (f1 - f0) * hidden)?.reshape((f1 - f0, hidden))?;
        let inside = ids.ge(f0 as f64)?.mul(&ids.lt(f1 as f64)?)?;
        let local = inside.where_cond(&(ids - f0 as f64)?, &ids.zeros_like()?)?.to_dtype(DType::U32)?;
        out = mask(inside)?.where_cond(&whole.index_select(&local, 0)?, &out)?;
    }
    // The rows the slice cuts: its first and its last (one row when the slice lies within it).
    let (lo, hi) = (start / hidden, end.div_ceil(hidden));
    let mut cut = vec![lo, hi - 1];
    cut.dedup();
    for r in cut.into_iter().filter(|&r| r < f0 || r >= f1) {
        let (a, b) = ((r * hidden).max(start), ((r + 1) * hidden).min(end));
        let row = owned.narrow(0, a - start, b - a)?.pad_with_zeros(0, a - r * hidden, (r + 1) * hidden - b)?;
        out = mask(ids.eq(r as f64)?)?.where_cond(&row.reshape((1, hidden))?.broadcast_as((t, hidden))?, &out)?;
    }
    Ok(out)
}

/// Rows of the sharded `table` for `ids: [..]` -> `[.., hidden]`, recorded as one [`ShardedEmbedding`] on the
/// table's slice leaf, the row `padding_idx` (when given) getting no gradient from the lookup. A tape that does
/// not record takes the rows by [`slice_rows`] at `Parameters` (the table is never whole there either). `None`
/// when the table is not sharded at `Gradients` or `Parameters`, or the tape does not record and the table is
/// stored whole (`Gradients`): use [`super::embedding::embedding_padded`] with [`Tape::param`] then.
pub fn sharded_embedding(
    tape: &Tape,
    ids: &Value,
    table: &crate::Param,
    padding_idx: Option<usize>,
) -> Result<Option<Value>> {
    if !tape.is_recording() {
        let Some(shard) = table.shard().filter(|s| s.level == ShardLevel::Parameters) else { return Ok(None) };
        if !tape.inputs_checked() {
            super::embedding::check_ids(ids.tensor(), shard.shape.dims()[0])?;
        }
        return Ok(Some(Value::constant(slice_rows(&shard, ids.tensor(), &table.tensor())?)));
    }
    let Some((leaf, shard)) = tape.param_slice(table)? else { return Ok(None) };
    if !tape.inputs_checked() {
        super::embedding::check_ids(ids.tensor(), shard.shape.dims()[0])?;
    }
    let op = ShardedEmbedding { shard, stored: table.tensor(), padding_idx };
    Ok(Some(tape.apply(op, &[ids, &leaf])?.remove(0)))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// `owned_parts`, both its ways, against the whole table with the elements outside the slice zeroed, for
    /// every slice of a 4 x 5 table (slices within one row, across one or two row ends, aligned or not, empty)
    /// and ids inside, outside and -1.
    #[test]
    fn owned_parts_are_the_slices_share_of_each_row() {
        let (vocab, hidden) = (4usize, 5usize);
        let table: Vec<f64> = (0..vocab * hidden).map(|i| i as f64 + 0.5).collect();
        let ids = Tensor::new(&[3f64, 0., -1., 1., 2., 1., 3.], &Device::Cpu).unwrap();
        for start in 0..=vocab * hidden {
            for end in start..=vocab * hidden {
                let owned = Tensor::from_vec(table[start..end].to_vec(), end - start, &Device::Cpu).unwrap();
                let picked = picked_parts(&ids, &owned, start, hidden).unwrap().to_vec2::<f64>().unwrap();
                let padded = padded_parts(&ids, &owned, start, hidden).unwrap().to_vec2::<f64>().unwrap();
                let chosen = owned_parts(&ids, &owned, start, hidden).unwrap().to_vec2::<f64>().unwrap();
                assert_eq!(chosen, if 3 * 7 * hidden <= end - start { &picked } else { &padded }.clone());
                for (k, &id) in ids.to_vec1::<f64>().unwrap().iter().enumerate() {
                    let want: Vec<f64> = (0..hidden)
                        .map(|c| {
                            let flat = id as i64 * hidden as i64 + c as i64;
                            let held = id >= 0. && (start as i64..end as i64).contains(&flat);
                            if held {
                                table[flat as usize]
                            } else {
                                0.
                            }
                        })
                        .collect();
                    assert_eq!(picked[k], want, "picked, slice [{start}, {end}), id {id}");
                    assert_eq!(padded[k], want, "padded, slice [{start}, {end}), id {id}");
                }
            }
        }
    }

    use super::*;
    use crate::comm::run_ranks;
    use crate::{CheckpointPolicy, Param};

    /// Two ranks with 4 and 3 tokens (ids repeat, and row 2 straddles the slices of a 5 × 3 table: 15
    /// elements in slices of 8, the last padded), at both levels, without and with row 2 as the padding row:
    /// the lookup equals the whole table's, and each rank's slice gradient equals its slice of the whole
    /// gradient one rank gets from all 7 tokens (f64, to 1e-12: the same sums in another order), row 2's
    /// part zero on both ranks when it is the padding row.
    #[test]
    fn slices_get_their_part_of_the_whole_gradient() {
        for padding_idx in [None, Some(2)] {
            slices_match_one_rank(padding_idx);
        }
    }

    fn slices_match_one_rank(padding_idx: Option<usize>) {
        let (vocab, hidden) = (5usize, 3usize);
        let whole: Vec<f64> = (0..vocab * hidden).map(|i| (i as f64 * 0.37).sin()).collect();
        let table = Tensor::from_vec(whole, (vocab, hidden), &Device::Cpu).unwrap();
        let ids_of = |rank: usize| if rank == 0 { vec![2u32, 3, 2, 0] } else { vec![3u32, 4, 2] };
        let g_of = |rank: usize, t: usize| {
            let v: Vec<f64> = (0..t * hidden).map(|i| ((i + 7 * rank) as f64 * 0.91).cos()).collect();
            Tensor::from_vec(v, (t, hidden), &Device::Cpu).unwrap()
        };
        // The reference: one rank, all tokens, the plain op.
        let tape = Tape::new(CheckpointPolicy::None);
        let leaf = tape.leaf(table.clone());
        let all_ids: Vec<u32> = [ids_of(0), ids_of(1)].concat();
        let ids = tape.constant(Tensor::from_vec(all_ids, 7, &Device::Cpu).unwrap());
        let y = crate::ops::embedding::embedding_padded(&tape, &ids, &leaf, padding_idx).unwrap();
        let dy = Tensor::cat(&[&g_of(0, 4), &g_of(1, 3)], 0).unwrap();
        let loss = crate::ops::sum_all(&tape, &crate::ops::mul(&tape, &y, &tape.constant(dy)).unwrap()).unwrap();
        tape.backward(&loss).unwrap();
        let want = tape.grad(&leaf).unwrap().unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(want[6..9].iter().all(|&v| v == 0.0), padding_idx.is_some(), "row 2 of the reference");
        for level in [ShardLevel::Gradients, ShardLevel::Parameters] {
            let out = run_ranks(2, Duration::from_secs(30), |pg| {
                let p = Param::new("embed", table.clone());
                p.shard_over(level, pg.clone()).unwrap();
                let rank = pg.rank();
                let tape = Tape::new(CheckpointPolicy::None);
                let ids = tape.constant(Tensor::from_vec(ids_of(rank), ids_of(rank).len(), &Device::Cpu).unwrap());
                let y = sharded_embedding(&tape, &ids, &p, padding_idx).unwrap().expect("sharded at this level");
                let rows = table.index_select(ids.tensor(), 0).unwrap();
                assert_eq!(y.tensor().to_vec2::<f64>().unwrap(), rows.to_vec2::<f64>().unwrap());
                let dy = tape.constant(g_of(rank, ids_of(rank).len()));
                let loss = crate::ops::sum_all(&tape, &crate::ops::mul(&tape, &y, &dy).unwrap()).unwrap();
                tape.backward(&loss).unwrap();
                tape.param_grads().get(&p).unwrap().to_vec1::<f64>().unwrap()
            });
            for (rank, got) in out.into_iter().enumerate() {
                let got = got.unwrap();
                assert_eq!(got.len(), 8, "{level}: a slice of ceil(15 / 2)");
                for (j, &v) in got.iter().enumerate() {
                    let w = want.get(rank * 8 + j).copied().unwrap_or(0.0);
                    assert!((v - w).abs() <= 1e-12, "{level} {padding_idx:?} rank {rank} element {j}: {v} vs {w}");
                }
            }
        }
    }
}
