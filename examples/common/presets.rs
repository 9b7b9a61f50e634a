//! The model shapes with random weights that the benches take by name (`--preset`), written once: each a
//! [`TinySpec`] and its RoPE base, made into a config with room for the positions a run needs. Included by
//! `bench_decode`, `bench_memory`, `bench_checkpoint` and `grad_compare` (`#[path]`); not an example of its own.

use anyhow::{bail, Result};
use autosp::models::{LlamaConfig, TinySpec};

/// The names [`preset_config`] takes, in the order its error lists them.
pub const PRESETS: [&str; 4] = ["tiny", "bench", "smollm2-135m", "llama-3.2-1b"];

/// `name`'s shape and RoPE base: `tiny` (TinySpec's default: 2 layers, hidden 64, 4 heads, 2 kv heads, vocab
/// 128; theta 10000), `bench` (vocab 32000, hidden 512, intermediate 1376, 4 layers, 8 heads, 4 kv heads,
/// untied; theta 10000), `smollm2-135m` (30 layers, hidden 576, intermediate 1536, 9 heads, 3 kv heads, vocab
/// 49152, tied; theta 100000) or `llama-3.2-1b` (vocab 128256, hidden 2048, intermediate 8192, 16 layers, 32
/// heads, 8 kv heads, tied; theta 500000: 1.24 B parameters).
fn spec(name: &str) -> Option<(TinySpec, f64)> {
    let base = TinySpec::default();
    Some(match name {
        "tiny" => (base, 10000.0),
        "bench" => (
            TinySpec {
                layers: 4,
                hidden: 512,
                intermediate: 1376,
                heads: 8,
                kv_heads: 4,
                vocab: 32000,
                tied: false,
                ..base
            },
            10000.0,
        ),
        "smollm2-135m" => (
            TinySpec {
                layers: 30,
                hidden: 576,
                intermediate: 1536,
                heads: 9,
                kv_heads: 3,
                vocab: 49152,
                tied: true,
                ..base
            },
            100000.0,
        ),
        "llama-3.2-1b" => (
            TinySpec {
                layers: 16,
                hidden: 2048,
                intermediate: 8192,
                heads: 32,
                kv_heads: 8,
                vocab: 128256,
                tied: true,
                ..base
            },
            500000.0,
        ),
        _ => return None,
    })
}

/// The config of preset `name` (see [`PRESETS`]) with room for `max_n` positions at least.
pub fn preset_config(name: &str, max_n: usize) -> Result<LlamaConfig> {
    let Some((spec, rope_theta)) = spec(name) else {
        bail!("unknown --preset {name:?}: use one of {}", PRESETS.join(", "))
    };
    let mut cfg = spec.config();
    cfg.rope_theta = rope_theta;
    cfg.max_position_embeddings = max_n.max(cfg.max_position_embeddings);
    Ok(cfg)
}
