//! [`RmsNorm`]: the Llama normalisation with a learned scale (`x̂ · w`, or Gemma's `x̂ · (1 + w)`).

use candle_core::Tensor;

use crate::module::Module;
use crate::{ops, NodeKind, Op, Param, Precision, Result, SavedTensors, Tape, Value};

/// RMSNorm over the last dim; `weight: [d]`. The scale is `offset + weight`: `offset` 0 for Llama and most
/// families (the weight is the scale), 1 for Gemma, whose checkpoints store the scale minus one.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub weight: Param,
    pub eps: f64,
    pub offset: f64,
}

/// `offset + w` in the compute dtype of `w`'s storage ([`Precision::compute`]: f32 for bf16/f16 weights), as
/// transformers' Gemma norm computes `1.0 + self.weight.float()`: `w: [d]` -> `[d]`. Rounding `1 + w` to bf16
/// would lose what `w` has below 2^-8 (bf16 holds 8 bits past the leading 1). Backward rounds the scale's
/// gradient once to `w`'s dtype, as autograd's cast back does.
#[derive(Debug)]
struct OffsetScale {
    offset: f64,
}

impl Op for OffsetScale {
    fn name(&self) -> &'static str {
        "norm_offset_scale"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let w = i[0];
        Ok(vec![w.to_dtype(Precision::float(w.dtype()).compute())?.affine(1.0, self.offset)?])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![g[0].as_ref().map(|g| g.to_dtype(s.input_dtype(0))).transpose()?])
    }
}

impl RmsNorm {
    /// The norm with scale `weight` (`offset` 0).
    pub fn new(weight: Param, eps: f64) -> Self {
        Self { weight, eps, offset: 0.0 }
    }

    /// The scale `offset + weight` on `tape`: `[d]`, the weight itself when `offset` is 0, else computed in
    /// the weight's compute dtype (f32 for a bf16/f16 weight; see `OffsetScale`), which every RMSNorm kernel
    /// takes as it is.
    pub fn scale(&self, tape: &Tape) -> Result<Value> {
        let w = tape.param(&self.weight)?;
        if self.offset == 0.0 {
            return Ok(w);
        }
        Ok(tape.apply(OffsetScale { offset: self.offset }, &[&w])?.remove(0))
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
