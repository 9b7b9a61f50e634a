//! Pointwise functions: silu, exp, log.

use candle_core::Tensor;

use crate::{NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// Which pointwise function a [`Unary`] op applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryKind {
    /// `x * sigmoid(x)`.
    Silu,
    /// `e^x`.
    Exp,
    /// Natural log.
    Log,
}

/// A pointwise function.
#[derive(Debug)]
pub struct Unary(pub UnaryKind);

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    Ok((x.neg()?.exp()? + 1.0)?.recip()?)
}

impl Op for Unary {
    fn name(&self) -> &'static str {
        match self.0 {
            UnaryKind::Silu => "silu",
            UnaryKind::Exp => "exp",
            UnaryKind::Log => "log",
        }
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let y = match self.0 {
            UnaryKind::Silu => i[0].silu()?,
            UnaryKind::Exp => i[0].exp()?,
            UnaryKind::Log => i[0].log()?,
        };
        Ok(vec![y])
    }
    fn saves(&self) -> Saves {
        match self.0 {
            UnaryKind::Exp => Saves::outputs(&[0]),
            UnaryKind::Silu | UnaryKind::Log => Saves::inputs(&[0]),
        }
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None]) };
        let dx = match self.0 {
            UnaryKind::Silu => {
                let x = s.input(0)?;
                let sg = sigmoid(x)?;
                // d/dx x*s(x) = s(x) * (1 + x * (1 - s(x)))
                let d = (&sg * ((x * sg.affine(-1.0, 1.0)?)? + 1.0)?)?;
                (g * d)?
            }
            UnaryKind::Exp => (g * s.output(0)?)?,
            UnaryKind::Log => (g / s.input(0)?)?,
        };
        Ok(vec![Some(dx)])
    }
}

/// `x * sigmoid(x)`, elementwise.
pub fn silu(tape: &Tape, x: &Value) -> Result<Value> {
    Ok(tape.apply(Unary(UnaryKind::Silu), &[x])?.remove(0))
}

/// `e^x`, elementwise.
pub fn exp(tape: &Tape, x: &Value) -> Result<Value> {
    Ok(tape.apply(Unary(UnaryKind::Exp), &[x])?.remove(0))
}

/// `ln x`, elementwise.
pub fn log(tape: &Tape, x: &Value) -> Result<Value> {
    Ok(tape.apply(Unary(UnaryKind::Log), &[x])?.remove(0))
}
