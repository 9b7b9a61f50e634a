//! LoRA's dropout masks do not depend on the mesh: an element is drawn from (seed, step, module, sequence in
//! the global batch, position in the whole sequence, feature), so one rank training the whole batch, two
//! sequence-parallel ranks (Ulysses: contiguous shards; Ring: zigzag shards) and two data-parallel replicas
//! draw the same masks for the same tokens and compute the same loss and gradients (f32, within 1e-5 of the
//! largest element, the bar of the mesh tests: the world's reduction only reorders sums). Dropout is 0.3 and
//! every `lora_B` starts away from zero, so the masks reach every adapter's gradient; the test also checks
//! that they change the loss (a mask that silently vanished would pass the parity alone). And at the op: two
//! ranks' different positions draw different masks, each a slice of the whole sequence's.

mod common;

use std::sync::Arc;
use std::time::Duration;

use autosp::compile::{compile, Checkpointing, CompileConfig, Mesh, Strategy};
use autosp::core::comm::run_ranks;
use autosp::core::lora::{seed_dropout, LoraConfig};
use autosp::core::module::trainable_params;
use autosp::core::{ops, CausalLm, CheckpointPolicy, ShardLevel, Tape, TokenCoordinates};
use autosp::models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};
use common::rel;

/// Two sequences of 32 tokens, a few labels ignored.
fn batch(vocab: usize) -> (Tensor, Tensor) {
    let (b, n) = (2, 32);
    let ids: Vec<u32> = (0..(b * n) as u32).map(|i| (i * 13 + 7) % vocab as u32).collect();
    let labels: Vec<i64> = ids.iter().enumerate().map(|(i, &x)| if i % n < 2 { -100 } else { x as i64 }).collect();
    (Tensor::from_vec(ids, (b, n), &Device::Cpu).unwrap(), Tensor::from_vec(labels, (b, n), &Device::Cpu).unwrap())
}

/// The loss and every trainable parameter's whole gradient (model order) of one step at `mesh` (None: one
/// rank) with `strategy`, LoRA rank 4 with dropout `p` on every projection, sharded at `level`.
fn step(mesh: Option<Mesh>, strategy: Strategy, p: f32, level: ShardLevel) -> (f64, Vec<Vec<f32>>) {
    let config = TinySpec::default().config();
    let weights = Arc::new(random_weights(&config, 5, DType::F32, &Device::Cpu).unwrap());
    let config = Arc::new(config);
    let world = mesh.map_or(1, |m| m.world());
    let out = run_ranks(world, Duration::from_secs(120), move |pg| -> Result<(f64, Vec<Vec<f32>>), String> {
        let mut model = LlamaModel::from_weights(&config, (*weights).clone()).map_err(|e| e.to_string())?;
        let lora = LoraConfig { dropout: p, seed: 11, ..LoraConfig::new(4) };
        model.add_lora(&lora).map_err(|e| e.to_string())?;
        // lora_B away from zero (the same on every rank), so the masks reach lora_A's gradient too.
        for (i, b) in trainable_params(&model).iter().filter(|q| q.name().contains("lora_B")).enumerate() {
            let dims = b.shape().dims().to_vec();
            let n = dims.iter().product::<usize>();
            let v: Vec<f32> = (0..n).map(|j| (((j * 31 + i * 7) % 17) as f32 - 8.0) * 0.01).collect();
            b.set(Tensor::from_vec(v, dims, &Device::Cpu).unwrap()).unwrap();
        }
        let mut cfg = CompileConfig::new(pg, strategy, Checkpointing::Policy(CheckpointPolicy::SequenceAware))
            .with_sharding(level);
        if let Some(m) = mesh {
            cfg = cfg.with_mesh(m);
        }
        let c = compile(model, cfg).map_err(|e| e.to_string())?;
        seed_dropout(c.model(), 3, 0);
        let (ids, labels) = batch(c.model().dims().vocab);
        let out = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
        let whole = c.whole_grads(&out.grads).map_err(|e| e.to_string())?;
        let grads =
            c.params().iter().map(|q| whole.get(q).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
        Ok((out.loss, grads))
    });
    let mut runs: Vec<_> = out.into_iter().map(|r| r.expect("rank failed").expect("step failed")).collect();
    runs.remove(0)
}

fn assert_same(what: &str, got: &(f64, Vec<Vec<f32>>), want: &(f64, Vec<Vec<f32>>)) {
    assert!((got.0 - want.0).abs() <= 1e-5 * want.0.abs(), "{what}: loss {} vs {}", got.0, want.0);
    assert_eq!(got.1.len(), want.1.len());
    for (i, (g, w)) in got.1.iter().zip(&want.1).enumerate() {
        assert!(w.iter().any(|&x| x != 0.0), "{what}: gradient {i} is zero: the test would not see a mask");
        let e = rel(g, w);
        assert!(e <= 1e-5, "{what}: gradient {i} off by {e:e}");
    }
}

#[test]
fn dropout_masks_give_one_rank_s_gradients_on_every_mesh() {
    let one = step(None, Strategy::Auto, 0.3, ShardLevel::None);
    let plain = step(None, Strategy::Auto, 0.0, ShardLevel::None);
    assert!((one.0 - plain.0).abs() > 1e-4, "dropout 0.3 left the loss at {} (without: {})", one.0, plain.0);
    for strategy in [Strategy::Ulysses, Strategy::Ring] {
        let got = step(Some(Mesh::new(1, 2)), strategy, 0.3, ShardLevel::None);
        assert_same(&format!("P = 2, {strategy:?}"), &got, &one);
    }
    assert_same("D = 2", &step(Some(Mesh::new(2, 1)), Strategy::Auto, 0.3, ShardLevel::None), &one);
    let got = step(Some(Mesh::new(2, 2)), Strategy::Ring, 0.3, ShardLevel::Parameters);
    assert_same("D = 2 x S = 2 (Ring), sharded at parameters", &got, &one);
}

/// The mask of `[1, columns, 64]` ones at the given sequence and positions.
fn mask(sequence: u64, positions: &[u64], first_sequence: u64) -> Vec<f32> {
    let tape = Tape::new(CheckpointPolicy::None);
    let coordinates = TokenCoordinates { sequences: vec![sequence], positions: positions.to_vec() };
    tape.set_token_coordinates(Some(Arc::new(coordinates)));
    let x = tape.leaf(Tensor::ones((1, positions.len(), 64), DType::F32, &Device::Cpu).unwrap());
    let y = ops::dropout(&tape, &x, 0.5, 9, first_sequence).unwrap();
    y.tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn ranks_holding_other_positions_draw_other_masks_each_a_slice_of_the_whole() {
    let whole = mask(0, &(0..8).collect::<Vec<_>>(), 0);
    // Two sequence-parallel ranks under Ring's zigzag: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    let (r0, r1) = (mask(0, &[0, 1, 6, 7], 0), mask(0, &[2, 3, 4, 5], 0));
    assert_ne!(r0, r1, "two ranks' different positions drew the same mask");
    for (shard, positions) in [(&r0, [0usize, 1, 6, 7]), (&r1, [2, 3, 4, 5])] {
        for (i, &p) in positions.iter().enumerate() {
            assert_eq!(&shard[i * 64..(i + 1) * 64], &whole[p * 64..(p + 1) * 64], "position {p}");
        }
    }
    // Another sequence of the batch (a replica's row, or the same row in the next micro-batch) draws another.
    assert_ne!(mask(1, &[0, 1, 6, 7], 0), r0);
    assert_eq!(mask(1, &[0, 1, 6, 7], 0), mask(0, &[0, 1, 6, 7], 1));
}
