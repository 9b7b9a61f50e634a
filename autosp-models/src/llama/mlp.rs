//! [`LlamaMlp`]: the SwiGLU feed-forward block, `down(silu(gate(x)) * up(x))`.

use autosp_core::module::Module;
use autosp_core::nn::Linear;
use autosp_core::{Tape, Value};
use autosp_kernels::fused::swiglu::swiglu;

use super::error::ModelResult;

/// The feed-forward block of a decoder layer: `gate_proj, up_proj: [intermediate, hidden]`,
/// `down_proj: [hidden, intermediate]`.
#[derive(Clone, Debug)]
pub struct LlamaMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl LlamaMlp {
    /// `x: [b, n, hidden]` -> `[b, n, hidden]`.
    pub fn forward(&self, tape: &Tape, x: &Value) -> ModelResult<Value> {
        let gate = self.gate_proj.forward(tape, x)?;
        let up = self.up_proj.forward(tape, x)?;
        Ok(self.down_proj.forward(tape, &swiglu(tape, &gate, &up)?)?)
    }
}

impl Module for LlamaMlp {
    fn kind(&self) -> &'static str {
        "LlamaMlp"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("gate_proj".into(), &self.gate_proj as &dyn Module),
            ("up_proj".into(), &self.up_proj),
            ("down_proj".into(), &self.down_proj),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("gate_proj".into(), &mut self.gate_proj as &mut dyn Module),
            ("up_proj".into(), &mut self.up_proj),
            ("down_proj".into(), &mut self.down_proj),
        ]
    }
}
