//! Generation over ranks with a sliding attention window (Mistral's `sliding_window` on every layer, Gemma 3's
//! local layers before a global one): each decoded token at position `t` attends only the cached keys at
//! positions `t - (sliding_window - 1)` to `t`, as the training forward masks. At P = 1, 2 and 4 (Ulysses and
//! Ring's zigzag shards), the greedy tokens equal those of repeated full forwards of the one-rank model over
//! the whole sequence, and every step's logits agree with the full forward's last row within 1e-5 relative
//! (f32); with a window of 3 at P = 4 some ranks hold no key in the window (they send `lse = -inf`).

use std::time::Duration;

use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp::core::comm::run_ranks;
use autosp::core::{CheckpointPolicy, Tape};
use autosp::infer::{GenerateConfig, Sampling};
use autosp::models::config::ModelType;
use autosp::models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};

/// 2 layers, 4 heads, 2 kv heads, head_dim 16, vocab 128, random f32 weights, a window of `window` tokens
/// (none when `None`) on the layers `model_type` puts it on.
fn windowed(model_type: ModelType, window: Option<usize>) -> LlamaModel {
    let cfg = TinySpec { model_type, window, ..TinySpec::default() }.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, 5, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 29 + 3) % 128).collect()
}

/// `max_i |a_i - b_i| / max_i |b_i|`.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let m = b.iter().map(|x| x.abs()).fold(0f32, f32::max);
    (d / m) as f64
}

/// The logits `[vocab]` of the last position of one full forward of `model` over `seq` (no cache).
fn last_logits(model: &LlamaModel, seq: &[u32]) -> Vec<f32> {
    let tape = Tape::inference();
    let ids = Tensor::from_vec(seq.to_vec(), (1, seq.len()), &Device::Cpu).unwrap();
    let positions: Vec<usize> = (0..seq.len()).collect();
    let logits = model.logits(&tape, &ids, &positions).unwrap().into_tensor();
    logits.narrow(1, seq.len() - 1, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// Greedy generation of `new` tokens by repeated full forwards: the tokens and each step's logits.
fn by_full_forwards(model: &LlamaModel, prompt: &[u32], new: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (mut seq, mut steps) = (prompt.to_vec(), Vec::new());
    for _ in 0..new {
        let logits = last_logits(model, &seq);
        let next = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        seq.push(next);
        steps.push(logits);
    }
    (seq[prompt.len()..].to_vec(), steps)
}

/// Every rank's greedy tokens and step logits of the model `make` builds, compiled on `p` thread ranks
/// (`distance`: `--max-attention-distance`).
fn generate_on(
    p: usize,
    strategy: Strategy,
    make: impl Fn() -> LlamaModel + Sync,
    distance: Option<usize>,
    prompt: &[u32],
    new: usize,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let gen = GenerateConfig { max_new_tokens: new, sampling: Sampling::Greedy, seed: 0, stop_tokens: Some(vec![]) };
    let out = run_ranks(p, Duration::from_secs(120), |pg| -> Result<_, String> {
        let cfg = CompileConfig::new(pg, strategy, Checkpointing::Policy(CheckpointPolicy::None))
            .with_max_attention_distance(distance);
        let c = compile(make(), cfg).map_err(|e| e.to_string())?;
        let mut logits = Vec::new();
        let out = c
            .generate_streaming(prompt, &gen, |e| {
                logits.push(e.logits.to_vec());
                true
            })
            .map_err(|e| e.to_string())?;
        Ok((out.tokens, logits))
    });
    out.into_iter().map(|r| r.expect("rank panicked").expect("generation failed")).collect()
}

#[test]
fn windowed_decoding_over_ranks_equals_repeated_full_forwards() {
    let (n, new) = (40, 12);
    let prompt = prompt(n);
    let cases = [
        (ModelType::Mistral, 24, vec![(1, Strategy::Ulysses), (2, Strategy::Ulysses), (2, Strategy::Ring)]),
        (ModelType::Gemma3, 24, vec![(1, Strategy::Ulysses), (2, Strategy::Ring)]),
        (ModelType::Mistral, 3, vec![(4, Strategy::Ulysses)]),
    ];
    for (model_type, window, runs) in cases {
        let (want, want_logits) = by_full_forwards(&windowed(model_type, Some(window)), &prompt, new);
        // The window matters here: without it the last step's logits are others.
        let (_, wide) = by_full_forwards(&windowed(model_type, None), &prompt, new);
        assert!(rel(&wide[new - 1], &want_logits[new - 1]) > 1e-3, "{model_type:?} window {window} changes nothing");
        for (p, strategy) in runs {
            let what = format!("{model_type:?}, window {window}, P = {p} {strategy:?}");
            for (r, (tokens, logits)) in
                generate_on(p, strategy, || windowed(model_type, Some(window)), None, &prompt, new).iter().enumerate()
            {
                assert_eq!(tokens, &want, "{what}: rank {r}: greedy tokens against full forwards");
                assert_eq!(logits.len(), new);
                for (i, (a, b)) in logits.iter().zip(&want_logits).enumerate() {
                    let e = rel(a, b);
                    assert!(e < 1e-5, "{what}: rank {r}, step {i}: logits differ by {e} relative");
                }
            }
        }
    }
}

/// `--max-attention-distance 16` on a model without a window of its own (the compile step's window, in every
/// layer's slot): a prompt of 12 and 8 new tokens pass it, and decoding equals full forwards that mask so.
#[test]
fn the_compile_steps_window_is_honoured_too() {
    let (prompt, new, distance) = (prompt(12), 8, 16);
    let mut reference = windowed(ModelType::Llama, None);
    for layer in reference.layers.0.iter_mut() {
        layer.self_attn.attention.set_max_distance(Some(distance));
    }
    let (want, want_logits) = by_full_forwards(&reference, &prompt, new);
    let (_, wide) = by_full_forwards(&windowed(ModelType::Llama, None), &prompt, new);
    assert!(rel(&wide[new - 1], &want_logits[new - 1]) > 1e-3, "the distance changes nothing");
    for (p, strategy) in [(1, Strategy::Ulysses), (2, Strategy::Ring)] {
        let runs = generate_on(p, strategy, || windowed(ModelType::Llama, None), Some(distance), &prompt, new);
        for (r, (tokens, logits)) in runs.iter().enumerate() {
            assert_eq!(tokens, &want, "P = {p}: rank {r}: greedy tokens against full forwards");
            for (i, (a, b)) in logits.iter().zip(&want_logits).enumerate() {
                assert!(rel(a, b) < 1e-5, "P = {p}: rank {r}, step {i}: logits differ by {} relative", rel(a, b));
            }
        }
    }
}
