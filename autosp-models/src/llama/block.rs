//! [`LlamaDecoderLayer`]: one pre-norm transformer block, `h = x + attn(norm(x)); y = h + mlp(norm(h))`,
//! run inside its [`RegionSlot`] (a checkpoint region named `layers.{i}` once the compile step turns it on).

use autosp_core::module::Module;
use autosp_core::nn::RmsNorm;
use autosp_core::ops::{self, AttentionSpec};
use autosp_core::{RegionSlot, Tape, Value};

use super::attention::{LlamaAttention, RotaryTables};
use super::error::ModelResult;
use super::kv_cache::LayerKv;
use super::mlp::LlamaMlp;

/// One decoder layer; `input_layernorm, post_attention_layernorm: [hidden]`.
#[derive(Clone, Debug)]
pub struct LlamaDecoderLayer {
    /// The layer's index (names its checkpoint region `layers.{index}`).
    pub index: usize,
    pub input_layernorm: RmsNorm,
    pub self_attn: LlamaAttention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: LlamaMlp,
    /// Whether the layer runs in a checkpoint region (off until the compile step turns it on).
    pub region: RegionSlot,
}

impl LlamaDecoderLayer {
    /// `x: [b, n, hidden]` -> `[b, n, hidden]` (see [`LlamaAttention::forward`] for `rot`, `spec`, `cache`).
    pub fn forward(
        &self,
        tape: &Tape,
        x: &Value,
        rot: &RotaryTables,
        spec: &AttentionSpec,
        cache: Option<&mut LayerKv>,
    ) -> ModelResult<Value> {
        let name = format!("layers.{}", self.index);
        self.region.run(tape, &name, |t| Ok(self.body(t, x, rot, spec, cache)))?
    }

    fn body(
        &self,
        tape: &Tape,
        x: &Value,
        rot: &RotaryTables,
        spec: &AttentionSpec,
        cache: Option<&mut LayerKv>,
    ) -> ModelResult<Value> {
        let a = self.self_attn.forward(tape, &fused_norm(tape, &self.input_layernorm, x)?, rot, spec, cache)?;
        let h = ops::add(tape, x, &a)?;
        let m = self.mlp.forward(tape, &fused_norm(tape, &self.post_attention_layernorm, &h)?)?;
        Ok(ops::add(tape, &h, &m)?)
    }
}

impl Module for LlamaDecoderLayer {
    fn kind(&self) -> &'static str {
        "LlamaDecoderLayer"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("input_layernorm".into(), &self.input_layernorm as &dyn Module),
            ("self_attn".into(), &self.self_attn),
            ("post_attention_layernorm".into(), &self.post_attention_layernorm),
            ("mlp".into(), &self.mlp),
        ]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![
            ("input_layernorm".into(), &mut self.input_layernorm as &mut dyn Module),
            ("self_attn".into(), &mut self.self_attn),
            ("post_attention_layernorm".into(), &mut self.post_attention_layernorm),
            ("mlp".into(), &mut self.mlp),
        ]
    }
    fn region_slot(&mut self) -> Option<&mut RegionSlot> {
        Some(&mut self.region)
    }
}

/// RMSNorm through the fused kernel: `x: [.., d]` -> `[.., d]`.
pub(crate) fn fused_norm(tape: &Tape, norm: &autosp_core::nn::RmsNorm, x: &Value) -> autosp_core::Result<Value> {
    autosp_kernels::rms_norm::rms_norm(tape, x, &tape.param(&norm.weight)?, norm.eps)
}
