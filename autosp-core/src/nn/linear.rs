//! [`Linear`]: `y = x W^T + b` with HF-style weights `[out, in]`, plus a LoRA adapter's update when it has
//! one ([`LoraAdapter`]).

use super::LoraAdapter;
use crate::module::Module;
use crate::{ops, Param, Result, Tape, Value};

/// A linear layer; `weight: [out, in]`, optional `bias: [out]`, optional LoRA adapter.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Param,
    pub bias: Option<Param>,
    pub lora: Option<LoraAdapter>,
}

impl Linear {
    /// A plain linear layer (no adapter).
    pub fn new(weight: Param, bias: Option<Param>) -> Self {
        Self { weight, bias, lora: None }
    }

    /// `x: [.., in]` -> `[.., out]`.
    pub fn forward(&self, tape: &Tape, x: &Value) -> Result<Value> {
        let b = self.bias.as_ref().map(|b| tape.param(b)).transpose()?;
        let y = ops::linear(tape, x, &tape.param(&self.weight)?, b.as_ref())?;
        match &self.lora {
            Some(lora) => ops::add(tape, &y, &lora.forward(tape, x)?),
            None => Ok(y),
        }
    }
}

impl Module for Linear {
    fn kind(&self) -> &'static str {
        "Linear"
    }
    fn as_linear_mut(&mut self) -> Option<&mut Linear> {
        Some(self)
    }
    fn as_linear(&self) -> Option<&Linear> {
        Some(self)
    }
    fn own_params(&self) -> Vec<Param> {
        let mut p = vec![self.weight.clone()];
        p.extend(self.bias.clone());
        if let Some(l) = &self.lora {
            p.extend([l.a.clone(), l.b.clone()]);
        }
        p
    }
}
