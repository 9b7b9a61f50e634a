//! How a step reduces its gradients over the world (issue #41 item 5), on thread ranks:
//! - Accumulation: a step of 2 or 3 micro-batches keeps local gradients and reduces once, after the last;
//!   its gradients equal those of one reduction per micro-batch (the trainer's way before) within 1e-6,
//!   and a recording process group shows one gradient reduction round per step (at `none` and `optimizer`;
//!   at `gradients` and `parameters` the tape reduce-scatters per use, every micro-batch).
//! - `--reduce-dtype bf16`: gradients within 1e-2 (of the largest) of f32's, half the reduction bytes (as the
//!   plan's accounting says); f32 is bit for bit the reduction after backward; a bad dtype and an empty
//!   bucket are refused naming the option.
//! - Overlap: buckets are posted from the communication thread while backward still runs (the recording
//!   shows the first bucket's backward mark before the end), and the gradients are bit for bit those of the
//!   reduction after backward, at every level, at 1 × 2 and 2 × 2; at `gradients` and `parameters` each
//!   use's reduce-scatter goes from the `grad-scatter` thread the same way, bit for bit the inline one's.
//! - At `gradients` and `parameters` the per-use reduce-scatters travel in bf16 too (inline and overlapped):
//!   within 1e-2 of f32, fewer bytes in the plan's accounting.
//! - At `none` a gradient larger than a bucket is all-reduced in bucket-sized pieces: no gradient all-reduce
//!   carries more than a bucket, and the gradients are bit for bit those of buckets that hold it whole.
//!
//! Tolerances: gradients are compared as max |a - b| over max |b| per parameter. Deferring the reduction sums
//! the same products in another order (Σ_i w_i · Σ_r g_ri against Σ_r Σ_i w_i · g_ri, in f32): a few ulps,
//! 1e-6. bf16 rounds each rank's contribution and each reduced chunk once to 8 bits (2^-9 relative each):
//! about 4e-3 of an element's magnitude, 1e-2 of the largest.

mod common;

use std::sync::Arc;
use std::time::Duration;

use autosp::compile::{compile, Accumulation, Checkpointing, CompileConfig, GradReduction, Mesh, Strategy};
use autosp::core::comm::{run_ranks, CallRecord, Collective, ProcessGroup};
use autosp::core::{CausalLm, CheckpointPolicy, ShardLevel};
use autosp::models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};
use common::rel;

/// Buckets of 32 KiB: the tiny model's LM head (128 × 64 f32) is a bucket of its own, and there are several.
const BUCKET_BYTES: usize = 32 << 10;

