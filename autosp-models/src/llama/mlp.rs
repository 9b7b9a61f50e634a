//! [`LlamaMlp`]: the gated feed-forward block, `down(act(gate(x)) * up(x))`: SwiGLU (`act` = silu), or
//! Gemma's GeGLU (`act` = gelu, tanh approximation). SwiGLU inside a checkpoint region that recomputes (Full,
//! SequenceAware) runs as one chunked op that saves only its input and recomputes the `[n, intermediate]`
//! gate and up projections chunk by chunk in backward; elsewhere (no region, policy None, inference, and
//! GeGLU and LoRA-adapted projections always) as three linears and the gate, keeping every intermediate.

use autosp_core::module::Module;
use autosp_core::nn::Linear;
use autosp_core::{ops, Tape, Value};
use autosp_kernels::mlp::chunked_mlp;
use autosp_kernels::swiglu::swiglu;

use super::error::ModelResult;

/// The gate's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu` (SwiGLU: Llama, Mistral, Qwen, Phi-3).
    Silu,
    /// `gelu` with PyTorch's tanh approximation (GeGLU: Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// The feed-forward block of a decoder layer: `gate_proj, up_proj: [intermediate, hidden]`,
/// `down_proj: [hidden, intermediate]`.
#[derive(Clone, Debug)]
pub struct LlamaMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    pub activation: Activation,
}

/// Tokens per chunk of the chunked MLP: its transient intermediates are a few `[1024, intermediate]` tensors.
pub const MLP_CHUNK_ROWS: usize = 1024;

impl LlamaMlp {
    /// `x: [b, n, hidden]` -> `[b, n, hidden]`.
    pub fn forward(&self, tape: &Tape, x: &Value) -> ModelResult<Value> {
        if self.chunked(tape) {
            let (g, u, d) = (&self.gate_proj.weight, &self.up_proj.weight, &self.down_proj.weight);
            return Ok(chunked_mlp(tape, x, &tape.param(g)?, &tape.param(u)?, &tape.param(d)?, MLP_CHUNK_ROWS)?);
        }
        let gate = self.gate_proj.forward(tape, x)?;
        let up = self.up_proj.forward(tape, x)?;
        let gated = match self.activation {
            Activation::Silu => swiglu(tape, &gate, &up)?,
            Activation::GeluTanh => ops::mul(tape, &ops::gelu_tanh(tape, &gate)?, &up)?,
        };
        Ok(self.down_proj.forward(tape, &gated)?)
    }

    /// Whether to run as the chunked op: inside a recomputing region, only SwiGLU, and only without biases
    /// (Llama's MLP has none) or LoRA adapters (which run as linears of their own).
    fn chunked(&self, tape: &Tape) -> bool {
        let plain =
            [&self.gate_proj, &self.up_proj, &self.down_proj].iter().all(|l| l.bias.is_none() && l.lora.is_none());
        tape.region_recomputes() && plain && self.activation == Activation::Silu
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
