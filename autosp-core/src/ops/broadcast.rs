//! Reducing a gradient back to the shape of an input that was broadcast in the forward pass.

use candle_core::{Shape, Tensor};

use crate::{Error, Result};

/// Sums `g` over the dimensions along which an input of `shape` was broadcast to `g`'s shape.
pub fn sum_to_shape(g: &Tensor, shape: &Shape) -> Result<Tensor> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let (gd, sd) = (g.dims(), shape.dims());
    if gd.len() < sd.len() {
        return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
            op: "sum_to_shape",
            lhs_name: "gradient",
            lhs: gd.to_vec(),
            rhs_name: "input",
            rhs: sd.to_vec(),
            hint: "a gradient has at least as many dims as the input it flows to".into(),
        })));
    }
    let extra = gd.len() - sd.len();
    let mut g = if extra > 0 { g.sum((0..extra).collect::<Vec<_>>())? } else { g.clone() };
    let ones: Vec<usize> = (0..sd.len()).filter(|&i| sd[i] == 1 && g.dims()[i] != 1).collect();
    if !ones.is_empty() {
        g = g.sum_keepdim(ones)?;
    }
    Ok(g.reshape(shape)?)
}
