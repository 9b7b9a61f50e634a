//! Elementwise arithmetic between two values with broadcasting: add, sub, mul, div.

use candle_core::Tensor;

use super::broadcast::sum_to_shape;
use crate::{NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// Which arithmetic a [`Binary`] op does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryKind {
    Add,
    Sub,
    Mul,
    Div,
}

/// `a (op) b` with numpy-style broadcasting.
#[derive(Debug)]
pub struct Binary(pub BinaryKind);

impl Op for Binary {
    fn name(&self) -> &'static str {
        match self.0 {
            BinaryKind::Add => "add",
            BinaryKind::Sub => "sub",
            BinaryKind::Mul => "mul",
            BinaryKind::Div => "div",
        }
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (a, b) = (i[0], i[1]);
        let y = match self.0 {
            BinaryKind::Add => a.broadcast_add(b)?,
            BinaryKind::Sub => a.broadcast_sub(b)?,
            BinaryKind::Mul => a.broadcast_mul(b)?,
            BinaryKind::Div => a.broadcast_div(b)?,
        };
        Ok(vec![y])
    }
    fn saves(&self) -> Saves {
        match self.0 {
            BinaryKind::Add | BinaryKind::Sub => Saves::NONE,
            BinaryKind::Mul | BinaryKind::Div => Saves::inputs(&[0, 1]),
        }
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let (sa, sb) = (s.input_shape(0), s.input_shape(1));
        let (da, db) = match self.0 {
            BinaryKind::Add => (g.clone(), g.clone()),
            BinaryKind::Sub => (g.clone(), g.neg()?),
            BinaryKind::Mul => {
                let (a, b) = (s.input(0)?, s.input(1)?);
                (g.broadcast_mul(b)?, g.broadcast_mul(a)?)
            }
            BinaryKind::Div => {
                let (a, b) = (s.input(0)?, s.input(1)?);
                let da = g.broadcast_div(b)?;
                let db = da.broadcast_mul(a)?.broadcast_div(b)?.neg()?;
                (da, db)
            }
        };
        Ok(vec![Some(sum_to_shape(&da, sa)?), Some(sum_to_shape(&db, sb)?)])
    }
}

fn binary(tape: &Tape, kind: BinaryKind, a: &Value, b: &Value) -> Result<Value> {
    Ok(tape.apply(Binary(kind), &[a, b])?.remove(0))
}

/// `a + b`, broadcasting.
pub fn add(tape: &Tape, a: &Value, b: &Value) -> Result<Value> {
    binary(tape, BinaryKind::Add, a, b)
}

/// `a - b`, broadcasting.
pub fn sub(tape: &Tape, a: &Value, b: &Value) -> Result<Value> {
    binary(tape, BinaryKind::Sub, a, b)
}

/// `a * b`, broadcasting.
pub fn mul(tape: &Tape, a: &Value, b: &Value) -> Result<Value> {
    binary(tape, BinaryKind::Mul, a, b)
}

/// `a / b`, broadcasting.
pub fn div(tape: &Tape, a: &Value, b: &Value) -> Result<Value> {
    binary(tape, BinaryKind::Div, a, b)
}
