//! llama.cpp tensor names to HF names, per architecture, as llama.cpp's converter writes them: the
//! `MODEL_TENSORS[arch]` / `TENSOR_NAMES` tables of gguf-py's `constants.py` (package `gguf`), with the HF
//! tensor each one is converted from in `tensor_mapping.py`. Per family:
//!
//! | llama.cpp `blk.N.*`   | llama, qwen2, qwen3       | phi3                  | gemma3                       |
//! |-----------------------|---------------------------|-----------------------|------------------------------|
//! | `attn_norm`           | `input_layernorm`         | `input_layernorm`     | `input_layernorm`            |
//! | `attn_q`/`_k`/`_v`    | `self_attn.{q,k,v}_proj`  | - (fused: `attn_qkv`) | `self_attn.{q,k,v}_proj`     |
//! | `attn_qkv`            | -                         | `self_attn.qkv_proj`  | -                            |
//! | `attn_q_norm`/`_k_`   | qwen3 only: `q_norm`, ... | -                     | `self_attn.{q,k}_norm`       |
//! | `attn_output`         | `self_attn.o_proj`        | `self_attn.o_proj`    | `self_attn.o_proj`           |
//! | `post_attention_norm` | -                         | -                     | `post_attention_layernorm`   |
//! | `ffn_norm`            | `post_attention_layernorm`| `post_attention_...`  | `pre_feedforward_layernorm`  |
//! | `ffn_gate`            | `mlp.gate_proj`           | -                     | `mlp.gate_proj`              |
//! | `ffn_up`              | `mlp.up_proj`             | `mlp.gate_up_proj`    | `mlp.up_proj`                |
//! | `ffn_down`            | `mlp.down_proj`           | `mlp.down_proj`       | `mlp.down_proj`              |
//! | `post_ffw_norm`       | -                         | -                     | `post_feedforward_layernorm` |
//!
//! and `token_embd` / `output_norm` / `output` for `model.embed_tokens` / `model.norm` / `lm_head` everywhere.
//! Mistral is converted as llama. The converter's changes to the values, undone by the importer: llama's Q/K
//! rows (and biases) permuted for llama.cpp's interleaved RoPE ([`unpermute_rows`]); Gemma 3's norms (every
//! `*norm.weight`, q/k norms included) stored as the scale `1 + w`; Gemma 3's embedding cut to the tokenizer's
//! vocabulary. Phi-3 keeps its fused `qkv_proj` and `gate_up_proj` as they are.

use crate::config::ModelType;
use crate::error::Result;
use candle_core::Tensor;

/// What a llama.cpp tensor is in HF terms.
#[derive(Debug, Clone, PartialEq)]
pub struct HfName {
    /// The HF tensor name, e.g. `model.layers.3.self_attn.k_proj.weight`.
    pub name: String,
    /// Rows were permuted by convert_hf_to_gguf.py with this many heads (q: heads, k: kv heads).
    pub permuted_heads: Option<usize>,
}

/// A per-layer tensor of llama.cpp (`TENSOR_NAMES`, without `blk.N.`) and the HF module it is converted from
/// (without `model.layers.N.`).
type LayerName = (&'static str, &'static str);

/// Names llama, qwen2, qwen3 and phi3 share (`MODEL_TENSORS` of each; `ffn_norm` is the norm before the MLP,
/// HF's `post_attention_layernorm`).
const DECODER: &[LayerName] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_down", "mlp.down_proj"),
];

/// Split attention and gated MLP projections (llama, qwen2, qwen3, gemma3).
const SPLIT: &[LayerName] = &[
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
];

/// Per-head RMS norms of queries and keys (qwen3, gemma3).
const QK_NORM: &[LayerName] = &[("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")];

/// Phi-3's fused projections: llama.cpp's `attn_qkv` and `ffn_up` hold HF's `qkv_proj` and `gate_up_proj`.
const PHI3: &[LayerName] = &[("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")];

/// Gemma 3's four norms ("sandwich" norms around attention and MLP): llama.cpp's `ffn_norm` is the norm
/// before the MLP (HF `pre_feedforward_layernorm`), `post_attention_norm` HF's `post_attention_layernorm`.
const GEMMA3: &[LayerName] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_output", "self_attn.o_proj"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("ffn_down", "mlp.down_proj"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

/// The per-layer tables of `model_type`'s llama.cpp architecture.
fn layer_tables(model_type: ModelType) -> &'static [&'static [LayerName]] {
    match model_type {
        ModelType::Llama | ModelType::Mistral | ModelType::Qwen2 => &[DECODER, SPLIT],
        ModelType::Qwen3 => &[DECODER, SPLIT, QK_NORM],
        ModelType::Phi3 => &[DECODER, PHI3],
        ModelType::Gemma3 => &[GEMMA3, SPLIT, QK_NORM],
    }
}

/// The HF name of llama.cpp tensor `gguf` in a file of `model_type`'s architecture, or `None` for a name
/// llama.cpp's converter does not write for it (so a file of another layout is refused, not misread).
/// `heads` / `kv_heads`: for llama's permuted Q/K rows ([`HfName::permuted_heads`], set for the llama
/// architecture only (Mistral included), the one whose converter permutes).
pub fn family_hf_name(model_type: ModelType, gguf: &str, heads: usize, kv_heads: usize) -> Option<HfName> {
    let plain = |s: &str| Some(HfName { name: s.to_string(), permuted_heads: None });
    match gguf {
        "token_embd.weight" => return plain("model.embed_tokens.weight"),
        "output_norm.weight" => return plain("model.norm.weight"),
        "output.weight" => return plain("lm_head.weight"),
        _ => {}
    }
    let (layer, part) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, suffix) = part.rsplit_once('.')?;
    // Biases: q/k/v (qwen2 always; llama and qwen3 with `attention_bias`) and o (llama's `attention_bias`).
    let bias_ok = matches!(base, "attn_q" | "attn_k" | "attn_v" | "attn_output")
        && matches!(model_type, ModelType::Llama | ModelType::Mistral | ModelType::Qwen2 | ModelType::Qwen3);
    if suffix != "weight" && !(suffix == "bias" && bias_ok) {
        return None;
    }
    let hf = layer_tables(model_type).iter().flat_map(|t| t.iter()).find(|(g, _)| *g == base)?.1;
    let permuted_heads = match (model_type, base) {
        (ModelType::Llama | ModelType::Mistral, "attn_q") => Some(heads),
        (ModelType::Llama | ModelType::Mistral, "attn_k") => Some(kv_heads),
        _ => None,
    };
    Some(HfName { name: format!("model.layers.{layer}.{hf}.{suffix}"), permuted_heads })
}