/// Micro-batch `m` of a step: two sequences of 32 tokens (one per replica at D = 2), labels partly ignored so
/// the micro-batches weigh differently.
fn micro_batch(vocab: usize, m: usize) -> (Tensor, Tensor) {
    let (b, n) = (2, 32);
    let ids: Vec<u32> = (0..(b * n) as u32).map(|i| (i * 13 + 7 + 11 * m as u32) % vocab as u32).collect();
    let labels: Vec<i64> =
        ids.iter().enumerate().map(|(i, &x)| if i % n < 2 + 3 * m || i % 5 == m { -100 } else { x as i64 }).collect();
    (Tensor::from_vec(ids, (b, n), &Device::Cpu).unwrap(), Tensor::from_vec(labels, (b, n), &Device::Cpu).unwrap())
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

/// What one rank saw: whole gradients (model order) and the calls recorded while it made them.
struct Seen {
    grads: Vec<Vec<f32>>,
    records: Vec<CallRecord>,
    /// Bytes this rank sent in all-reduces and reduce-scatters (the comm counters).
    reduce_bytes: u64,
    /// What the plan's accounting says the gradient reduction sends per step
    /// (`Compiled::model_state_comm_bytes`).
    planned: u64,
}

/// How a test runs one step of `micro` micro-batches.
#[derive(Clone, Copy, PartialEq)]
enum Way {
    /// One `train_step` per micro-batch, each reduced, token-weighted on the host (the trainer before).
    PerMicroBatch,
    /// One `Accumulation`, reduced once.
    Accumulated,
}

/// One step of `micro` micro-batches on a `mesh` of thread ranks at `level`, reduced as `reduction` says.
fn step(mesh: Mesh, level: ShardLevel, reduction: GradReduction, micro: usize, way: Way) -> Vec<Seen> {
    common::recorded_tiny_ranks(TinySpec::default(), 5, mesh.world(), |model, recorder| {
        let world: Arc<dyn ProcessGroup> = recorder.clone();
        let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
        let cfg = CompileConfig::new(world.clone(), Strategy::Auto, policy)
            .with_mesh(mesh)
            .with_sharding(level)
            .with_reduction(reduction);
        let c = compile(model, cfg).map_err(|e| e.to_string())?;
        recorder.clear();
        world.reset_stats();
        let vocab = c.model().dims().vocab;
        let grads = match way {
            Way::Accumulated => {
                let mut acc = Accumulation::new(micro);
                for m in 0..micro {
                    let (ids, labels) = micro_batch(vocab, m);
                    c.accumulate_step(&mut acc, &ids, Some(&labels), None, 1.0, m + 1 == micro)
                        .map_err(|e| e.to_string())?;
                }
                c.finish_accumulation(acc).map_err(|e| e.to_string())?
            }
            Way::PerMicroBatch => {
                let mut sum = autosp::core::Gradients::new();
                let mut count = 0usize;
                for m in 0..micro {
                    let (ids, labels) = micro_batch(vocab, m);
                    let out = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
                    let w = if micro > 1 { out.valid_tokens as f64 } else { 1.0 };
                    for p in c.params() {
                        sum.accumulate(&p, &(out.grads.get(&p).unwrap() * w).unwrap()).unwrap();
                    }
                    count += out.valid_tokens;
                }
                if micro > 1 {
                    sum.scale(1.0 / count as f64).unwrap();
                }
                sum
            }
        };
        let records = recorder.records();
        let stats = world.stats();
        let reduce_bytes = stats.bytes_sent(Collective::AllReduce) + stats.bytes_sent(Collective::ReduceScatter);
        let planned = c.model_state_comm_bytes();
        let whole = c.whole_grads(&grads).map_err(|e| e.to_string())?;
        Ok(Seen {
            grads: c.params().iter().map(|p| flat(whole.get(p).unwrap())).collect(),
            records,
            reduce_bytes,
            planned,
        })
    })
}

/// The gradient reductions among `records`: all-reduces and reduce-scatters of more than one element (the
/// loss and token-count all-reduces carry one).
fn gradient_reductions(records: &[CallRecord]) -> Vec<&CallRecord> {
    records
        .iter()
        .filter(|r| matches!(r.collective, Collective::AllReduce | Collective::ReduceScatter) && r.elems > 1)
        .collect()
}

fn assert_grads_close(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = rel(g, w);
        assert!(e <= tol, "{what}: gradient {i} off by {e:e} (tolerance {tol:e})");
    }
}

fn buckets(overlap: bool) -> GradReduction {
    GradReduction { bucket_bytes: BUCKET_BYTES, overlap, ..GradReduction::default() }
}

#[test]
fn accumulation_reduces_once_per_step_and_matches_a_reduction_per_micro_batch() {
    for mesh in [Mesh::new(1, 2), Mesh::new(2, 1)] {
        for level in ShardLevel::ALL {
            for (micro, overlap) in [(2, true), (3, false)] {
                let what = format!("{} × {}, {level}, {micro} micro-batches", mesh.data, mesh.sequence);
                let before = step(mesh, level, buckets(overlap), micro, Way::PerMicroBatch);
                let now = step(mesh, level, buckets(overlap), micro, Way::Accumulated);
                for (r, (b, n)) in before.iter().zip(&now).enumerate() {
                    assert_grads_close(&format!("{what}, rank {r}"), &n.grads, &b.grads, 1e-6);
                    let (rb, rn) = (gradient_reductions(&b.records).len(), gradient_reductions(&n.records).len());
                    if level <= ShardLevel::Optimizer {
                        // One round of buckets per step, where there was one per micro-batch.
                        assert!(rn > 1, "{what}, rank {r}: {rn} bucket reductions (want several buckets)");
                        assert_eq!(rb, micro * rn, "{what}, rank {r}: {rb} reductions before, {rn} now");
                    } else {
                        // The tape reduce-scatters each use's gradient in every micro-batch's backward.
                        assert_eq!(rb, rn, "{what}, rank {r}: the per-use reduce-scatters stay");
                    }
                }
            }
        }
    }
}

