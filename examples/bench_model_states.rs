//! Model-state bytes per rank from a model's shapes alone (#41 item 7): full fine-tuning and LoRA at W = 1, 2, 4,
//! 8 ranks and every `--shard` level, for the Llama-3.2-1B and Llama-3-8B shapes (no weights are made: an 8B
//! model's f32 weights exceed this machine's memory), beside what ZeRO-3 and FSDP2 hold for the same model. One
//! JSON line per (model, mode, world, level), then one line per (model, mode, world) for the references.
//!
//! ```text
//! cargo run --release --example bench_model_states            # bf16 weights (f32 masters, moments, grads)
//! cargo run --release --example bench_model_states -- f32     # f32 weights
//! ```
//!
//! The counts come from the config's tensor list ([`LlamaConfig::expected_tensors`]) and LoRA's adapters
//! (rank 16 on every projection, A `[r, in]` and B `[out, r]`); the program first checks, on a small model it
//! builds, that these counts equal [`ParamCounts::of`] on the built model, LoRA included.
//!
//! `parameters` counts two blocks gathered (the running one and the one the gather prefetch, on by default, makes
//! ready next: `model_state_bytes_with(.., true)`).
//!
//! References (per rank, N trainable parameters, F frozen, W ranks, B the largest block's elements):
//! - ZeRO-3 (DeepSpeed, mixed precision, the ZeRO paper's accounting): 16·N/W (bf16 parameters and gradients,
//!   f32 masters and two moments) plus 2·F/W for a bf16 frozen base, plus the gathered bf16 weights of one block.
//! - FSDP2 (`fully_shard` per block, `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32)`, f32 sharded
//!   parameters): 4·N/W parameters + 4·N/W gradients + 8·N/W moments, frozen weights 4·F/W (FSDP2 keeps a
//!   loaded f32 base's shards in f32; 2·F/W when loaded in bf16, as printed), plus two blocks' bf16 weights
//!   gathered (the running one and the prefetched next one) and, in backward, one block's unsharded gradient.

use anyhow::{bail, Result};
use autosp::compile::{model_state_bytes_with, ModelStateBytes, ParamCounts};
use autosp::core::lora::{LoraConfig, TARGETS};
use autosp::core::CausalLm;
use autosp::core::ShardLevel;
use autosp::models::{random_weights, LlamaConfig, LlamaModel, TinySpec};
use candle_core::{DType, Device};
use serde_json::json;

/// The LoRA rank the LoRA rows use.
const LORA_R: usize = 16;

/// A Llama config of these shapes.
fn shape(layers: usize, hidden: usize, intermediate: usize, vocab: usize, tied: bool) -> LlamaConfig {
    TinySpec { layers, hidden, intermediate, heads: 32, kv_heads: 8, vocab, tied, ..TinySpec::default() }.config()
}

/// The parameter counts of `cfg` from its tensor list: every tensor trains (full fine-tuning), or with `lora`
/// (rank r) every tensor is frozen and each projection of each block gets A `[r, in]` and B `[out, r]`.
fn counts(cfg: &LlamaConfig, lora: Option<usize>) -> ParamCounts {
    let mut c = ParamCounts::default();
    let mut blocks = vec![0usize; cfg.num_hidden_layers];
    for (name, dims) in cfg.expected_tensors() {
        let n: usize = dims.iter().product();
        let block = name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()?.parse::<usize>().ok());
        if let Some(b) = block {
            blocks[b] += n;
        }
        let projection = TARGETS.iter().any(|(_, t)| name.ends_with(&format!("{t}.weight")));
        match lora {
            Some(r) => {
                c.frozen_elems.push(n);
                if projection && block.is_some() {
                    // A [r, in] and B [out, r]: trainable, in the block.
                    let adapter = vec![r * dims[1], dims[0] * r];
                    blocks[block.unwrap_or(0)] += adapter.iter().sum::<usize>();
                    c.elems.extend(adapter);
                }
            }
            None => c.elems.push(n),
        }
    }
    c.frozen = c.frozen_elems.iter().sum();
    c.largest_unit = blocks.into_iter().max().unwrap_or(0);
    c
}

