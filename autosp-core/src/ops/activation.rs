//! Pointwise functions: silu, gelu (tanh approximation), exp, log.

use candle_core::Tensor;

use crate::{NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// Which pointwise function a [`Unary`] op applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnaryKind {
    /// `x * sigmoid(x)`.
    Silu,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`: PyTorch's `gelu(approximate="tanh")`, Gemma's
    /// `gelu_pytorch_tanh`.
    GeluTanh,
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
            UnaryKind::GeluTanh => "gelu_tanh",
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
            UnaryKind::GeluTanh => i[0].gelu()?,
            UnaryKind::Exp => i[0].exp()?,
            UnaryKind::Log => i[0].log()?,
        };
        Ok(vec![y])
    }
    fn saves(&self) -> Saves {
        match self.0 {
            UnaryKind::Exp => Saves::outputs(&[0]),
            UnaryKind::Silu | UnaryKind::GeluTanh | UnaryKind::Log => Saves::inputs(&[0]),
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
            UnaryKind::GeluTanh => {
                // y = x/2 (1 + t), t = tanh(u), u = c (x + a x^3):
                // dy/dx = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 a x^2).
                let x = s.input(0)?;
                let (c, a) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
                let x2 = x.sqr()?;
                let t = ((x * (x2.affine(a, 1.0)?))? * c)?.tanh()?;
                let du = (x2.affine(3.0 * a, 1.0)? * c)?;
                let d = (t.affine(0.5, 0.5)? + ((x * 0.5)? * (t.sqr()?.affine(-1.0, 1.0)? * du)?)?)?;
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

/// `gelu(x)` with PyTorch's tanh approximation, elementwise (see [`UnaryKind::GeluTanh`]).
pub fn gelu_tanh(tape: &Tape, x: &Value) -> Result<Value> {
    Ok(tape.apply(Unary(UnaryKind::GeluTanh), &[x])?.remove(0))
}

/// `e^x`, elementwise.
pub fn exp(tape: &Tape, x: &Value) -> Result<Value> {
    Ok(tape.apply(Unary(UnaryKind::Exp), &[x])?.remove(0))
}

/// `ln x`, elementwise.
pub fn log(tape: &Tape, x: &Value) -> Result<Value> {
    Ok(tape.apply(Unary(UnaryKind::Log), &[x])?.remove(0))
}