#[test]
fn bf16_reduction_halves_the_bytes_within_bf16_rounding_and_f32_is_unchanged() {
    let mesh = Mesh::new(1, 2);
    for level in [ShardLevel::None, ShardLevel::Optimizer] {
        let after = step(mesh, level, buckets(false), 1, Way::Accumulated);
        let f32_default = step(mesh, level, GradReduction::default(), 1, Way::Accumulated);
        let bf16 = GradReduction { dtype: DType::BF16, ..buckets(false) };
        let half = step(mesh, level, bf16, 1, Way::Accumulated);
        for r in 0..2 {
            // f32: the bits do not depend on the buckets or on overlapping (each element's sum is the ranks'
            // values in rank order).
            assert_eq!(f32_default[r].grads, after[r].grads, "{level} rank {r}: f32 changed");
            assert_grads_close(&format!("{level} rank {r}, bf16"), &half[r].grads, &after[r].grads, 1e-2);
            assert_ne!(half[r].grads, after[r].grads, "{level} rank {r}: bf16 rounded nothing");
            let (g32, g16) = (gradient_reductions(&after[r].records), gradient_reductions(&half[r].records));
            assert!(g32.iter().all(|c| c.dtype == Some(DType::F32)));
            assert!(g16.iter().all(|c| c.dtype == Some(DType::BF16)), "{level} rank {r}: {g16:?}");
            let elems = |s: &[&CallRecord]| s.iter().map(|c| c.elems).sum::<usize>();
            assert_eq!(elems(&g32), elems(&g16), "{level} rank {r}: the same buckets");
            // The counters: the buckets in half the bytes; the two one-element f64 all-reduces of the loss
            // (valid tokens, loss) alike.
            let scalars = 2 * autosp::core::comm::all_reduce_bytes(1, 2, r, 8);
            let (b32, b16) = (after[r].reduce_bytes - scalars, half[r].reduce_bytes - scalars);
            assert_eq!(b32, 2 * b16, "{level} rank {r}: {b32} bucket bytes in f32, {b16} in bf16");
            // The plan's accounting (what --explain adds to the attention's bytes) says the same.
            assert_eq!((after[r].planned, half[r].planned), (b32, b16), "{level} rank {r}: the plan's bytes");
            assert!(b16 > 0);
        }
    }
}

#[test]
fn bf16_per_use_reduce_scatters_at_gradients_and_parameters() {
    let mesh = Mesh::new(1, 2);
    for level in [ShardLevel::Gradients, ShardLevel::Parameters] {
        for overlap in [false, true] {
            let what = format!("{level}, overlap {overlap}");
            let f32s = step(mesh, level, buckets(overlap), 1, Way::Accumulated);
            let half = step(mesh, level, GradReduction { dtype: DType::BF16, ..buckets(overlap) }, 1, Way::Accumulated);
            for r in 0..2 {
                assert_grads_close(&format!("{what}, rank {r}, bf16"), &half[r].grads, &f32s[r].grads, 1e-2);
                assert_ne!(half[r].grads, f32s[r].grads, "{what}, rank {r}: bf16 rounded nothing");
                let sent = |s: &Seen, dtype: DType| {
                    s.records
                        .iter()
                        .filter(|c| c.collective == Collective::ReduceScatter && c.dtype == Some(dtype))
                        .map(|c| c.elems)
                        .sum::<usize>()
                };
                // Every parameter's per-use reduce-scatter travels in bf16 (at `parameters` the sharded
                // embedding's row reduce-scatter stays f32, in both runs alike).
                assert!(sent(&half[r], DType::BF16) > 0, "{what}, rank {r}: nothing sent in bf16");
                assert_eq!(sent(&f32s[r], DType::BF16), 0);
                assert_eq!(
                    sent(&half[r], DType::BF16) + sent(&half[r], DType::F32),
                    sent(&f32s[r], DType::F32),
                    "{what}, rank {r}: the same reduce-scatters"
                );
                assert!(half[r].planned < f32s[r].planned, "{what}, rank {r}: the plan's bytes");
            }
        }
    }
}

#[test]
fn a_bad_reduction_is_refused_naming_the_option() {
    let config = TinySpec::default().config();
    let weights = random_weights(&config, 5, DType::F32, &Device::Cpu).unwrap();
    for (reduction, want) in [
        (GradReduction { dtype: DType::F16, ..GradReduction::default() }, "--reduce-dtype"),
        (GradReduction { bucket_bytes: 0, ..GradReduction::default() }, "--bucket-mb"),
    ] {
        let (config, weights) = (config.clone(), weights.clone());
        let out = run_ranks(1, Duration::from_secs(30), move |pg| {
            let model = LlamaModel::from_weights(&config, weights.clone()).unwrap();
            let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None))
                .with_reduction(reduction);
            compile(model, cfg).map(|_| ()).unwrap_err().to_string()
        });
        let e = out.into_iter().next().unwrap().unwrap();
        assert!(e.contains(want), "{e}");
    }
}