/// Undoes convert_hf_to_gguf.py's `permute(w, n_head)`, which is
/// `w.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2).reshape(rows, cols)`:
/// llama.cpp's interleaved RoPE wants pairs (2i, 2i+1), HF's rotate_half wants (i, i + head_dim/2).
///
/// `w: [n_head * head_dim, cols]` (or a bias `[n_head * head_dim]`) -> same shape, rows back in HF order.
pub fn unpermute_rows(w: &Tensor, n_head: usize) -> Result<Tensor> {
    if w.rank() == 1 {
        return Ok(unpermute_rows(&w.unsqueeze(1)?, n_head)?.squeeze(1)?);
    }
    let (rows, cols) = w.dims2()?;
    let half = rows / n_head / 2;
    Ok(w.reshape((n_head, half, 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // One head, head_dim 4, one column: HF rows [a0 a1 b0 b1] (first half a, second half b) are
        // stored by llama.cpp interleaved as [a0 b0 a1 b1].
        let stored = Tensor::new(&[[0f32], [2.], [1.], [3.]], &Device::Cpu).unwrap();
        let hf = unpermute_rows(&stored, 1).unwrap();
        let v: Vec<f32> = hf.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v, vec![0., 1., 2., 3.]);
    }

    #[test]
    fn unpermute_per_head() {
        // Two heads of head_dim 4: each head is unpermuted on its own.
        let stored: Vec<f32> = vec![0., 2., 1., 3., 10., 12., 11., 13.];
        let w = Tensor::from_vec(stored, (8, 1), &Device::Cpu).unwrap();
        let v: Vec<f32> = unpermute_rows(&w, 2).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v, vec![0., 1., 2., 3., 10., 11., 12., 13.]);
    }

    fn hf(model_type: ModelType, gguf: &str) -> Option<String> {
        family_hf_name(model_type, gguf, 9, 3).map(|n| n.name)
    }

    #[test]
    fn llama_names_and_permutation() {
        let n = family_hf_name(ModelType::Llama, "blk.3.attn_k.weight", 9, 3).unwrap();
        assert_eq!(n.name, "model.layers.3.self_attn.k_proj.weight");
        assert_eq!(n.permuted_heads, Some(3));
        let q = family_hf_name(ModelType::Llama, "blk.3.attn_q.bias", 9, 3).unwrap();
        assert_eq!((q.name.as_str(), q.permuted_heads), ("model.layers.3.self_attn.q_proj.bias", Some(9)));
        assert_eq!(family_hf_name(ModelType::Qwen2, "blk.3.attn_k.weight", 9, 3).unwrap().permuted_heads, None);
        assert_eq!(
            hf(ModelType::Llama, "blk.0.ffn_norm.weight").unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(hf(ModelType::Llama, "blk.x.attn_k.weight"), None);
        assert_eq!(hf(ModelType::Llama, "rope_freqs.weight"), None);
        // Only qwen3 (and gemma3) have q/k norms; only the llama-like ones have biases.
        assert_eq!(hf(ModelType::Llama, "blk.0.attn_q_norm.weight"), None);
        assert_eq!(hf(ModelType::Qwen3, "blk.0.attn_q_norm.weight").unwrap(), "model.layers.0.self_attn.q_norm.weight");
        assert_eq!(hf(ModelType::Gemma3, "blk.0.attn_q.bias"), None);
    }

    #[test]
    fn gemma3_sandwich_norms_as_llama_cpp_writes_them() {
        let g = |n: &str| hf(ModelType::Gemma3, &format!("blk.5.{n}.weight")).unwrap();
        assert_eq!(g("attn_norm"), "model.layers.5.input_layernorm.weight");
        assert_eq!(g("post_attention_norm"), "model.layers.5.post_attention_layernorm.weight");
        assert_eq!(g("ffn_norm"), "model.layers.5.pre_feedforward_layernorm.weight");
        assert_eq!(g("post_ffw_norm"), "model.layers.5.post_feedforward_layernorm.weight");
        assert_eq!(g("attn_k_norm"), "model.layers.5.self_attn.k_norm.weight");
        // Names no converter writes for gemma3.
        assert_eq!(hf(ModelType::Gemma3, "blk.5.attn_post_norm.weight"), None);
        assert_eq!(hf(ModelType::Gemma3, "blk.5.attn_qkv.weight"), None);
    }

    #[test]
    fn phi3_fused_projections() {
        assert_eq!(hf(ModelType::Phi3, "blk.1.attn_qkv.weight").unwrap(), "model.layers.1.self_attn.qkv_proj.weight");
        assert_eq!(hf(ModelType::Phi3, "blk.1.ffn_up.weight").unwrap(), "model.layers.1.mlp.gate_up_proj.weight");
        assert_eq!(hf(ModelType::Phi3, "blk.1.ffn_gate.weight"), None);
    }
}
