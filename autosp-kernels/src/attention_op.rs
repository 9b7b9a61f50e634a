//! Flash attention on the tape: the [`FlashAttentionOp`] (kind attention; saves q, k, v, o and lse; backward
//! in the FlashAttention-2 manner) and [`FlashAttention`], the default [`Attention`] for every attention slot.
//! Both run on any device through the dispatch of [`crate::flash`] (the fast CPU kernel on the CPU, the
//! device-generic kernel elsewhere); [`Attention::forward_output`] on inputs that take no gradient runs
//! [`flash_attention_output`], which uses candle-flash-attn on CUDA where it can (feature `flash-attn`).

use std::sync::Arc;

use autosp_core::ops::attention::apply_attention;
use autosp_core::ops::AttentionSpec;
use autosp_core::{Attention, NodeKind, Op, SavedTensors, Saves, Tape, Value};
use candle_core::Tensor;

use crate::flash::{flash_attention_backward, flash_attention_forward, flash_attention_output};

/// Flash attention as a tape op: inputs `q: [b, nq, h, d]`, `k, v: [b, nk, h_kv, d]`; outputs
/// `o: [b, nq, h, d]` and `lse: [b, h, nq]`.
#[derive(Debug)]
pub struct FlashAttentionOp {
    /// Mask, scale and position offsets.
    pub spec: AttentionSpec,
}

impl Op for FlashAttentionOp {
    fn name(&self) -> &'static str {
        "flash_attention"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Attention
    }
    fn forward(&self, i: &[&Tensor]) -> autosp_core::Result<Vec<Tensor>> {
        let (o, lse) = flash_attention_forward(i[0], i[1], i[2], &self.spec)?;
        Ok(vec![o, lse])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1, 2]).and_outputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> autosp_core::Result<Vec<Option<Tensor>>> {
        let o = s.output(0)?;
        let d_o = match &g[0] {
            Some(d) => d.clone(),
            None => o.zeros_like()?,
        };
        let (dq, dk, dv) = flash_attention_backward(
            s.input(0)?,
            s.input(1)?,
            s.input(2)?,
            o,
            s.output(1)?,
            &d_o,
            g[1].as_ref(),
            &self.spec,
        )?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    }
}

/// Flash attention on the tape: `q: [b, nq, h, d]`, `k, v: [b, nk, h_kv, d]` -> `(o: [b, nq, h, d],
/// lse: [b, h, nq])`.
pub fn flash_attention(
    tape: &Tape,
    q: &Value,
    k: &Value,
    v: &Value,
    spec: AttentionSpec,
) -> autosp_core::Result<(Value, Value)> {
    apply_attention(tape, Arc::new(FlashAttentionOp { spec }), q, k, v)
}

/// Flash attention (the fast CPU kernel, or the device-generic one off the CPU) as an [`Attention`]
/// implementation: the default of every attention slot.
#[derive(Debug, Default, Clone, Copy)]
pub struct FlashAttention;

impl Attention for FlashAttention {
    fn describe(&self) -> String {
        "flash".into()
    }

    fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        flash_attention(tape, q, k, v, *spec)
    }

    fn as_op(&self, spec: &AttentionSpec) -> Option<Arc<dyn Op>> {
        Some(Arc::new(FlashAttentionOp { spec: *spec }))
    }

    /// The output of [`forward`](Attention::forward), recorded on the tape, when the tape records a gradient
    /// through q, k or v (training, any device). Otherwise (inference) the untracked output of
    /// [`flash_attention_output`]: the same kernels, and candle-flash-attn for CUDA inputs it takes.
    fn forward_output(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<Value> {
        if tape.is_recording() && [q, k, v].iter().any(|x| x.is_tracked()) {
            return Ok(self.forward(tape, q, k, v, spec)?.0);
        }
        autosp_core::alloc::phase("forward", "flash_attention");
        Ok(Value::constant(flash_attention_output(q.tensor(), k.tensor(), v.tensor(), spec)?))
    }
}
