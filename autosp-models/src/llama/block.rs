//! [`LlamaDecoderLayer`]: one pre-norm transformer block, `h = x + attn(norm(x)); y = h + mlp(norm(h))`, or
//! Gemma's sandwich, `h = x + norm(attn(norm(x))); y = h + norm(mlp(norm(h)))`, run inside its
//! [`RegionSlot`] (a checkpoint region named `layers.{i}` once the compile step turns it on).

use autosp_core::module::Module;
use autosp_core::nn::RmsNorm;
use autosp_core::ops::{self, AttentionSpec};
use autosp_core::{RegionSlot, Tape, Value};

use super::attention::{LlamaAttention, RotaryTables};
use super::error::ModelResult;
use super::kv_cache::LayerKv;
use super::mlp::LlamaMlp;
use super::norm::fused_norm;

/// One decoder layer; `input_layernorm, post_attention_layernorm: [hidden]` (and Gemma's
/// `pre_feedforward_layernorm, post_feedforward_layernorm: [hidden]`).
#[derive(Clone, Debug)]
pub struct LlamaDecoderLayer {
    /// The layer's index (names its checkpoint region `layers.{index}`).
    pub index: usize,
    pub input_layernorm: RmsNorm,
    pub self_attn: LlamaAttention,
    /// The norm before the MLP; in Gemma's sandwich (with `feedforward_norms`), the norm of the attention's
    /// output before the residual add.
    pub post_attention_layernorm: RmsNorm,
    pub mlp: LlamaMlp,
    /// Gemma's `pre_feedforward_layernorm` (before the MLP) and `post_feedforward_layernorm` (of its output,
    /// before the residual add).
    pub feedforward_norms: Option<(RmsNorm, RmsNorm)>,
    /// Whether the layer takes the model's local RoPE tables (Gemma 3's sliding layers) when it has them.
    pub local_rope: bool,
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
        let Some((pre_ff, post_ff)) = &self.feedforward_norms else {
            let h = ops::add(tape, x, &a)?;
            let m = self.mlp.forward(tape, &fused_norm(tape, &self.post_attention_layernorm, &h)?)?;
            return Ok(ops::add(tape, &h, &m)?);
        };
        let h = ops::add(tape, x, &fused_norm(tape, &self.post_attention_layernorm, &a)?)?;
        let m = self.mlp.forward(tape, &fused_norm(tape, pre_ff, &h)?)?;
        Ok(ops::add(tape, &h, &fused_norm(tape, post_ff, &m)?)?)
    }
}

impl Module for LlamaDecoderLayer {
    fn kind(&self) -> &'static str {
        "LlamaDecoderLayer"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c = vec![
            ("input_layernorm".into(), &self.input_layernorm as &dyn Module),
            ("self_attn".into(), &self.self_attn),
            ("post_attention_layernorm".into(), &self.post_attention_layernorm),
            ("mlp".into(), &self.mlp),
        ];
        if let Some((pre, post)) = &self.feedforward_norms {
            c.push(("pre_feedforward_layernorm".into(), pre));
            c.push(("post_feedforward_layernorm".into(), post));
        }
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c = vec![
            ("input_layernorm".into(), &mut self.input_layernorm as &mut dyn Module),
            ("self_attn".into(), &mut self.self_attn),
            ("post_attention_layernorm".into(), &mut self.post_attention_layernorm),
            ("mlp".into(), &mut self.mlp),
        ];
        if let Some((pre, post)) = &mut self.feedforward_norms {
            c.push(("pre_feedforward_layernorm".into(), pre));
            c.push(("post_feedforward_layernorm".into(), post));
        }
        c
    }
    fn region_slot(&mut self) -> Option<&mut RegionSlot> {
        Some(&mut self.region)
    }
}
