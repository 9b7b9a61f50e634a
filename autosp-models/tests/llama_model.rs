//! The Llama model on the tape: recording and inference tapes agree bit for bit; every parameter gets a
//! gradient and the gradients match finite differences (f64); checkpoint regions do not change gradients;
//! positions are explicit (a shard's q/k equal the full run's slice); the module tree and the HF weight map
//! round-trip; bad inputs and bad weights give the typed errors.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use autosp_core::module::{visit_mut, Attention, NaiveAttention};
use autosp_core::ops::AttentionSpec;
use autosp_core::{CheckpointPolicy, Tape, Value};
use autosp_models::{random_weights, LlamaModel, ModelError, ModelType, TinySpec};
use candle_core::{DType, Device, Tensor};

/// A tiny random model of `spec` in `dtype`.
fn tiny(spec: &TinySpec, seed: u64, dtype: DType) -> LlamaModel {
    let cfg = spec.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, seed, dtype, &Device::Cpu).unwrap()).unwrap()
}

/// Deterministic token ids `[b, n]` below `vocab`.
fn ids(b: usize, n: usize, vocab: usize, seed: u64) -> Tensor {
    let mut s = seed;
    let v: Vec<u32> = (0..b * n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect();
    Tensor::from_vec(v, (b, n), &Device::Cpu).unwrap()
}

/// Next-token targets `[b * n]` for `ids: [b, n]`: shifted left, the last position and every 5th ignored.
fn targets(ids: &Tensor) -> Tensor {
    let rows = ids.to_vec2::<u32>().unwrap();
    let mut t = Vec::new();
    for row in &rows {
        for i in 0..row.len() {
            t.push(if i + 1 == row.len() || i % 5 == 4 { -100i64 } else { row[i + 1] as i64 });
        }
    }
    Tensor::new(t, &Device::Cpu).unwrap()
}

fn specs() -> Vec<TinySpec> {
    vec![
        TinySpec::default(),
        TinySpec { tied: true, heads: 4, kv_heads: 1, ..TinySpec::default() },
        TinySpec { model_type: ModelType::Qwen2, bias: true, ..TinySpec::default() },
    ]
}

#[test]
fn recording_tape_and_inference_tape_give_identical_logits() {
    for spec in specs() {
        let model = tiny(&spec, 7, DType::F32);
        let x = ids(2, 12, spec.vocab, 1);
        let pos: Vec<usize> = (0..12).collect();
        let a = model.logits(&Tape::new(CheckpointPolicy::None), &x, &pos).unwrap();
        let b = model.logits(&Tape::inference(), &x, &pos).unwrap();
        assert_eq!(a.dims(), &[2, 12, spec.vocab]);
        let (a, b) = (a.tensor().to_vec3::<f32>().unwrap(), b.tensor().to_vec3::<f32>().unwrap());
        assert_eq!(a, b, "{spec:?}: forward on the tape must equal the inference forward bit for bit");
    }
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for spec in specs() {
        let model = tiny(&spec, 3, DType::F32);
        let x = ids(2, 10, spec.vocab, 2);
        let pos: Vec<usize> = (0..10).collect();
        let tape = Tape::new(CheckpointPolicy::None);
        let (loss, count) = model.loss(&tape, &x, &pos, &targets(&x)).unwrap();
        assert_eq!(count, 2 * 8, "10 targets per row; the last and the 5th ignored");
        tape.backward(&loss).unwrap();
        let grads = tape.param_grads();
        let params = model.params();
        assert_eq!(params.len(), spec.config().expected_tensors().len());
        for p in &params {
            let g = grads.get(p).unwrap_or_else(|| panic!("{spec:?}: no gradient reached {}", p.name()));
            let m = g.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(m > 0.0 && m.is_finite(), "{}: gradient max |g| = {m}", p.name());
        }
    }
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    let qwen2 = TinySpec {
        model_type: ModelType::Qwen2,
        layers: 2,
        hidden: 16,
        intermediate: 24,
        heads: 4,
        kv_heads: 2,
        vocab: 32,
        tied: true,
        bias: true,
        rope_scaling: None,
        window: None,
    };
    // Qwen3: per-head q/k norms before RoPE; a window of 3 tokens on its second layer, over 7 tokens.
    let qwen3 = TinySpec { model_type: ModelType::Qwen3, window: Some(3), ..qwen2.clone() };
    // Gemma 3: (1 + w) norms around attention and MLP, scaled embeddings, GeGLU, its softmax scale, local
    // RoPE on the windowed first layer.
    let gemma3 = TinySpec { model_type: ModelType::Gemma3, window: Some(3), bias: false, ..qwen2.clone() };
    for spec in [qwen2, qwen3, gemma3] {
        finite_differences(&spec);
    }
}

fn finite_differences(spec: &TinySpec) {
    let model = tiny(spec, 11, DType::F64);
    let x = ids(1, 7, spec.vocab, 5);
    let pos: Vec<usize> = (3..10).collect();
    let t = targets(&x);
    let tape = Tape::new(CheckpointPolicy::None);
    let (loss, _) = model.loss(&tape, &x, &pos, &t).unwrap();
    tape.backward(&loss).unwrap();
    let grads = tape.param_grads();
    let eval = || -> f64 {
        let (l, _) = model.loss(&Tape::inference(), &x, &pos, &t).unwrap();
        l.tensor().to_scalar::<f64>().unwrap()
    };
    let by_name: HashMap<String, _> = model.params().into_iter().map(|p| (p.name().to_string(), p)).collect();
    let bias =
        if spec.bias { "model.layers.0.self_attn.k_proj.bias" } else { "model.layers.0.self_attn.k_proj.weight" };
    let names = [
        "model.embed_tokens.weight", // tied: embedding and head both contribute
        "model.layers.0.self_attn.q_proj.weight",
        bias,
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.1.post_feedforward_layernorm.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
    ];
    let eps = 1e-5;
    for name in names {
        let Some(p) = by_name.get(name) else {
            // Only some families have q/k norms (Qwen3, Gemma 3) and feed-forward norms (Gemma 3).
            let family = name.contains("feedforward") || (name.contains("_norm.") && !spec.model_type.qk_norm());
            assert!(family, "{:?}: {name} missing", spec.model_type);
            continue;
        };
        let base = p.tensor();
        let flat = base.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let g = grads.get(p).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for e in [0, flat.len() / 2, flat.len() - 1] {
            let at = |d: f64| {
                let mut v = flat.clone();
                v[e] += d;
                p.set(Tensor::from_vec(v, base.shape(), &Device::Cpu).unwrap()).unwrap();
                eval()
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
            p.set(base.clone()).unwrap();
            // Central differences in f64 with eps 1e-5: truncation ~eps^2 * f''' and rounding ~1e-16 / eps,
            // both far below 1e-6 relative.
            let err = (g[e] - numeric).abs();
            assert!(err <= 1e-6 * numeric.abs().max(1.0), "{name}[{e}]: analytic {} vs numeric {numeric}", g[e]);
        }
    }
}

#[test]
fn checkpoint_regions_leave_gradients_bit_identical() {
    let spec = TinySpec::default();
    let mut model = tiny(&spec, 5, DType::F32);
    let x = ids(1, 16, spec.vocab, 9);
    let pos: Vec<usize> = (0..16).collect();
    let t = targets(&x);
    let run = |model: &LlamaModel, policy| {
        let tape = Tape::new(policy);
        let (loss, _) = model.loss(&tape, &x, &pos, &t).unwrap();
        tape.backward(&loss).unwrap();
        let g = tape.param_grads();
        model
            .params()
            .iter()
            .map(|p| g.get(p).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect::<Vec<_>>()
    };
    let plain = run(&model, CheckpointPolicy::None);
    let mut regions = 0;
    visit_mut(&mut model, "", &mut |_, m| {
        if let Some(r) = m.region_slot() {
            r.set_enabled(true);
            regions += 1;
        }
    });
    assert_eq!(regions, spec.layers);
    // 16 tokens are one chunk of the MLP that recomputing regions use: its matmuls are the plain ones.
    for policy in [CheckpointPolicy::None, CheckpointPolicy::Full, CheckpointPolicy::SequenceAware] {
        assert_eq!(run(&model, policy), plain, "{policy:?}: gradients changed under checkpoint regions");
    }
}

#[test]
fn recomputing_regions_run_the_mlp_in_chunks_with_a_lower_peak() {
    // 3000 tokens: three chunks of the chunked MLP (1024 rows). Under Full the MLP's backward recomputes gate
    // and up per chunk, so no [3000, intermediate] tensor exists during backward; under None the block keeps
    // gate, up and their SwiGLU for the whole sequence. Gradients agree within 1e-5 of the largest element
    // (the weight gradients are summed chunk by chunk instead of in one matmul; f32).
    let mlp = tiny(&TinySpec::default(), 6, DType::F32).layers.0[0].mlp.clone();
    let (n, hidden) = (3000, TinySpec::default().hidden);
    let x = autosp_core::gradcheck::probe(&[1, n, hidden], 3, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let run = |policy| {
        let tape = Tape::new(policy);
        let xv = tape.leaf(x.clone());
        let y = tape.checkpoint("layers.0", |t| Ok(mlp.forward(t, &xv).unwrap())).unwrap();
        let loss = autosp_core::ops::sum_all(&tape, &autosp_core::ops::powf(&tape, &y, 2.0).unwrap()).unwrap();
        tape.backward(&loss).unwrap();
        let g = tape.param_grads();
        let mut grads = vec![tape.grad(&xv).unwrap().unwrap()];
        grads.extend([&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj].iter().map(|l| g.get(&l.weight).unwrap().clone()));
        (grads, tape.memory().peak_bytes)
    };
    let (plain, plain_peak) = run(CheckpointPolicy::None);
    let (chunked, chunked_peak) = run(CheckpointPolicy::Full);
    for (a, b) in chunked.iter().zip(&plain) {
        assert!(max_rel(a, b) <= 1e-5, "gradient off by {}", max_rel(a, b));
    }
    let intermediate = TinySpec::default().intermediate;
    assert!(plain_peak >= 3 * n * intermediate * 4, "None's peak {plain_peak} should hold gate, up and swiglu");
    assert!(chunked_peak * 2 < plain_peak, "chunked peak {chunked_peak} vs None's {plain_peak}");
}

/// An attention that records the q and k it is given, then runs the naive attention.
#[derive(Debug, Default)]
struct Recorder {
    seen: Mutex<Vec<(Tensor, Tensor)>>,
}

impl Attention for Recorder {
    fn describe(&self) -> String {
        "recorder".into()
    }
    fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        self.seen.lock().unwrap().push((q.tensor().clone(), k.tensor().clone()));
        NaiveAttention.forward(tape, q, k, v, spec)
    }
}

fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn explicit_positions_give_a_shard_the_full_runs_rotated_q_and_k() {
    let spec = TinySpec::default();
    let mut model = tiny(&spec, 2, DType::F32);
    let rec = Arc::new(Recorder::default());
    model.layers.0[0].self_attn.attention.set(rec.clone());
    let (n, k0, len) = (24, 9, 8);
    let x = ids(1, n, spec.vocab, 4);
    let full: Vec<usize> = (0..n).collect();
    model.hidden_states(&Tape::inference(), &x, &full).unwrap();
    let shard = x.narrow(1, k0, len).unwrap();
    model.hidden_states(&Tape::inference(), &shard, &(k0..k0 + len).collect::<Vec<_>>()).unwrap();
    model.hidden_states(&Tape::inference(), &shard, &(0..len).collect::<Vec<_>>()).unwrap();
    let seen = rec.seen.lock().unwrap();
    let (fq, fk) = (&seen[0].0.narrow(1, k0, len).unwrap(), &seen[0].1.narrow(1, k0, len).unwrap());
    // Layer 0's q/k depend only on the token and its position; the shard's matmul has fewer rows, so its
    // blocking (and rounding) may differ from the full run's: 1e-6 relative.
    assert!(max_rel(&seen[1].0, fq) < 1e-6, "q of the shard at positions [k, k+n) differs from the full run");
    assert!(max_rel(&seen[1].1, fk) < 1e-6, "k of the shard at positions [k, k+n) differs from the full run");
    // Control: the same tokens at positions [0, n) rotate differently.
    assert!(max_rel(&seen[2].0, fq) > 1e-2, "positions must change q");
}

#[test]
fn a_shard_after_its_prefix_in_the_cache_gives_the_full_sequences_logits() {
    let spec = TinySpec { tied: true, ..TinySpec::default() };
    let model = tiny(&spec, 8, DType::F32);
    let (n, k0) = (20, 12);
    let x = ids(2, n, spec.vocab, 6);
    let tape = Tape::inference();
    let full = model.logits(&tape, &x, &(0..n).collect::<Vec<_>>()).unwrap();
    let mut cache = model.new_cache();
    model.forward_cached(&tape, &x.narrow(1, 0, k0).unwrap(), &mut cache).unwrap();
    let shard = model.forward_cached(&tape, &x.narrow(1, k0, n - k0).unwrap(), &mut cache).unwrap();
    let expect = full.tensor().narrow(1, k0, n - k0).unwrap();
    assert!(max_rel(shard.tensor(), &expect) < 1e-5, "shard logits vs full-sequence logits");
}

#[test]
fn module_tree_names_slots_and_hf_weights_round_trip() {
    let spec = TinySpec { model_type: ModelType::Qwen2, bias: true, ..TinySpec::default() };
    let mut model = tiny(&spec, 1, DType::F32);
    let mut paths = Vec::new();
    visit_mut(&mut model, "", &mut |path, m| {
        if m.attention_slot().is_some() {
            paths.push(format!("{path} [attention]"));
        }
        if m.region_slot().is_some() {
            paths.push(format!("{path} [region]"));
        }
    });
    assert_eq!(
        paths,
        ["layers.0 [region]", "layers.0.self_attn [attention]", "layers.1 [region]", "layers.1.self_attn [attention]"]
    );
    let tree = autosp_core::module::describe_tree(&mut model);
    assert!(tree.contains("q_proj: Linear") && tree.contains("[attention: local]"), "{tree}");

    let w = model.to_weights();
    let mut names: Vec<_> = w.keys().cloned().collect();
    names.sort();
    let mut expected: Vec<_> = spec.config().expected_tensors().into_iter().map(|(n, _)| n).collect();
    expected.sort();
    assert_eq!(names, expected);
    let again = LlamaModel::from_weights(&model.config, w).unwrap();
    let x = ids(1, 6, spec.vocab, 3);
    let pos: Vec<usize> = (0..6).collect();
    let a = model.logits(&Tape::inference(), &x, &pos).unwrap().tensor().to_vec3::<f32>().unwrap();
    let b = again.logits(&Tape::inference(), &x, &pos).unwrap().tensor().to_vec3::<f32>().unwrap();
    assert_eq!(a, b);

    // Save, then load from the directory: the same logits, bit for bit.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m");
    model.save(&path, &autosp_models::SaveOptions::default()).unwrap();
    let loaded = LlamaModel::load(path.to_str().unwrap(), DType::F32).unwrap();
    let c = loaded.logits(&Tape::inference(), &x, &pos).unwrap().tensor().to_vec3::<f32>().unwrap();
    assert_eq!(a, c);
}

#[test]
fn bf16_weights_track_the_f32_model() {
    let spec = TinySpec { tied: true, ..TinySpec::default() };
    let f32m = tiny(&spec, 6, DType::F32);
    let bf16m = tiny(&spec, 6, DType::BF16);
    let x = ids(1, 10, spec.vocab, 2);
    let pos: Vec<usize> = (0..10).collect();
    let a = f32m.logits(&Tape::inference(), &x, &pos).unwrap();
    let b = bf16m.logits(&Tape::inference(), &x, &pos).unwrap();
    assert_eq!(b.dtype(), DType::BF16);
    // bf16 keeps 8 bits of mantissa (2^-8 = 0.4% per rounding); through two layers, 5% of the logits' scale.
    let r = max_rel(&b.tensor().to_dtype(DType::F32).unwrap(), a.tensor());
    assert!(r < 5e-2, "bf16 logits differ from f32 by {r} relative");
    let tape = Tape::new(CheckpointPolicy::None);
    let (loss, _) = bf16m.loss(&tape, &x, &pos, &targets(&x)).unwrap();
    tape.backward(&loss).unwrap();
    assert_eq!(tape.param_grads().len(), bf16m.params().len());
}

#[test]
fn bad_weights_are_typed_errors() {
    let cfg = TinySpec::default().config();
    let good = random_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
    let mut w = good.clone();
    w.remove("model.layers.1.mlp.up_proj.weight");
    match LlamaModel::from_weights(&cfg, w) {
        Err(ModelError::MissingWeight { name, expected }) => {
            assert_eq!(name, "model.layers.1.mlp.up_proj.weight");
            assert_eq!(expected, vec![128, 64]);
        }
        other => panic!("expected MissingWeight, got {other:?}"),
    }
    let mut w = good.clone();
    w.insert("model.norm.weight".into(), Tensor::zeros(65, DType::F32, &Device::Cpu).unwrap());
    assert!(
        matches!(LlamaModel::from_weights(&cfg, w), Err(ModelError::WeightShape { found, .. }) if found == vec![65])
    );
    let mut w = good;
    w.insert("model.layers.0.extra.weight".into(), Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap());
    assert!(
        matches!(LlamaModel::from_weights(&cfg, w), Err(ModelError::UnexpectedWeight { name, .. }) if name == "model.layers.0.extra.weight")
    );
}

#[test]
fn bad_inputs_are_typed_errors() {
    let spec = TinySpec::default();
    let model = tiny(&spec, 1, DType::F32);
    let tape = Tape::inference();
    let x = ids(1, 4, spec.vocab, 1);
    let pos = [0, 1, 2, 3];
    let oov = Tensor::new(&[[1u32, 2, 128, 3]], &Device::Cpu).unwrap();
    assert!(matches!(
        model.logits(&tape, &oov, &pos),
        Err(ModelError::TokenOutOfVocab { id: 128, index: 2, vocab: 128 })
    ));
    assert!(matches!(model.logits(&tape, &x, &pos[..3]), Err(ModelError::PositionsMismatch { positions: 3, seq: 4 })));
    let flat = x.flatten_all().unwrap();
    assert!(matches!(model.logits(&tape, &flat, &pos), Err(ModelError::BadIds { .. })));
    let as_i64 = x.to_dtype(DType::I64).unwrap();
    assert!(matches!(model.logits(&tape, &as_i64, &pos), Err(ModelError::BadIds { .. })));
    let short = Tensor::new(&[1i64, 2, 3], &Device::Cpu).unwrap();
    assert!(matches!(model.loss(&tape, &x, &pos, &short), Err(ModelError::TargetsMismatch { expected: 4, .. })));
    let msg = model.logits(&tape, &oov, &pos).unwrap_err().to_string();
    assert!(msg.contains("128") && msg.contains("vocabulary"), "{msg}");
}
