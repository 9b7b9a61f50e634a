//! Views and layout changes: reshape, transpose, narrow, cat, contiguous. Their backward reads no tensor,
//! only shapes; transpose and narrow stay views (no copy) forward and backward.

use candle_core::{Shape, Tensor};

use crate::{Error, NodeKind, Op, Result, SavedTensors, Tape, Value};

/// A view or layout change.
#[derive(Debug)]
pub enum View {
    /// To a new shape with the same element count.
    Reshape(Shape),
    /// Swap two dims.
    Transpose(usize, usize),
    /// `len` entries of `dim` from `start`.
    Narrow { dim: usize, start: usize, len: usize },
    /// Concatenation of all inputs along `dim`.
    Cat(usize),
    /// A contiguous copy.
    Contiguous,
}

impl Op for View {
    fn name(&self) -> &'static str {
        match self {
            View::Reshape(_) => "reshape",
            View::Transpose(..) => "transpose",
            View::Narrow { .. } => "narrow",
            View::Cat(_) => "cat",
            View::Contiguous => "contiguous",
        }
    }
    fn kind(&self) -> NodeKind {
        NodeKind::View
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = i[0];
        let y = match self {
            View::Reshape(shape) => {
                if shape.elem_count() != x.elem_count() {
                    return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                        op: "reshape",
                        lhs_name: "input",
                        lhs: x.dims().to_vec(),
                        rhs_name: "target",
                        rhs: shape.dims().to_vec(),
                        hint: "reshape keeps the element count".into(),
                    })));
                }
                x.reshape(shape)?
            }
            View::Transpose(a, b) => x.transpose(*a, *b)?,
            View::Narrow { dim, start, len } => x.narrow(*dim, *start, *len)?,
            View::Cat(dim) => Tensor::cat(i, *dim)?,
            View::Contiguous => x.contiguous()?,
        };
        Ok(vec![y])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let n = s.input_meta.len();
        let Some(g) = &g[0] else { return Ok(vec![None; n]) };
        let dx = match self {
            View::Reshape(_) => g.reshape(s.input_shape(0))?,
            View::Transpose(a, b) => g.transpose(*a, *b)?,
            View::Narrow { dim, start, len } => {
                let full = s.input_shape(0).dims()[*dim];
                g.pad_with_zeros(*dim, *start, full - start - len)?
            }
            View::Cat(dim) => {
                let mut out = Vec::with_capacity(n);
                let mut offset = 0;
                for k in 0..n {
                    let len = s.input_shape(k).dims()[*dim];
                    out.push(Some(g.narrow(*dim, offset, len)?));
                    offset += len;
                }
                return Ok(out);
            }
            View::Contiguous => g.clone(),
        };
        Ok(vec![Some(dx)])
    }
}

fn view(tape: &Tape, v: View, x: &Value) -> Result<Value> {
    Ok(tape.apply(v, &[x])?.remove(0))
}

/// `x` with a new shape of the same element count.
pub fn reshape(tape: &Tape, x: &Value, shape: impl Into<Shape>) -> Result<Value> {
    view(tape, View::Reshape(shape.into()), x)
}

/// `x` with dims `a` and `b` swapped (a view).
pub fn transpose(tape: &Tape, x: &Value, a: usize, b: usize) -> Result<Value> {
    view(tape, View::Transpose(a, b), x)
}

/// `len` entries of `dim` from `start` (a view).
pub fn narrow(tape: &Tape, x: &Value, dim: usize, start: usize, len: usize) -> Result<Value> {
    view(tape, View::Narrow { dim, start, len }, x)
}

/// Concatenation along `dim`.
pub fn cat(tape: &Tape, xs: &[&Value], dim: usize) -> Result<Value> {
    Ok(tape.apply(View::Cat(dim), xs)?.remove(0))
}

/// A contiguous copy of `x` (no copy if already contiguous).
pub fn contiguous(tape: &Tape, x: &Value) -> Result<Value> {
    view(tape, View::Contiguous, x)
}
