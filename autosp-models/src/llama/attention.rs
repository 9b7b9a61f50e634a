//! [`LlamaAttention`]: the self-attention of a decoder layer — q/k/v projections (with Qwen2's biases when
//! the config has them), Qwen3's and Gemma 3's per-head q/k RMSNorm, Gemma 3's softmax scale, RoPE at
//! explicit positions, the layer's own window (Mistral's, Qwen's, Phi-3's and Gemma 3's `sliding_window`), the
//! attention held in an [`AttentionSlot`] (GQA/MQA is the slot's job: k/v keep their `kv_heads`), and the
//! output projection.

use std::sync::Arc;

use autosp_core::module::Module;
use autosp_core::nn::{Linear, RmsNorm};
use autosp_core::ops::{self, AttentionSpec};
use autosp_core::{AttentionSlot, Tape, Value};
use autosp_kernels::rope::rope;
use autosp_kernels::LocalAttention;

use super::error::ModelResult;
use super::kv_cache::LayerKv;

/// RoPE tables for the tokens of one forward: `cos, sin: [seq, head_dim / 2]` (constants on the tape).
#[derive(Clone, Debug)]
pub struct RotaryTables {
    pub cos: Value,
    pub sin: Value,
}

/// Self-attention: `q_proj: [heads * head_dim, hidden]`, `k_proj, v_proj: [kv_heads * head_dim, hidden]`,
/// `o_proj: [hidden, heads * head_dim]`; with q/k norms (Qwen3, Gemma 3) `q_norm, k_norm: [head_dim]`.
#[derive(Clone, Debug)]
pub struct LlamaAttention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// RMSNorm of each query head before RoPE (Qwen3, Gemma 3), with `k_norm` of each key head.
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    /// The layer's own attention window from the checkpoint (a query sees keys at most this many positions
    /// back; [`AttentionSpec::max_distance`]), applied to every spec the layer runs: a window the compile step
    /// or the caller adds narrows it, never widens it.
    pub window: Option<usize>,
    /// The softmax scale when it is not `1 / sqrt(head_dim)` (Gemma 3's `query_pre_attn_scalar^-0.5`).
    pub scale: Option<f64>,
    /// The attention implementation; naive until the compile step fills it.
    pub attention: AttentionSlot,
}

impl LlamaAttention {
    /// Builds the block from its projections, with the naive attention in its slot.
    pub fn new(
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
        o_proj: Linear,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        let attention = AttentionSlot::new(Arc::new(LocalAttention));
        Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            num_heads,
            num_kv_heads,
            head_dim,
            q_norm: None,
            k_norm: None,
            window: None,
            scale: None,
            attention,
        }
    }

    /// With the softmax scale `scale` (`None`: `1 / sqrt(head_dim)`).
    pub fn with_scale(self, scale: Option<f64>) -> Self {
        Self { scale, ..self }
    }

    /// With per-head q/k RMSNorms (Qwen3, Gemma 3): `q_norm, k_norm: [head_dim]`.
    pub fn with_qk_norm(self, q_norm: RmsNorm, k_norm: RmsNorm) -> Self {
        Self { q_norm: Some(q_norm), k_norm: Some(k_norm), ..self }
    }

    /// With the layer's own attention window (see [`window`](Self::window)).
    pub fn with_window(self, window: Option<usize>) -> Self {
        Self { window, ..self }
    }

    /// `x: [b, n, hidden]` -> `[b, n, hidden]`. `rot` holds the tables of the `n` tokens' positions; `spec`
    /// the mask and offsets. With `cache`, the new keys/values are appended to the cached ones and attention
    /// runs over all of them.
    pub fn forward(
        &self,
        tape: &Tape,
        x: &Value,
        rot: &RotaryTables,
        spec: &AttentionSpec,
        cache: Option<&mut LayerKv>,
    ) -> ModelResult<Value> {
        let (b, n, _) = x.tensor().dims3()?;
        let (h, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let mut q = ops::reshape(tape, &self.q_proj.forward(tape, x)?, (b, n, h, d))?;
        let mut k = ops::reshape(tape, &self.k_proj.forward(tape, x)?, (b, n, hkv, d))?;
        let v = ops::reshape(tape, &self.v_proj.forward(tape, x)?, (b, n, hkv, d))?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = super::norm::fused_norm(tape, qn, &q)?;
            k = super::norm::fused_norm(tape, kn, &k)?;
        }
        let q = rope(tape, &q, &rot.cos, &rot.sin)?;
        let k = rope(tape, &k, &rot.cos, &rot.sin)?;
        let (k, v) = match cache {
            None => (k, v),
            Some(c) => {
                let (k, v) = match c.get() {
                    None => (k, v),
                    Some((pk, pv)) => {
                        let (pk, pv) = (tape.constant(pk.clone()), tape.constant(pv.clone()));
                        (ops::cat(tape, &[&pk, &k], 1)?, ops::cat(tape, &[&pv, &v], 1)?)
                    }
                };
                c.set(k.tensor().clone(), v.tensor().clone());
                (k, v)
            }
        };
        let mut spec = spec.clone().narrowed(self.window);
        if self.scale.is_some() {
            spec.scale = self.scale;
        }
        let o = self.attention.forward_output(tape, &q, &k, &v, &spec)?;
        let o = ops::reshape(tape, &o, (b, n, h * d))?;
        Ok(self.o_proj.forward(tape, &o)?)
    }
}

impl Module for LlamaAttention {
    fn kind(&self) -> &'static str {
        "LlamaAttention"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c = vec![
            ("q_proj".into(), &self.q_proj as &dyn Module),
            ("k_proj".into(), &self.k_proj),
            ("v_proj".into(), &self.v_proj),
            ("o_proj".into(), &self.o_proj),
        ];
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            c.push(("q_norm".into(), qn));
            c.push(("k_norm".into(), kn));
        }
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c = vec![
            ("q_proj".into(), &mut self.q_proj as &mut dyn Module),
            ("k_proj".into(), &mut self.k_proj),
            ("v_proj".into(), &mut self.v_proj),
            ("o_proj".into(), &mut self.o_proj),
        ];
        if let (Some(qn), Some(kn)) = (&mut self.q_norm, &mut self.k_norm) {
            c.push(("q_norm".into(), qn));
            c.push(("k_norm".into(), kn));
        }
        c
    }
    fn attention_slot(&mut self) -> Option<&mut AttentionSlot> {
        Some(&mut self.attention)
    }
}