fn state_json(b: &ModelStateBytes) -> serde_json::Value {
    json!({ "total": b.total(), "params": b.params, "grads": b.grads, "moments": b.moments, "masters": b.masters,
            "gathered": b.gathered })
}

/// The check: the shape counts equal `ParamCounts::of` on a built model (full and LoRA, tied and untied), in
/// every total the accounting reads.
fn check_counts() -> Result<()> {
    for tied in [false, true] {
        let cfg = shape(2, 64, 160, 96, tied);
        for lora in [None, Some(4)] {
            let mut model = LlamaModel::from_weights(&cfg, random_weights(&cfg, 1, DType::F32, &Device::Cpu)?)?;
            if let Some(r) = lora {
                model.add_lora(&LoraConfig::new(r))?;
            }
            let dims = model.dims();
            let built = ParamCounts::of(&mut model, &dims);
            let ours = counts(&cfg, lora);
            let mut a = built.elems.clone();
            let mut b = ours.elems.clone();
            a.sort_unstable();
            b.sort_unstable();
            if (a, built.frozen, built.largest_unit) != (b, ours.frozen, ours.largest_unit) {
                bail!("the shape counts differ from the built model's (tied {tied}, lora {lora:?})");
            }
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let dtype = match std::env::args().nth(1).as_deref() {
        None | Some("bf16") => DType::BF16,
        Some("f32") => DType::F32,
        Some(other) => bail!("unknown dtype {other:?}: give bf16 (the default) or f32"),
    };
    check_counts()?;
    let models =
        [("Llama-3.2-1B", shape(16, 2048, 8192, 128256, true)), ("Llama-3-8B", shape(32, 4096, 14336, 128256, false))];
    let b = dtype.size_in_bytes();
    for (name, cfg) in &models {
        for (mode, lora) in [("full", None), ("lora", Some(LORA_R))] {
            let c = counts(cfg, lora);
            let (n, f, block) = (c.elems.iter().sum::<usize>(), c.frozen, c.largest_unit);
            for world in [1usize, 2, 4, 8] {
                for level in ShardLevel::ALL {
                    let bytes = model_state_bytes_with(&c, dtype, level, world, true);
                    println!(
                        "{}",
                        json!({ "bench": "model_states", "model": name, "mode": mode, "dtype": dtype.as_str(),
                                "world": world, "sharding": level.name(), "trainable": n, "frozen": f,
                                "per_rank": state_json(&bytes), "gib_per_rank": bytes.total() as f64 / (1u64 << 30) as f64 })
                    );
                }
                let per = |x: usize| x.div_ceil(world);
                let gathered = if world > 1 { block * 2 } else { 0 };
                let zero3 = 16 * per(n) + 2 * per(f) + gathered;
                let fsdp2 = 16 * per(n) + 4 * per(f) + 2 * gathered + if world > 1 { 2 * block } else { 0 };
                let fsdp2_bf16_base = fsdp2 - 2 * per(f);
                let ours = model_state_bytes_with(&c, dtype, ShardLevel::Parameters, world, true).total();
                println!(
                    "{}",
                    json!({ "bench": "model_states_reference", "model": name, "mode": mode, "world": world,
                            "autosp_parameters": ours, "zero3": zero3, "fsdp2": fsdp2,
                            "fsdp2_bf16_base": fsdp2_bf16_base, "weight_bytes": b,
                            "gib": { "autosp_parameters": ours as f64 / (1u64 << 30) as f64,
                                     "zero3": zero3 as f64 / (1u64 << 30) as f64,
                                     "fsdp2": fsdp2 as f64 / (1u64 << 30) as f64,
                                     "fsdp2_bf16_base": fsdp2_bf16_base as f64 / (1u64 << 30) as f64 } })
                );
            }
        }
    }
    Ok(())
}
