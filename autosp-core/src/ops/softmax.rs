//! Softmax over the last dim, computed stably (max subtracted).

use candle_core::{Tensor, D};

use crate::{NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// `softmax(x)` over the last dim.
#[derive(Debug)]
pub struct SoftmaxLastDim;

/// Plain softmax over the last dim of a tensor.
pub fn softmax_last_dim_tensor(x: &Tensor) -> Result<Tensor> {
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

impl Op for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        "softmax_last_dim"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![softmax_last_dim_tensor(i[0])?])
    }
    fn saves(&self) -> Saves {
        Saves::outputs(&[0])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None]) };
        let y = s.output(0)?;
        let dot = (g * y)?.sum_keepdim(D::Minus1)?;
        Ok(vec![Some((y * g.broadcast_sub(&dot)?)?)])
    }
}

/// Softmax over the last dim, any shape.
pub fn softmax_last_dim(tape: &Tape, x: &Value) -> Result<Value> {
    Ok(tape.apply(SoftmaxLastDim, &[x])?.remove(0))
}