#[test]
fn overlapped_buckets_are_posted_during_backward_with_the_same_gradients() {
    for mesh in [Mesh::new(1, 2), Mesh::new(2, 2)] {
        for level in ShardLevel::ALL {
            let what = format!("{} × {}, {level}", mesh.data, mesh.sequence);
            let after = step(mesh, level, buckets(false), 1, Way::Accumulated);
            let overlapped = step(mesh, level, buckets(true), 1, Way::Accumulated);
            for (r, (a, o)) in after.iter().zip(&overlapped).enumerate() {
                assert_eq!(o.grads, a.grads, "{what}, rank {r}: overlapping changed the gradients");
                if level >= ShardLevel::Gradients {
                    // Each use's reduce-scatter posted to the communication thread during backward (the sharded
                    // embedding's row reduce-scatter at `parameters` stays on the step's thread); the same
                    // collectives as inline, where none comes from that thread.
                    let scatters = |s: &Seen| -> Vec<CallRecord> {
                        s.records.iter().filter(|c| c.collective == Collective::ReduceScatter).cloned().collect()
                    };
                    let (on, off) = (scatters(o), scatters(a));
                    let from_thread: Vec<&CallRecord> =
                        on.iter().filter(|c| c.thread.as_deref() == Some("grad-scatter")).collect();
                    assert!(from_thread.len() > 2, "{what}, rank {r}: {} posted", from_thread.len());
                    let first = from_thread[0].mark.expect("a reduce-scatter posted during backward carries its mark");
                    assert!(first.before_end(), "{what}, rank {r}: the first was posted at {first:?}");
                    assert!(off.iter().all(|c| c.thread.as_deref() != Some("grad-scatter")));
                    let elems = |v: &[CallRecord]| v.iter().map(|c| c.elems).collect::<Vec<_>>();
                    let sorted = |mut v: Vec<usize>| {
                        v.sort_unstable();
                        v
                    };
                    assert_eq!(sorted(elems(&on)), sorted(elems(&off)), "{what}, rank {r}: other reduce-scatters");
                    continue;
                }
                let posted = gradient_reductions(&o.records);
                assert!(posted.len() > 1, "{what}, rank {r}: {} buckets", posted.len());
                assert!(
                    posted.iter().all(|c| c.thread.as_deref() == Some("grad-reduce")),
                    "{what}, rank {r}: every bucket goes from the communication thread: {posted:?}"
                );
                let first = posted[0].mark.expect("a bucket posted during backward carries its mark");
                assert!(first.before_end(), "{what}, rank {r}: the first bucket was posted at {first:?}");
                // After backward: every bucket from the main thread, once backward ended.
                let late = gradient_reductions(&a.records);
                assert!(late.iter().all(|c| c.mark.is_none() && c.thread.as_deref() != Some("grad-reduce")));
            }
        }
    }
}

#[test]
fn a_gradient_larger_than_a_bucket_is_all_reduced_in_pieces_with_the_same_bits() {
    // 1 KiB buckets (256 elements): most of the tiny model's weights (the head is 8192) are larger.
    let small = |overlap| GradReduction { bucket_bytes: 1 << 10, overlap, ..GradReduction::default() };
    let whole = step(Mesh::new(1, 2), ShardLevel::None, buckets(false), 1, Way::Accumulated);
    for (r, w) in whole.iter().enumerate() {
        assert!(gradient_reductions(&w.records).iter().any(|c| c.elems > 256), "rank {r}: the big buckets hold more");
    }
    for overlap in [false, true] {
        let pieces = step(Mesh::new(1, 2), ShardLevel::None, small(overlap), 1, Way::Accumulated);
        for (r, (p, w)) in pieces.iter().zip(&whole).enumerate() {
            assert_eq!(p.grads, w.grads, "overlap {overlap}, rank {r}: pieces changed the gradients");
            let reductions = gradient_reductions(&p.records);
            assert!(reductions.iter().all(|c| c.elems <= 256), "overlap {overlap}, rank {r}: {reductions:?}");
            let largest = w.grads.iter().map(Vec::len).max().unwrap();
            assert!(reductions.len() * 256 >= largest, "overlap {overlap}, rank {r}: {} all-reduces", reductions.len());
        }
    }
}
