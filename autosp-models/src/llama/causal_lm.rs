//! `LlamaModel` as a [`CausalLm`]: what the compile step trains and shards.

use autosp_core::{CausalLm, LmDims, Result, Tape, Value};
use candle_core::Tensor;

use super::error::ModelError;
use super::model::LlamaModel;

impl From<ModelError> for autosp_core::Error {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Core(e) => e,
            ModelError::Candle(e) => autosp_core::Error::Candle(e),
            other => autosp_core::Error::External(Box::new(other)),
        }
    }
}

impl CausalLm for LlamaModel {
    fn loss(&self, tape: &Tape, ids: &Tensor, positions: &[usize], targets: &Tensor) -> Result<(Value, usize)> {
        Ok(LlamaModel::loss(self, tape, ids, positions, targets)?)
    }

    fn logits(&self, tape: &Tape, ids: &Tensor, positions: &[usize]) -> Result<Value> {
        Ok(LlamaModel::logits(self, tape, ids, positions)?)
    }

    fn logits_at(&self, tape: &Tape, ids: &Tensor, positions: &[usize], rows: &[usize]) -> Result<Value> {
        Ok(LlamaModel::logits_at(self, tape, ids, positions, rows)?)
    }

    fn dims(&self) -> LmDims {
        let c = &self.config;
        LmDims {
            layers: c.num_hidden_layers,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            vocab: c.vocab_size,
        }
    }

    fn supports_documents(&self) -> bool {
        true
    }
}
