#!/usr/bin/env python3
"""Writes an HF checkpoint directory (config.json + model.safetensors) as a GGUF file the way llama.cpp's
convert_hf_to_gguf.py does, with the `gguf` package (pip install gguf==0.19.0), for the architectures
autosp imports: llama (and mistral, converted as llama), qwen2, qwen3, phi3, gemma3.

The tensor names are not written here: each comes from the package's own table,
`gguf.get_tensor_name_map(arch, n_layers).get_name(hf_name)` (llama.cpp's tensor_mapping.py and
constants.py), so a test on the file checks autosp's names against llama.cpp's. The converter's changes to
the values are applied as it applies them: llama's Q/K rows (weights and biases) permuted for llama.cpp's
interleaved RoPE (`LlamaModel.permute`); Gemma 3's norms (every HF name ending in `norm.weight`) stored
plus one; a llama3 RoPE scaling stored as the tensor `rope_freqs`, Phi-3's longrope as `rope_factors_long` /
`rope_factors_short` with its attention factor. The metadata keys are the converter's `set_gguf_parameters` for each architecture (the tokenizer
is not written). 1-D tensors are stored F32, as the converter keeps norms; matrices in --outtype.

    python3 hf_to_gguf.py CHECKPOINT_DIR OUT.gguf [--outtype f32|f16|q8_0]
"""

import argparse
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

import gguf

ARCHES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mistral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
}


def read_safetensors(path):
    """name -> float32 array, from a .safetensors file (F32, F16 or BF16), without the safetensors package."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = data[a:b]
        if info["dtype"] == "F32":
            t = np.frombuffer(buf, dtype="<f4")
        elif info["dtype"] == "F16":
            t = np.frombuffer(buf, dtype="<f2").astype(np.float32)
        elif info["dtype"] == "BF16":
            t = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            sys.exit(f"{path}: tensor {name} has dtype {info['dtype']}; F32, F16 or BF16 only")
        out[name] = t.reshape(info["shape"]).copy()
    return out


def permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--outtype", choices=["f32", "f16", "q8_0"], default="f32")
    a = ap.parse_args()

    cfg = json.loads((Path(a.checkpoint) / "config.json").read_text())
    model_type = cfg["model_type"]
    if model_type not in ARCHES:
        sys.exit(f"model_type {model_type} is not one of {sorted(ARCHES)}")
    arch = ARCHES[model_type]
    n_layers = cfg["num_hidden_layers"]
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_full = rope.get("full_attention", rope)
    rope_theta = rope_full.get("rope_theta", cfg.get("rope_theta"))
    local_theta = rope.get("sliding_attention", {}).get("rope_theta", cfg.get("rope_local_base_freq"))

    w = gguf.GGUFWriter(a.out, gguf.MODEL_ARCH_NAMES[arch])
    # TextModel.set_gguf_parameters, then each architecture's own.
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    if rope_theta is not None:
        w.add_rope_freq_base(rope_theta)
    if local_theta is not None:
        w.add_rope_freq_base_swa(local_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == gguf.MODEL_ARCH.PHI3:
        w.add_rope_dimension_count(head_dim)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
    if arch == gguf.MODEL_ARCH.GEMMA3:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if cfg.get("sliding_window_pattern") != 1 and cfg.get("sliding_window"):
            w.add_sliding_window(cfg["sliding_window"])
    # The scalings the converter stores as tensors: llama's `rope_freqs` (LlamaModel.generate_extra_tensors)
    # and Phi-3's longrope factors (Phi3MiniModel.set_gguf_parameters / generate_extra_tensors).
    extra = {}
    rope_type = (rope_full.get("rope_type") or rope_full.get("type") or "").lower()
    if arch == gguf.MODEL_ARCH.LLAMA and rope_type == "llama3":
        base = rope_full.get("rope_theta", rope_theta or 10000.0)
        freqs = 1.0 / (np.float32(base) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
        factor = rope_full.get("factor", 8.0)
        low, high = rope_full.get("low_freq_factor", 1.0), rope_full.get("high_freq_factor", 4.0)
        old = rope_full.get("original_max_position_embeddings", 8192)
        factors = []
        for freq in freqs:
            wavelen = np.float32(2 * math.pi) / freq
            if wavelen < old / high:
                factors.append(1)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        extra[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = np.array(factors, dtype=np.float32)
    if arch == gguf.MODEL_ARCH.PHI3:
        orig = cfg.get("original_max_position_embeddings") or rope_full.get("original_max_position_embeddings")
        if orig is not None:
            w.add_rope_scaling_orig_ctx_len(orig)
        if rope_full.get("long_factor"):
            scale = cfg["max_position_embeddings"] / orig
            if rope_type not in ("su", "longrope"):
                sys.exit(f"Phi-3 rope type {rope_type}: this script writes longrope only")
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
            for key, tensor in (("long_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
                                ("short_factor", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)):
                extra[gguf.TENSOR_NAMES[tensor] + ".weight"] = np.array(rope_full[key], dtype=np.float32)
    ftype = {"f32": 0, "f16": 1, "q8_0": 7}[a.outtype]
    w.add_file_type(ftype)

    names = gguf.get_tensor_name_map(arch, n_layers)
    for hf, t in sorted(read_safetensors(Path(a.checkpoint) / "model.safetensors").items()):
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            sys.exit(f"{hf}: llama.cpp's tensor map of {gguf.MODEL_ARCH_NAMES[arch]} has no name for it")
        if arch == gguf.MODEL_ARCH.LLAMA and hf.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, n_head, n_head)
        if arch == gguf.MODEL_ARCH.LLAMA and hf.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, n_head, n_kv)
        if arch == gguf.MODEL_ARCH.GEMMA3 and hf.endswith("norm.weight"):
            t = t + 1.0
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim == 1 or a.outtype == "f32":
            w.add_tensor(name, t)
        elif a.outtype == "f16":
            w.add_tensor(name, t.astype(np.float16))
        else:
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for name, t in extra.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
