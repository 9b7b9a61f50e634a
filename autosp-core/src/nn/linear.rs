//! [`Linear`]: `y = x W^T + b` with HF-style weights `[out, in]`.

use crate::module::Module;
use crate::{ops, Param, Result, Tape, Value};

/// A linear layer; `weight: [out, in]`, optional `bias: [out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Param,
    pub bias: Option<Param>,
}

impl Linear {
    /// `x: [.., in]` -> `[.., out]`.
    pub fn forward(&self, tape: &Tape, x: &Value) -> Result<Value> {
        let b = self.bias.as_ref().map(|b| tape.param(b)).transpose()?;
        ops::linear(tape, x, &tape.param(&self.weight)?, b.as_ref())
    }
}

impl Module for Linear {
    fn kind(&self) -> &'static str {
        "Linear"
    }
    fn own_params(&self) -> Vec<Param> {
        let mut p = vec![self.weight.clone()];
        p.extend(self.bias.clone());
        p
    }
}
