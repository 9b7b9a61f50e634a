//! Embedding lookup: rows of a table by token id; backward scatter-adds into the table's gradient (in f32 for
//! bf16/f16 tables, so a token seen many times does not lose its later contributions to bf16 rounding).

use candle_core::Tensor;

use crate::precision::Precision;
use crate::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// `table[ids]`: `ids: [..]` (u32 or i64), `table: [vocab, hidden]` -> `[.., hidden]`.
#[derive(Debug)]
pub struct Embedding;

impl Op for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Embedding
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (ids, table) = (i[0], i[1]);
        let (_, hidden) = table.dims2()?;
        let flat = ids.flatten_all()?;
        let mut dims = ids.dims().to_vec();
        dims.push(hidden);
        Ok(vec![table.index_select(&flat, 0)?.reshape(dims)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let ids = s.input(0)?.flatten_all()?;
        let table = s.input_shape(1);
        let hidden = table.dims()[1];
        // Sums over repeated ids in the accumulation dtype, rounded once to the gradient's dtype at the end.
        let acc = Precision::float(g.dtype()).accumulate();
        let g2 = g.reshape((ids.elem_count(), hidden))?.to_dtype(acc)?.contiguous()?;
        let dt = Tensor::zeros(table, acc, g.device())?.index_add(&ids, &g2, 0)?.to_dtype(g.dtype())?;
        Ok(vec![None, Some(dt)])
    }
}

/// Rows of `table: [vocab, hidden]` for `ids: [..]` -> `[.., hidden]`.
/// Unless the caller checked the ids on the host ([`Tape::inputs_checked`]), refuses an id past the table
/// (one host read of the largest id).
pub fn embedding(tape: &Tape, ids: &Value, table: &Value) -> Result<Value> {
    if !tape.inputs_checked() {
        check_ids(ids.tensor(), table.tensor().dim(0)?)?;
    }
    Ok(tape.apply(Embedding, &[ids, table])?.remove(0))
}

/// Refuses an id of `ids` (any shape, integer) at or past `vocab` rows, reading back only the largest id.
pub(crate) fn check_ids(ids: &Tensor, vocab: usize) -> Result<()> {
    if ids.elem_count() == 0 {
        return Ok(());
    }
    let max = crate::host_read::read_f64(&ids.flatten_all()?.max_keepdim(0)?)?;
    if max >= vocab as f64 {
        return Err(Error::InvalidArgument {
            op: "embedding",
            msg: format!("token id {max} is out of range for a table of {vocab} rows"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CheckpointPolicy;
    use candle_core::{DType, Device};

    /// 300 lookups of one token with gradient 1 each: the table's gradient row is 300 (exact in bf16), where
    /// a bf16 running sum would stop at 256 (256 + 1 rounds back to 256).
    #[test]
    fn repeated_ids_sum_in_f32_for_bf16_tables() {
        let tape = Tape::new(CheckpointPolicy::None);
        let table = tape.leaf(Tensor::zeros((4, 2), DType::BF16, &Device::Cpu).unwrap());
        let ids = tape.constant(Tensor::from_vec(vec![3u32; 300], 300, &Device::Cpu).unwrap());
        let y = embedding(&tape, &ids, &table).unwrap();
        let loss = crate::ops::sum_all(&tape, &y).unwrap();
        tape.backward(&loss).unwrap();
        let g = tape.grad(&table).unwrap().unwrap();
        assert_eq!(g.dtype(), DType::BF16);
        let rows = g.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(rows, vec![vec![0.0, 0.0], vec![0.0, 0.0], vec![0.0, 0.0], vec![300.0, 300.0]]);
    }
}
