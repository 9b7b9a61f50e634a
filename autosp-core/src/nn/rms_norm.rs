//! [`RmsNorm`]: the Llama normalisation with a learned scale.

use crate::module::Module;
use crate::{ops, Param, Result, Tape, Value};

/// RMSNorm over the last dim; `weight: [d]`.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub weight: Param,
    pub eps: f64,
}

impl RmsNorm {
    /// `x: [.., d]` -> `[.., d]`.
    pub fn forward(&self, tape: &Tape, x: &Value) -> Result<Value> {
        ops::rms_norm(tape, x, &tape.param(&self.weight)?, self.eps)
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
