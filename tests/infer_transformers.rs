//! Our greedy continuation equals transformers' `generate` on checkpoints transformers made
//! (`tests/fixtures/generate/golden.json`, by `tests/fixtures/make_generate_golden.py`): a plain GQA Llama, a
//! dynamic-NTK Llama and a LongRoPE Phi-3 whose decoding crosses the original window of 32 positions (the
//! prompt is 24 tokens, 16 new ones), at P = 1 and over 2 thread ranks (Ulysses, Ring).

use std::path::PathBuf;
use std::time::Duration;

use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp::core::comm::run_ranks;
use autosp::core::CheckpointPolicy;
use autosp::infer::{GenerateConfig, Sampling};
use autosp::models::LlamaModel;
use candle_core::DType;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

struct Case {
    checkpoint: String,
    prompt: Vec<u32>,
    tokens: Vec<u32>,
}

fn golden() -> Vec<Case> {
    let path = fixtures().join("generate/golden.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (make it with tests/fixtures/make_generate_golden.py)", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    json.as_object()
        .unwrap()
        .values()
        .map(|c| Case {
            checkpoint: c["checkpoint"].as_str().unwrap().to_string(),
            prompt: ids(&c["prompt"]),
            tokens: ids(&c["tokens"]),
        })
        .collect()
}

#[test]
fn greedy_continuations_equal_transformers_generate() {
    let cases = golden();
    assert_eq!(cases.len(), 3);
    for case in &cases {
        let dir = fixtures().join(&case.checkpoint);
        let gen = GenerateConfig {
            max_new_tokens: case.tokens.len(),
            sampling: Sampling::Greedy,
            seed: 0,
            stop_tokens: Some(vec![]),
        };
        for (p, strategy) in [(1, Strategy::Ulysses), (2, Strategy::Ulysses), (2, Strategy::Ring)] {
            let out = run_ranks(p, Duration::from_secs(120), |pg| -> Result<Vec<u32>, String> {
                let model = LlamaModel::load(dir.to_str().unwrap(), DType::F32).map_err(|e| e.to_string())?;
                let policy = Checkpointing::Policy(CheckpointPolicy::None);
                let c = compile(model, CompileConfig::new(pg, strategy, policy)).map_err(|e| e.to_string())?;
                Ok(c.generate(&case.prompt, &gen).map_err(|e| e.to_string())?.tokens)
            });
            for (r, tokens) in out.into_iter().enumerate() {
                let tokens = tokens.expect("rank panicked").expect("generation failed");
                assert_eq!(tokens, case.tokens, "{}: P = {p}, {strategy:?}, rank {r}", case.checkpoint);
            }
        }
    }
}
