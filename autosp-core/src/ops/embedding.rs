//! Embedding lookup: rows of a table by token id; backward scatter-adds into the table's gradient.

use candle_core::Tensor;

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
        let (vocab, hidden) = table.dims2()?;
        let flat = ids.flatten_all()?;
        let max = flat.max(0)?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
        if flat.elem_count() > 0 && max >= vocab as f64 {
            return Err(Error::InvalidArgument {
                op: "embedding",
                msg: format!("token id {max} is out of range for a table of {vocab} rows"),
            });
        }
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
        let g2 = g.reshape((ids.elem_count(), hidden))?.contiguous()?;
        let dt = Tensor::zeros(table, g.dtype(), g.device())?.index_add(&ids, &g2, 0)?;
        Ok(vec![None, Some(dt)])
    }
}

/// Rows of `table: [vocab, hidden]` for `ids: [..]` -> `[.., hidden]`.
pub fn embedding(tape: &Tape, ids: &Value, table: &Value) -> Result<Value> {
    Ok(tape.apply(Embedding, &[ids, table])?.remove(0))
}
