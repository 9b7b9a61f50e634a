//! Ops with a scalar operand: `affine` (`x * mul + add`, which covers scaling and shifting) and `powf`.

use candle_core::Tensor;

use crate::{NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// `y = x * mul + add`.
#[derive(Debug)]
pub struct Affine {
    mul: f64,
    add: f64,
}

impl Op for Affine {
    fn name(&self) -> &'static str {
        "affine"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![i[0].affine(self.mul, self.add)?])
    }
    fn backward(&self, _: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![g[0].as_ref().map(|g| g.affine(self.mul, 0.0)).transpose()?])
    }
}

/// `x * mul + add`, any shape.
pub fn affine(tape: &Tape, x: &Value, mul: f64, add: f64) -> Result<Value> {
    Ok(tape.apply(Affine { mul, add }, &[x])?.remove(0))
}

/// `x * s`, any shape.
pub fn scale(tape: &Tape, x: &Value, s: f64) -> Result<Value> {
    affine(tape, x, s, 0.0)
}

/// `y = x^e` (elementwise; `x > 0` unless `e` is an integer).
#[derive(Debug)]
pub struct Powf {
    e: f64,
}

impl Op for Powf {
    fn name(&self) -> &'static str {
        "powf"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![i[0].powf(self.e)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None]) };
        let d = s.input(0)?.powf(self.e - 1.0)?.affine(self.e, 0.0)?;
        Ok(vec![Some((g * d)?)])
    }
}

/// `x^e`, elementwise.
pub fn powf(tape: &Tape, x: &Value, e: f64) -> Result<Value> {
    Ok(tape.apply(Powf { e }, &[x])?.remove(0))
}
