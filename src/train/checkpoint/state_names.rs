//! The optimizer state's tensor names as the checkpoint's own: `optimizer.safetensors` holds
//! `<param>.exp_avg`, `<param>.exp_avg_sq` and `<param>.master` under the names of the model file beside it,
//! so a Phi-3 checkpoint's state is keyed by its fused `qkv_proj` / `gate_up_proj` (each moment fused as the
//! weight is: [`autosp_models::fused`]), and split back into the model's parts on resume. Other families pass
//! as they are. (The per-rank files of a sharded checkpoint hold flat slices of the model's own parameters and
//! keep the model's names: any mesh reads its elements back from them, [`super::restore_state`].)

use std::collections::HashMap;

use autosp_models::{fused, LlamaConfig};
use candle_core::Tensor;

use super::super::error::Result;

/// The suffixes of the state kept per parameter.
const SUFFIXES: [&str; 3] = [".exp_avg", ".exp_avg_sq", ".master"];

/// `state` (by `<model name><suffix>`) under the file's names: each suffix's tensors fused as the weights are.
pub fn to_file_names(config: &LlamaConfig, state: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    map_each_suffix(config, state, |c, group| Ok(fused::fuse(c, &group)?))
}

/// `state` read from a file, under the model's names again: each suffix's fused tensors split into the parts.
pub fn to_model_names(config: &LlamaConfig, state: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    map_each_suffix(config, state, |c, mut group| {
        fused::split(c, &mut group)?;
        Ok(group)
    })
}

/// Applies `f` to the tensors of each suffix, keyed by the parameter name alone; other entries pass as they are.
fn map_each_suffix(
    config: &LlamaConfig,
    mut state: HashMap<String, Tensor>,
    f: impl Fn(&LlamaConfig, HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>>,
) -> Result<HashMap<String, Tensor>> {
    if !config.model_type.fuses_projections() {
        return Ok(state);
    }
    let mut out = HashMap::with_capacity(state.len());
    for suffix in SUFFIXES {
        let names: Vec<String> = state.keys().filter(|k| k.ends_with(suffix)).cloned().collect();
        // `.exp_avg` is a prefix of `.exp_avg_sq`'s suffix only as text: take each key once, longest first.
        let group: HashMap<String, Tensor> = names
            .into_iter()
            .filter(|k| !(suffix == ".exp_avg" && k.ends_with(".exp_avg_sq")))
            .map(|k| {
                let t = state.remove(&k).expect("listed");
                (k[..k.len() - suffix.len()].to_string(), t)
            })
            .collect();
        for (name, t) in f(config, group)? {
            out.insert(format!("{name}{suffix}"), t);
        }
    }
    out.extend(state);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use autosp_models::{ModelType, TinySpec};
    use candle_core::{DType, Device};

    #[test]
    fn phi3_state_is_saved_under_the_fused_names_and_split_back_exactly() {
        let config = TinySpec { model_type: ModelType::Phi3, ..TinySpec::default() }.config();
        let mut weights = autosp_models::random_weights(&config, 3, DType::F32, &Device::Cpu).unwrap();
        fused::split(&config, &mut weights).unwrap();
        let mut state = HashMap::new();
        for (n, w) in &weights {
            state.insert(format!("{n}.exp_avg"), w.clone());
            state.insert(format!("{n}.exp_avg_sq"), (w * 2.0).unwrap());
            state.insert(format!("{n}.master"), (w * 3.0).unwrap());
        }
        let file = to_file_names(&config, state.clone()).unwrap();
        let fused_name = "model.layers.0.self_attn.qkv_proj.weight";
        for suffix in SUFFIXES {
            assert!(file.contains_key(&format!("{fused_name}{suffix}")), "{suffix}");
            assert!(!file.contains_key(&format!("model.layers.0.self_attn.q_proj.weight{suffix}")), "{suffix}");
            assert!(file.contains_key(&format!("model.layers.1.mlp.gate_up_proj.weight{suffix}")), "{suffix}");
        }
        assert_eq!(file.len(), state.len() - 3 * 3 * config.num_hidden_layers);
        let back = to_model_names(&config, file).unwrap();
        assert_eq!(back.len(), state.len());
        for (n, t) in &state {
            let (a, b) = (t.flatten_all().unwrap(), back[n].flatten_all().unwrap());
            assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap(), "{n}");
        }
        // Another family's state passes as it is.
        let llama = TinySpec::default().config();
        let same = to_file_names(&llama, state.clone()).unwrap();
        assert_eq!(same.len(), state.len());
    }
}
