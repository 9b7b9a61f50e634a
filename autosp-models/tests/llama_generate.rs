//! Generation: KV-cache decoding equals a full recompute; greedy generation follows the argmax of the full
//! forward; sampling is reproducible by seed, follows the softmax, and top-p narrows it.

use autosp_core::Tape;
use autosp_models::llama::{argmax, sample, SampleRng};
use autosp_models::{random_weights, GenerateConfig, LlamaModel, ModelError, Sampling, TinySpec};
use candle_core::{DType, Device, Tensor};

fn tiny(spec: &TinySpec, seed: u64) -> LlamaModel {
    let cfg = spec.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, seed, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

/// `max |a - b| / max |b|`.
fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn kv_cache_decoding_equals_full_recompute() {
    for spec in [TinySpec::default(), TinySpec { kv_heads: 1, tied: true, ..TinySpec::default() }] {
        let model = tiny(&spec, 21);
        let toks: Vec<u32> = (0..18).map(|i| (i * 37 + 5) % spec.vocab as u32).collect();
        let x = Tensor::from_slice(&toks, (1, toks.len()), &Device::Cpu).unwrap();
        let tape = Tape::inference();
        let full = model.logits(&tape, &x, &(0..toks.len()).collect::<Vec<_>>()).unwrap();
        let mut cache = model.new_cache();
        let prefill = 6;
        let first = model.forward_cached(&tape, &x.narrow(1, 0, prefill).unwrap(), &mut cache).unwrap();
        // f32, two layers, different matmul shapes for the decode rows: 1e-5 relative to the logits' scale.
        assert!(max_rel(first.tensor(), &full.tensor().narrow(1, 0, prefill).unwrap()) < 1e-5);
        for i in prefill..toks.len() {
            let step = model.forward_cached(&tape, &x.narrow(1, i, 1).unwrap(), &mut cache).unwrap();
            let expect = full.tensor().narrow(1, i, 1).unwrap();
            let r = max_rel(step.tensor(), &expect);
            assert!(r < 1e-5, "{spec:?}: decode step at position {i}: relative error {r}");
        }
        assert_eq!(cache.len(), toks.len());
        let (k, v) = cache.layer(1).unwrap().get().unwrap();
        assert_eq!(k.dims(), &[1, toks.len(), spec.kv_heads, spec.hidden / spec.heads]);
        assert_eq!(v.dims(), k.dims());
    }
}

#[test]
fn cache_misuse_is_an_error() {
    let model = tiny(&TinySpec::default(), 1);
    let tape = Tape::inference();
    let mut cache = model.new_cache();
    let two = Tensor::new(&[[1u32, 2], [3, 4]], &Device::Cpu).unwrap();
    model.forward_cached(&tape, &two, &mut cache).unwrap();
    let one = Tensor::new(&[[5u32]], &Device::Cpu).unwrap();
    assert!(matches!(model.forward_cached(&tape, &one, &mut cache), Err(ModelError::Cache(_))));
    let mut wrong = autosp_models::KvCache::new(3);
    assert!(matches!(model.forward_cached(&tape, &one, &mut wrong), Err(ModelError::Cache(_))));
    assert!(matches!(model.generate(&[], &GenerateConfig::default()), Err(ModelError::Generate(_))));
}

#[test]
fn greedy_generation_follows_the_full_forward_argmax() {
    let spec = TinySpec::default();
    let model = tiny(&spec, 4);
    let prompt = [1u32, 17, 40, 99];
    let cfg = GenerateConfig { max_new_tokens: 8, stop_tokens: Some(vec![]), ..GenerateConfig::default() };
    let out = model.generate(&prompt, &cfg).unwrap();
    assert_eq!(out.tokens.len(), 8);
    assert!(!out.stopped);
    let mut seq = prompt.to_vec();
    for &t in &out.tokens {
        let x = Tensor::from_slice(&seq, (1, seq.len()), &Device::Cpu).unwrap();
        let logits = model.logits(&Tape::inference(), &x, &(0..seq.len()).collect::<Vec<_>>()).unwrap();
        let last = logits.tensor().narrow(1, seq.len() - 1, 1).unwrap().flatten_all().unwrap();
        assert_eq!(argmax(&last.to_vec1::<f32>().unwrap()) as u32, t);
        seq.push(t);
    }
    // Stopping: make the first greedy token the stop token.
    let stop = GenerateConfig { stop_tokens: Some(vec![out.tokens[0]]), ..cfg.clone() };
    let s = model.generate(&prompt, &stop).unwrap();
    assert_eq!(s.tokens, vec![out.tokens[0]]);
    assert!(s.stopped);
    // A tiny top-p keeps only the most likely token: the same as greedy.
    let narrow = GenerateConfig { sampling: Sampling::TopP { temperature: 1.0, top_p: 1e-9 }, ..cfg.clone() };
    assert_eq!(model.generate(&prompt, &narrow).unwrap().tokens, out.tokens);
    // Seeded sampling is reproducible, and a different seed gives a different draw on a random model.
    let hot = |seed| GenerateConfig { sampling: Sampling::Temperature(2.0), seed, ..cfg.clone() };
    let a = model.generate(&prompt, &hot(1)).unwrap().tokens;
    assert_eq!(a, model.generate(&prompt, &hot(1)).unwrap().tokens);
    assert_ne!(a, model.generate(&prompt, &hot(2)).unwrap().tokens);
}

#[test]
fn sampling_follows_the_softmax_and_top_p() {
    // p = softmax([0, ln 3, -inf-ish]) = [0.25, 0.75, ~0].
    let logits = [0.0f32, 3f32.ln(), -60.0];
    let mut rng = SampleRng::new(42);
    let n = 20_000;
    let mut counts = [0usize; 3];
    for _ in 0..n {
        counts[sample(&logits, &Sampling::Temperature(1.0), &mut rng).unwrap() as usize] += 1;
    }
    // Binomial std at p = 0.25, n = 20000 is 0.003: 0.015 is 5 sigma.
    let f1 = counts[1] as f64 / n as f64;
    assert!((f1 - 0.75).abs() < 0.015, "token 1 drawn {f1} of the time, expected 0.75");
    assert_eq!(counts[2], 0);
    // Temperature 0.5 sharpens to [0.1, 0.9].
    let mut c1 = 0;
    for _ in 0..n {
        c1 += (sample(&logits, &Sampling::Temperature(0.5), &mut rng).unwrap() == 1) as usize;
    }
    assert!((c1 as f64 / n as f64 - 0.9).abs() < 0.015);
    // top_p 0.7 < 0.75 keeps only token 1.
    for _ in 0..100 {
        assert_eq!(sample(&logits, &Sampling::TopP { temperature: 1.0, top_p: 0.7 }, &mut rng).unwrap(), 1);
    }
    assert_eq!(sample(&logits, &Sampling::Greedy, &mut rng).unwrap(), 1);
    assert!(sample(&logits, &Sampling::Temperature(0.0), &mut rng).is_err());
    assert!(sample(&logits, &Sampling::TopP { temperature: 1.0, top_p: 1.5 }, &mut rng).is_err());
}
