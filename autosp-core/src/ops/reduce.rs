//! Reductions: sum and mean over chosen dims (with or without keeping them), and the sum of everything.

use candle_core::Tensor;

use crate::{Error, NodeKind, Op, Result, SavedTensors, Tape, Value};

/// Sum (or mean) over `dims`.
#[derive(Debug)]
pub struct Reduce {
    dims: Vec<usize>,
    keepdim: bool,
    mean: bool,
}

impl Reduce {
    fn count(&self, dims: &[usize]) -> usize {
        self.dims.iter().map(|&d| dims[d]).product()
    }
}

impl Op for Reduce {
    fn name(&self) -> &'static str {
        if self.mean {
            "mean"
        } else {
            "sum"
        }
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = i[0];
        if let Some(&d) = self.dims.iter().find(|&&d| d >= x.rank()) {
            return Err(Error::InvalidArgument {
                op: self.name(),
                msg: format!("dim {d} is out of range for shape {:?}", x.dims()),
            });
        }
        let mut y = x.sum_keepdim(self.dims.clone())?;
        if self.mean {
            y = y.affine(1.0 / self.count(x.dims()) as f64, 0.0)?;
        }
        if !self.keepdim {
            let dims: Vec<usize> = (0..x.rank()).filter(|d| !self.dims.contains(d)).map(|d| x.dims()[d]).collect();
            y = y.reshape(dims)?;
        }
        Ok(vec![y])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None]) };
        let shape = s.input_shape(0);
        let kept: Vec<usize> =
            (0..shape.rank()).map(|d| if self.dims.contains(&d) { 1 } else { shape.dims()[d] }).collect();
        let mut dx = g.reshape(kept)?.broadcast_as(shape)?;
        if self.mean {
            dx = dx.affine(1.0 / self.count(shape.dims()) as f64, 0.0)?;
        }
        Ok(vec![Some(dx.contiguous()?)])
    }
}

/// Sum over `dims`; `keepdim` keeps them as size 1.
pub fn sum(tape: &Tape, x: &Value, dims: &[usize], keepdim: bool) -> Result<Value> {
    Ok(tape.apply(Reduce { dims: dims.to_vec(), keepdim, mean: false }, &[x])?.remove(0))
}

/// Mean over `dims`; `keepdim` keeps them as size 1.
pub fn mean(tape: &Tape, x: &Value, dims: &[usize], keepdim: bool) -> Result<Value> {
    Ok(tape.apply(Reduce { dims: dims.to_vec(), keepdim, mean: true }, &[x])?.remove(0))
}

/// Sum of every element: a scalar (shape `[]`).
pub fn sum_all(tape: &Tape, x: &Value) -> Result<Value> {
    let dims: Vec<usize> = (0..x.dims().len()).collect();
    sum(tape, x, &dims, false)
}
