//! [`RmsNorm`]: the Llama normalisation with a learned scale (`x̂ · w`, or Gemma's `x̂ · (1 + w)`).

use crate::module::Module;
use crate::{ops, Param, Result, Tape, Value};

/// RMSNorm over the last dim; `weight: [d]`. The scale is `offset + weight`: `offset` 0 for Llama and most
/// families (the weight is the scale), 1 for Gemma, whose checkpoints store the scale minus one.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub weight: Param,
    pub eps: f64,
    pub offset: f64,
}

impl RmsNorm {
    /// The norm with scale `weight` (`offset` 0).
    pub fn new(weight: Param, eps: f64) -> Self {
        Self { weight, eps, offset: 0.0 }
    }

    /// The scale `offset + weight` on `tape`: `[d]` (the weight itself when `offset` is 0).
    pub fn scale(&self, tape: &Tape) -> Result<Value> {
        let w = tape.param(&self.weight)?;
        if self.offset == 0.0 {
            return Ok(w);
        }
        ops::affine(tape, &w, 1.0, self.offset)
    }

    /// `x: [.., d]` -> `[.., d]`.
    pub fn forward(&self, tape: &Tape, x: &Value) -> Result<Value> {
        ops::rms_norm(tape, x, &self.scale(tape)?, self.eps)
    }
}

impl Module for RmsNorm {
    fn kind(&self) -> &'static str {
        "RmsNorm"
    }
    fn own_params(&self) -> Vec<Param> {
        vec![self.weight.clone()]
    }
}
