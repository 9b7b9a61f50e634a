//! A sliding attention window (`CompileConfig::with_max_attention_distance`, `LlamaModel::
//! set_max_attention_distance`) through the compiled tiny Llama: one training step at P = 2 and 4 (Ulysses,
//! Ring, hybrid, Auto; every checkpoint policy at P = 2) equals the uncompiled single-rank model with the same
//! window (its naive attention), within the tolerances of `compile_llama.rs`; a window that hides nothing
//! gives the unwindowed step (bit for bit where the same kernels run, else within those tolerances); the
//! window really changes the result; logits and cached decoding honour it; `explain()` names it.

mod common;

use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::optim::{AdamW, AdamWConfig, Optimizer};
use autosp_core::{CheckpointPolicy, Tape};
use autosp_models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};
use common::Outcome;

fn tiny() -> LlamaModel {
    // 4 heads, 2 kv heads, vocab 128: the model of compile_llama.rs.
    let spec = TinySpec { hidden: 32, intermediate: 64, ..TinySpec::default() };
    let cfg = spec.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, 7, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

fn tiny_windowed(w: Option<usize>) -> LlamaModel {
    let mut m = tiny();
    m.set_max_attention_distance(w);
    m
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

/// The tiny model compiled on `p` thread ranks with the window `w`, trained one step (as `common::compiled`).
fn compiled(p: usize, n: usize, strategy: Strategy, policy: CheckpointPolicy, w: Option<usize>) -> Outcome {
    let out = run_ranks(p, std::time::Duration::from_secs(60), move |pg| {
        let cfg = CompileConfig::new(pg, strategy, Checkpointing::Policy(policy)).with_max_attention_distance(w);
        let c = compile(tiny(), cfg).map_err(|e| e.to_string())?;
        assert_eq!(c.max_attention_distance(), w);
        let (ids, labels) = common::batch(n, 128);
        let step = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
        let params = c.params();
        let g: Vec<Vec<f32>> = params.iter().map(|p| flat(step.grads.get(p).unwrap())).collect();
        AdamW::new(AdamWConfig::default()).unwrap().step(&params, &step.grads, 1e-2).unwrap();
        Ok::<Outcome, String>((step.loss, g, params.iter().map(|p| flat(&p.tensor())).collect()))
    });
    let mut results: Vec<Outcome> = out.into_iter().map(|r| r.expect("rank failed").expect("step failed")).collect();
    let first = results.remove(0);
    for other in results {
        assert_eq!(other.1, first.1, "every rank must hold the same gradients");
    }
    first
}

fn assert_same_bits(what: &str, a: &Outcome, b: &Outcome) {
    assert_eq!(a.0.to_bits(), b.0.to_bits(), "{what}: loss {} vs {}", a.0, b.0);
    assert_eq!(a.1, b.1, "{what}: gradients");
    assert_eq!(a.2, b.2, "{what}: parameters after AdamW");
}

/// n = 50 (padded to 52 for the zigzag layouts): windows of 0 (each token sees itself), 1, 5 (smaller than a
/// shard: Ring skips most block pairs) and 20 (crosses shards). Under a window of 0 each token's softmax has
/// one term, so q and k do not affect the loss: the q/k projections' gradients are 0 up to rounding noise
/// (different noise on each side), and that window compares the loss and the gradients of every parameter
/// whose reference gradient is not below 1e-6 of the largest one.
#[test]
fn windowed_steps_match_the_single_rank_model() {
    let n = 50;
    for w in [0, 1, 5, 20] {
        let want = common::reference(tiny_windowed(Some(w)), n);
        let unwindowed = common::reference(tiny(), n);
        assert!((want.0 - unwindowed.0).abs() > 1e-4 * unwindowed.0.abs(), "w {w}: the window changes nothing");
        let mut runs: Vec<(usize, Strategy, CheckpointPolicy)> = Vec::new();
        for s in common::strategies(2) {
            for policy in [CheckpointPolicy::None, CheckpointPolicy::Full, CheckpointPolicy::SequenceAware] {
                runs.push((2, s, policy));
            }
        }
        runs.push((1, Strategy::Auto, CheckpointPolicy::SequenceAware));
        runs.push((4, Strategy::Ring, CheckpointPolicy::SequenceAware));
        runs.push((4, Strategy::Hybrid { ulysses: 2 }, CheckpointPolicy::SequenceAware));
        for (p, s, policy) in runs {
            let got = compiled(p, n, s, policy, Some(w));
            let what = format!("w {w} P={p} {s:?} {policy:?}");
            if w > 0 {
                common::assert_close(&what, &got, &want, common::tolerance(s, p));
                continue;
            }
            let tol = common::tolerance(s, p);
            assert!((got.0 - want.0).abs() <= tol * want.0.abs(), "{what}: loss {} vs {}", got.0, want.0);
            let largest = want.1.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
            let mut compared = 0;
            for (i, (g, r)) in got.1.iter().zip(&want.1).enumerate() {
                let noise = r.iter().fold(0f32, |m, x| m.max(x.abs())) < 1e-6 * largest;
                if !noise {
                    assert!(common::rel(g, r) <= tol, "{what}: gradient {i} off by {:e}", common::rel(g, r));
                    compared += 1;
                }
            }
            // Every layer's q and k projections are the only vanishing gradients: 2 layers x 2.
            assert_eq!(compared, want.1.len() - 4, "{what}: only the q/k projections' gradients vanish");
        }
    }
}

/// A window of at least every distance in the padded sequence runs the same kernel calls as no window: the
/// same bits. A window of n - 1 hides no pair of real tokens but, under the zigzag layouts, cuts the pads'
/// rows (padded to 52), which changes how Ring groups its calls: equal within the Ring tolerance there, bit
/// for bit at P = 1 (one flash call, the same masks).
#[test]
fn a_window_that_hides_nothing_changes_nothing() {
    let n = 50;
    for (p, s) in
        [(1, Strategy::Auto), (2, Strategy::Ulysses), (2, Strategy::Ring), (4, Strategy::Hybrid { ulysses: 2 })]
    {
        let policy = CheckpointPolicy::SequenceAware;
        let plain = compiled(p, n, s, policy, None);
        assert_same_bits(&format!("P={p} {s:?} w 10n"), &compiled(p, n, s, policy, Some(10 * n)), &plain);
        let edge = compiled(p, n, s, policy, Some(n - 1));
        if p == 1 {
            assert_same_bits(&format!("P={p} {s:?} w n-1"), &edge, &plain);
        } else {
            common::assert_close(&format!("P={p} {s:?} w n-1"), &edge, &plain, common::tolerance(s, p));
        }
    }
}

/// Logits of the compiled model, of the uncompiled model, and token-by-token cached decoding all apply the
/// window (the uncompiled model's naive attention is the reference; 1e-5 · P relative to the largest logit,
/// the tolerance of `compile_llama.rs`).
#[test]
fn logits_and_cached_decoding_honour_the_window() {
    let (n, w) = (24, 3);
    let (ids, _) = common::batch(n, 128);
    let model = tiny_windowed(Some(w));
    let positions: Vec<usize> = (0..n).collect();
    let want = model.logits(&Tape::inference(), &ids, &positions).unwrap().into_tensor();
    let plain = tiny().logits(&Tape::inference(), &ids, &positions).unwrap().into_tensor();
    let rel = |a: &Tensor, b: &Tensor| common::rel(&flat(a), &flat(b));
    assert!(rel(&plain, &want) > 1e-3, "the window changes nothing");

    // Cached decoding: a prefix of 10 tokens, then one token at a time.
    let mut cache = model.new_cache();
    let mut parts = vec![model.forward_cached(&Tape::inference(), &ids.narrow(1, 0, 10).unwrap(), &mut cache).unwrap()];
    for i in 10..n {
        parts.push(model.forward_cached(&Tape::inference(), &ids.narrow(1, i, 1).unwrap(), &mut cache).unwrap());
    }
    let parts: Vec<Tensor> = parts.into_iter().map(|v| v.into_tensor()).collect();
    let cached = Tensor::cat(&parts, 1).unwrap();
    assert!(rel(&cached, &want) <= 1e-5, "cached decoding differs by {:e}", rel(&cached, &want));

    for (p, s) in [(2, Strategy::Ulysses), (2, Strategy::Ring), (4, Strategy::Hybrid { ulysses: 2 })] {
        let ids = ids.clone();
        let out = run_ranks(p, std::time::Duration::from_secs(30), move |pg| {
            let cfg = CompileConfig::new(pg, s, Checkpointing::Policy(CheckpointPolicy::None))
                .with_max_attention_distance(Some(w));
            let c = compile(tiny(), cfg).map_err(|e| e.to_string())?;
            c.logits(&ids).map_err(|e| e.to_string())
        });
        for r in out {
            let got = r.unwrap().unwrap();
            assert!(rel(&got, &want) <= 1e-5 * p as f64, "P={p} {s:?}: logits differ by {:e}", rel(&got, &want));
        }
    }
}

/// `explain()` names the window, and its attention FLOPs fall with it.
#[test]
fn explain_names_the_window() {
    let out = run_ranks(1, std::time::Duration::from_secs(30), |pg| {
        let plan = |w: Option<usize>| {
            let cfg = CompileConfig::new(pg.clone(), Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None))
                .with_max_attention_distance(w);
            let mut c = compile(tiny(), cfg).unwrap();
            (c.explain(64).unwrap(), c.plan(64).unwrap().flops.attention)
        };
        (plan(Some(7)), plan(None))
    });
    let ((text, windowed), (plain_text, plain)) = out.into_iter().next().unwrap().unwrap();
    assert!(text.contains("attention window") && text.contains("max distance 7"), "{text}");
    assert!(!plain_text.contains("attention window"), "{plain_text}");
    // 64 tokens, w = 7: Σ min(p + 1, 8) = 36 + 56 · 8 = 484 of 2080 pairs.
    let ratio = windowed / plain;
    assert!((ratio - 484.0 / 2080.0).abs() < 1e-12, "attention FLOPs ratio {ratio}");
}
