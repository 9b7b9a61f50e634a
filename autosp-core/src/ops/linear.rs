//! Matrix products: `linear` (a layer's `x W^T + b`) and batched, broadcasting `matmul`.

use candle_core::Tensor;

use super::broadcast::sum_to_shape;
use crate::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// `y = x W^T (+ b)`: `x: [.., in]`, `w: [out, in]`, `b: [out]`, `y: [.., out]`.
#[derive(Debug)]
pub struct Linear {
    bias: bool,
}

fn flat(x: &Tensor) -> Result<Tensor> {
    let last = x.dim(candle_core::D::Minus1)?;
    Ok(x.reshape((x.elem_count() / last.max(1), last))?)
}

impl Op for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Linear
    }
    fn forward(&self, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (x, w) = (inputs[0], inputs[1]);
        let (out, inn) = w.dims2()?;
        if x.rank() == 0 || x.dim(candle_core::D::Minus1)? != inn {
            return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                op: "linear",
                lhs_name: "x",
                lhs: x.dims().to_vec(),
                rhs_name: "weight",
                rhs: w.dims().to_vec(),
                hint: format!("x's last dim must equal the weight's in_features ({inn})"),
            })));
        }
        let mut y = flat(x)?.matmul(&w.t()?)?;
        if self.bias {
            let b = inputs[2];
            if b.dims() != [out] {
                return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                    op: "linear",
                    lhs_name: "bias",
                    lhs: b.dims().to_vec(),
                    rhs_name: "weight",
                    rhs: w.dims().to_vec(),
                    hint: format!("the bias must be [out_features] = [{out}]"),
                })));
            }
            y = y.broadcast_add(b)?;
        }
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank checked") = out;
        Ok(vec![y.reshape(dims)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 2 + self.bias as usize]) };
        let (x, w) = (s.input(0)?, s.input(1)?);
        let g2 = flat(g)?;
        let dx = if s.needs_grad(0) { Some(g2.matmul(w)?.reshape(x.shape())?) } else { None };
        // A frozen weight (LoRA's base) takes no gradient: its product, as large as dx's, is skipped.
        let dw = if s.needs_grad(1) { Some(g2.t()?.matmul(&flat(x)?)?) } else { None };
        let mut out = vec![dx, dw];
        if self.bias {
            out.push(if s.needs_grad(2) { Some(g2.sum(0)?) } else { None });
        }
        Ok(out)
    }
}

/// `y = x W^T (+ b)`: `x: [.., in]`, `w: [out, in]`, `b: [out]` -> `[.., out]`.
pub fn linear(tape: &Tape, x: &Value, w: &Value, b: Option<&Value>) -> Result<Value> {
    let mut inputs = vec![x, w];
    inputs.extend(b);
    Ok(tape.apply(Linear { bias: b.is_some() }, &inputs)?.remove(0))
}

/// Batched matrix product with broadcast batch dims: `a: [.., m, k]`, `b: [.., k, n]` -> `[.., m, n]`.
#[derive(Debug)]
pub struct Matmul;

impl Op for Matmul {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Linear
    }
    fn forward(&self, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (a, b) = (inputs[0], inputs[1]);
        if a.rank() < 2 || b.rank() < 2 || a.dim(candle_core::D::Minus1)? != b.dim(candle_core::D::Minus2)? {
            return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                op: "matmul",
                lhs_name: "a",
                lhs: a.dims().to_vec(),
                rhs_name: "b",
                rhs: b.dims().to_vec(),
                hint: "matmul takes [.., m, k] x [.., k, n]".into(),
            })));
        }
        Ok(vec![a.broadcast_matmul(b)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let (a, b) = (s.input(0)?, s.input(1)?);
        let da = sum_to_shape(&g.broadcast_matmul(&b.t()?)?, a.shape())?;
        let db = sum_to_shape(&a.t()?.broadcast_matmul(g)?, b.shape())?;
        Ok(vec![Some(da), Some(db)])
    }
}

/// Batched matrix product: `a: [.., m, k]`, `b: [.., k, n]` -> `[.., m, n]` (batch dims broadcast).
pub fn matmul(tape: &Tape, a: &Value, b: &Value) -> Result<Value> {
    Ok(tape.apply(Matmul, &[a, b])?.remove(0))
}
