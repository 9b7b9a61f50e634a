//! LoRA on a [`LlamaModel`]: adding adapters (the family's checks on top of [`autosp_core::lora::add_lora`]),
//! the tensors an adapter file holds, and putting a saved adapter's tensors back.

use std::collections::HashMap;

use autosp_core::lora::{self, LoraConfig};
use autosp_core::module::trainable_params;
use candle_core::Tensor;

use super::error::{ModelError, ModelResult};
use super::model::LlamaModel;

impl LlamaModel {
    /// Adds `config`'s LoRA adapters ([`autosp_core::lora::add_lora`]): the base weights freeze, the target
    /// projections get adapters in the model's dtype. Phi-3 is refused: PEFT's adapters for it sit on the fused
    /// `qkv_proj` / `gate_up_proj`, which this model holds split. Returns the number of adapters.
    pub fn add_lora(&mut self, config: &LoraConfig) -> ModelResult<usize> {
        if self.config.model_type.fuses_projections() {
            return Err(ModelError::Lora(format!(
                "LoRA on {} is not supported: PEFT's adapters for it sit on the fused qkv_proj and gate_up_proj, \
                 which autosp holds split; fine-tune it fully instead",
                self.config.model_type.as_str()
            )));
        }
        Ok(lora::add_lora(self, config)?)
    }

    /// The model's LoRA settings when it has adapters.
    pub fn lora_config(&self) -> Option<LoraConfig> {
        lora::lora_config_of(self)
    }

    /// The tensors an adapter file holds: every parameter that trains (the adapters, and the embedding and
    /// norms when they train), by name, as stored (this rank's slice when sharded at `Parameters`).
    pub fn adapter_weights(&self) -> HashMap<String, Tensor> {
        trainable_params(self).into_iter().map(|p| (p.name().to_string(), p.tensor())).collect()
    }

    /// Puts a saved adapter's tensors (by the model's names, as [`crate::peft::load_adapter`] gives them) into
    /// the model's adapters and trained modules, converted to their dtype and device. Every parameter that
    /// trains must be there with its shape, and nothing else may be. Call it before sharding the model.
    pub fn set_adapter_weights(&self, weights: &HashMap<String, Tensor>) -> ModelResult<()> {
        let params = trainable_params(self);
        for p in &params {
            let want = p.shape().dims().to_vec();
            let t = weights.get(p.name()).ok_or_else(|| {
                ModelError::Lora(format!(
                    "the adapter has no `{}` (shape {want:?}): it was saved with other LoRA settings (rank, targets, \
                     --lora-train) or for another model",
                    p.name()
                ))
            })?;
            if t.dims() != want {
                return Err(ModelError::WeightShape {
                    name: p.name().into(),
                    expected: want,
                    found: t.dims().to_vec(),
                });
            }
            let cur = p.tensor();
            p.set(t.to_dtype(cur.dtype())?.to_device(cur.device())?)?;
        }
        let mut extra: Vec<&String> = weights.keys().filter(|k| !params.iter().any(|p| p.name() == *k)).collect();
        extra.sort();
        if let Some(name) = extra.first() {
            return Err(ModelError::Lora(format!(
                "the adapter holds `{name}`, which nothing in this model trains: it was saved with other LoRA \
                 settings or for another model"
            )));
        }
        Ok(())
    }

    /// Folds the adapters into the base weights ([`autosp_core::lora::merge_lora`]): an ordinary model with the
    /// adapted weights, which [`save`](Self::save) writes as an HF checkpoint. Returns the number merged.
    pub fn merge_lora(&mut self) -> ModelResult<usize> {
        Ok(lora::merge_lora(self)?)
    }
}
