//! llama.cpp tensor names to HF names for the llama, qwen2, qwen3, phi3 and gemma3 architectures, and the
//! undoing of the Q/K row permutation that `convert_hf_to_gguf.py` applies to llama ones (its `permute`:
//! llama.cpp's llama RoPE rotates interleaved pairs; qwen2/qwen3/phi3/gemma3 use the NEOX RoPE, HF's own
//! pairing, and are stored as they are).

use crate::config::ModelType;
use crate::error::Result;
use candle_core::Tensor;

/// What a llama.cpp tensor is in HF terms.
#[derive(Debug, Clone, PartialEq)]
pub struct HfName {
    pub name: String,
    /// Rows were permuted by convert_hf_to_gguf.py with this many heads (q: heads, k: kv heads).
    pub permuted_heads: Option<usize>,
}

/// The HF name of llama.cpp tensor `gguf`, or `None` for a name the layout does not have. `permuted`: the
/// file's Q/K rows (and biases) are in llama.cpp's llama order (the llama architecture).
pub fn hf_name(gguf: &str, heads: usize, kv_heads: usize, permuted: bool) -> Option<HfName> {
    let plain = |s: &str| Some(HfName { name: s.to_string(), permuted_heads: None });
    match gguf {
        "token_embd.weight" => return plain("model.embed_tokens.weight"),
        "output_norm.weight" => return plain("model.norm.weight"),
        "output.weight" => return plain("lm_head.weight"),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let p = format!("model.layers.{layer}");
    let (q, k) = if permuted { (Some(heads), Some(kv_heads)) } else { (None, None) };
    let (hf, permuted_heads) = match part {
        "attn_q.weight" => (format!("{p}.self_attn.q_proj.weight"), q),
        "attn_k.weight" => (format!("{p}.self_attn.k_proj.weight"), k),
        "attn_v.weight" => (format!("{p}.self_attn.v_proj.weight"), None),
        "attn_q.bias" => (format!("{p}.self_attn.q_proj.bias"), q),
        "attn_k.bias" => (format!("{p}.self_attn.k_proj.bias"), k),
        "attn_v.bias" => (format!("{p}.self_attn.v_proj.bias"), None),
        "attn_output.bias" => (format!("{p}.self_attn.o_proj.bias"), None),
        "attn_q_norm.weight" => (format!("{p}.self_attn.q_norm.weight"), None),
        "attn_k_norm.weight" => (format!("{p}.self_attn.k_norm.weight"), None),
        "attn_output.weight" => (format!("{p}.self_attn.o_proj.weight"), None),
        "attn_qkv.weight" => (format!("{p}.self_attn.qkv_proj.weight"), None),
        "ffn_gate.weight" => (format!("{p}.mlp.gate_proj.weight"), None),
        "ffn_up.weight" => (format!("{p}.mlp.up_proj.weight"), None),
        "ffn_down.weight" => (format!("{p}.mlp.down_proj.weight"), None),
        "attn_norm.weight" => (format!("{p}.input_layernorm.weight"), None),
        "ffn_norm.weight" => (format!("{p}.post_attention_layernorm.weight"), None),
        _ => return None,
    };
    Some(HfName { name: hf, permuted_heads })
}

/// The HF name of llama.cpp tensor `gguf` in a file of `model_type`: as [`hf_name`], but where a family's
/// llama.cpp names mean another HF tensor than llama's: Phi-3's `ffn_up` is its fused `gate_up_proj`; Gemma 3's
/// `ffn_norm` is the norm before the MLP (`pre_feedforward_layernorm`), its `attn_post_norm` the norm of the
/// attention's output (`post_attention_layernorm`) and `post_ffw_norm` that of the MLP's.
pub fn family_hf_name(
    model_type: ModelType,
    gguf: &str,
    heads: usize,
    kv_heads: usize,
    permuted: bool,
) -> Option<HfName> {
    let overrides: &[(&str, &str)] = match model_type {
        ModelType::Phi3 => &[("ffn_up.weight", "mlp.gate_up_proj.weight")],
        ModelType::Gemma3 => &[
            ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
            ("attn_post_norm.weight", "post_attention_layernorm.weight"),
            ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
        ],
        _ => &[],
    };
    if let Some((layer, part)) = gguf.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
        if let (Ok(layer), Some((_, hf))) = (layer.parse::<usize>(), overrides.iter().find(|(g, _)| *g == part)) {
            return Some(HfName { name: format!("model.layers.{layer}.{hf}"), permuted_heads: None });
        }
    }
    hf_name(gguf, heads, kv_heads, permuted)
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

    #[test]
    fn names() {
        let n = hf_name("blk.3.attn_k.weight", 9, 3, true).unwrap();
        assert_eq!(n.name, "model.layers.3.self_attn.k_proj.weight");
        assert_eq!(n.permuted_heads, Some(3));
        assert_eq!(hf_name("blk.3.attn_k.weight", 9, 3, false).unwrap().permuted_heads, None);
        assert_eq!(
            hf_name("blk.0.attn_q_norm.weight", 9, 3, false).unwrap().name,
            "model.layers.0.self_attn.q_norm.weight"
        );
        assert_eq!(hf_name("blk.x.attn_k.weight", 9, 3, true), None);
        assert_eq!(hf_name("rope_freqs.weight", 9, 3, true), None);
    }
}
