//! Phi-3's fused projections. Its files hold `self_attn.qkv_proj.weight: [(heads + 2·kv_heads)·head_dim,
//! hidden]` (q's rows, then k's, then v's) and `mlp.gate_up_proj.weight: [2·intermediate, hidden]` (gate's rows,
//! then up's); the model holds them split, as the other families' `q_proj`/`k_proj`/`v_proj` and
//! `gate_proj`/`up_proj`, so every kernel, the sequence-parallel strategies and sharding see one layout.
//! [`split`] turns a file's tensors into the model's on load; [`fuse`] turns them back for saving, so the
//! saved files are Phi-3's own. Both leave a map that is already in the wanted layout (and any other family's)
//! as it is. The gradient of a fused weight is the fused gradients of its parts ([`fuse`] applies to them too).

use std::collections::HashMap;

use candle_core::Tensor;

use crate::config::LlamaConfig;
use crate::error::Result;

/// `(fused name, [(part name, rows)])` of layer `layer`, in the order of the fused rows.
fn groups(config: &LlamaConfig, layer: usize) -> [(String, Vec<(String, usize)>); 2] {
    let p = format!("model.layers.{layer}");
    let (q, kv) = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim);
    let i = config.intermediate_size;
    [
        (
            format!("{p}.self_attn.qkv_proj.weight"),
            vec![
                (format!("{p}.self_attn.q_proj.weight"), q),
                (format!("{p}.self_attn.k_proj.weight"), kv),
                (format!("{p}.self_attn.v_proj.weight"), kv),
            ],
        ),
        (
            format!("{p}.mlp.gate_up_proj.weight"),
            vec![(format!("{p}.mlp.gate_proj.weight"), i), (format!("{p}.mlp.up_proj.weight"), i)],
        ),
    ]
}

/// The file's fused tensors of a Phi-3 model split into the model's parts (each a contiguous copy of its
/// rows, so the fused tensor is freed); a fused tensor with the wrong number of rows is left for the
/// shape checks to name. Other families, and parts already split, pass as they are.
pub fn split(config: &LlamaConfig, weights: &mut HashMap<String, Tensor>) -> Result<()> {
    if !config.model_type.fuses_projections() {
        return Ok(());
    }
    for layer in 0..config.num_hidden_layers {
        for (fused, parts) in groups(config, layer) {
            let rows: usize = parts.iter().map(|(_, r)| r).sum();
            let Some(t) = weights.get(&fused) else { continue };
            if t.dims().first() != Some(&rows) {
                continue;
            }
            let t = weights.remove(&fused).expect("present");
            let mut at = 0;
            for (name, r) in parts {
                weights.insert(name, t.narrow(0, at, r)?.contiguous()?);
                at += r;
            }
        }
    }
    Ok(())
}

/// The model's split parts of a Phi-3 model joined into the file's fused tensors (weights, or their
/// gradients); parts missing leave the group as it is, for the name checks to report. Other families pass as
/// they are.
pub fn fuse(config: &LlamaConfig, weights: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let mut out = weights.clone();
    if !config.model_type.fuses_projections() {
        return Ok(out);
    }
    for layer in 0..config.num_hidden_layers {
        for (fused, parts) in groups(config, layer) {
            if !parts.iter().all(|(n, _)| out.contains_key(n)) {
                continue;
            }
            let ts: Vec<Tensor> = parts.iter().map(|(n, _)| out.remove(n).expect("present")).collect();
            out.insert(fused, Tensor::cat(&ts, 0)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tiny::TinySpec;
    use candle_core::{DType, Device};

    #[test]
    fn split_then_fuse_gives_the_file_back() {
        let config = TinySpec { model_type: crate::config::ModelType::Phi3, ..TinySpec::default() }.config();
        let file = crate::random_weights(&config, 5, DType::F32, &Device::Cpu).unwrap();
        assert!(file.contains_key("model.layers.1.self_attn.qkv_proj.weight"));
        let mut model = file.clone();
        split(&config, &mut model).unwrap();
        assert!(!model.contains_key("model.layers.1.mlp.gate_up_proj.weight"));
        let (q, k) =
            (&model["model.layers.0.self_attn.q_proj.weight"], &model["model.layers.0.self_attn.k_proj.weight"]);
        assert_eq!((q.dims(), k.dims()), (&[64usize, 64][..], &[32usize, 64][..]));
        // k's rows follow q's in the file.
        let fused_row = file["model.layers.0.self_attn.qkv_proj.weight"].get(64).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(k.get(0).unwrap().to_vec1::<f32>().unwrap(), fused_row);
        let back = fuse(&config, &model).unwrap();
        assert_eq!(back.len(), file.len());
        for (n, t) in &file {
            assert_eq!(back[n].to_vec2::<f32>().ok(), t.to_vec2::<f32>().ok(), "{n}");
        }
        // Split twice, fused twice: nothing changes.
        let mut again = model.clone();
        split(&config, &mut again).unwrap();
        assert_eq!(again.len(), model.len());
        assert_eq!(fuse(&config, &back).unwrap().len(), back.len());
    }
}
