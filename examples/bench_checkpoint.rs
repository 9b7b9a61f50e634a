//! Memory of saving and resuming a sharded checkpoint: one JSON line per stage with the process heap's peak
//! above what it held before the stage (a tracking global allocator), beside the bytes the old whole-model
//! save held on rank 0 (every f32 master gathered, plus the model file's copy in the disk dtype) and the
//! largest single weight; for the resume, also what the heap keeps after it (the restored state itself), so
//! the difference is what reading cost. Ranks are threads of this process, so the peak covers every rank.
//!
//! `cargo run --release --example bench_checkpoint -- --world 2 --resume-world 4`
//!
//! The model is the `bench` shape of `bench_memory` (vocab 32000, hidden 512, intermediate 1376, 4 layers,
//! 8 heads, 4 kv heads, untied: 44 M parameters) in bf16 with f32 masters, sharded at `parameters`; one
//! training step of 16 tokens makes AdamW's moments before the save.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Result};
use autosp::compile::{compile, Checkpointing, CompileConfig, Strategy};
use autosp::core::comm::{run_ranks, ProcessGroup};
use autosp::core::optim::{AdamW, AdamWConfig, Optimizer};
use autosp::core::{CheckpointPolicy, ShardLevel, TrackingAllocator};
use autosp::models::{random_weights, LlamaModel};
use autosp::train::checkpoint::{restore_state, save_sharded, verify};
use autosp::train::{Position, RunShape, TrainerState};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use serde_json::json;

#[allow(dead_code)]
#[path = "common/presets.rs"]
mod presets;

#[global_allocator]
static ALLOC: TrackingAllocator = TrackingAllocator::new();

#[derive(Parser, Debug)]
#[command(about = "Heap peak of a sharded checkpoint's save and of its resume on another world size")]
struct Args {
    /// Ranks (threads) of the saving run.
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Ranks (threads) of the resuming run.
    #[arg(long, default_value_t = 4)]
    resume_world: usize,
}

fn shape() -> RunShape {
    RunShape {
        seq_len: 16,
        micro_batches: 1,
        data_parallel: 1,
        data_source: "bench".into(),
        seed: 0,
        dtype: DType::BF16,
        steps: 1,
        lr: 1e-4,
        decay_all: true,
        warmup: 0,
        max_attention_distance: None,
        curriculum: "none".into(),
        base_model: None,
        rope_scaling: None,
        packing: None,
    }
}

fn compiled(pg: Arc<dyn ProcessGroup>, model: LlamaModel) -> Result<autosp::compile::Compiled<LlamaModel>> {
    let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::SequenceAware))
        .with_dtype(DType::BF16)
        .with_sharding(ShardLevel::Parameters);
    compile(model, cfg).map_err(|e| anyhow!("{e}"))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut config = presets::preset_config("bench", 0)?;
    config.torch_dtype = Some(DType::BF16);
    let weights = random_weights(&config, 1, DType::BF16, &Device::Cpu)?;
    let numel: usize = weights.values().map(|t| t.elem_count()).sum();
    let largest = weights.values().map(|t| t.elem_count()).max().unwrap_or(0);
    let (config, weights) = (Arc::new(config), Arc::new(weights));
    let tmp = tempfile::tempdir()?;
    let root = tmp.path().to_path_buf();

    // Save after one step at `world` ranks.
    let (c2, w2, r2) = (config.clone(), weights.clone(), root.clone());
    let saved = run_ranks(args.world, Duration::from_secs(600), move |pg| -> Result<usize> {
        let model = LlamaModel::from_weights(&c2, (*w2).clone())?;
        let c = compiled(pg.clone(), model)?;
        let params = c.params();
        let mut opt = AdamW::new(AdamWConfig::default())?;
        let ids = Tensor::from_vec((0..16u32).collect(), (1, 16), &Device::Cpu)?;
        let out = c.train_step(&ids, None).map_err(|e| anyhow!("{e}"))?;
        opt.step(&params, &out.grads, 1e-4)?;
        drop(out);
        pg.barrier()?;
        let before = ALLOC.live_bytes();
        if pg.rank() == 0 {
            ALLOC.reset_peak();
        }
        pg.barrier()?;
        let state = TrainerState::new(1, opt.steps(), Position { drawn: 0, rng: 0 }, &shape());
        save_sharded(&pg, &r2, c.model(), &opt, &params, &state, &[]).map_err(|e| anyhow!("{e}"))?;
        pg.barrier()?;
        Ok(ALLOC.peak_bytes().saturating_sub(before))
    });
    let save_extra = saved.into_iter().next().ok_or_else(|| anyhow!("no rank"))?.map_err(|e| anyhow!("{e:?}"))??;
    println!(
        "{}",
        json!({
            "bench": "checkpoint", "stage": "save", "world": args.world, "parameters": numel,
            "heap_peak_above_before_bytes": save_extra,
            "whole_model_gather_bytes": numel * (4 + 2),
            "largest_weight_f32_bytes": largest * 4,
        })
    );

    // Resume at `resume_world` ranks: each reads its own elements of the saved slices.
    let dir = root.join("step-1");
    let file_bytes: u64 = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("optimizer"))
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum();
    let (c3, w3) = (config.clone(), weights.clone());
    let resumed = run_ranks(args.resume_world, Duration::from_secs(600), move |pg| -> Result<(usize, usize)> {
        let model = LlamaModel::from_weights(&c3, (*w3).clone())?;
        let c = compiled(pg.clone(), model)?;
        let params = c.params();
        let mut opt = AdamW::new(AdamWConfig::default())?;
        let state = verify(&dir).map_err(|e| anyhow!("{e}"))?;
        pg.barrier()?;
        let before = ALLOC.live_bytes();
        if pg.rank() == 0 {
            ALLOC.reset_peak();
        }
        pg.barrier()?;
        restore_state(&dir, &state, &c.model().config, pg.as_ref(), &mut opt, &params).map_err(|e| anyhow!("{e}"))?;
        pg.barrier()?;
        Ok((ALLOC.peak_bytes().saturating_sub(before), ALLOC.live_bytes().saturating_sub(before)))
    });
    let (resume_extra, kept) =
        resumed.into_iter().next().ok_or_else(|| anyhow!("no rank"))?.map_err(|e| anyhow!("{e:?}"))??;
    println!(
        "{}",
        json!({
            "bench": "checkpoint", "stage": "resume", "saved_world": args.world, "world": args.resume_world,
            "heap_peak_above_before_bytes": resume_extra,
            "heap_kept_after_bytes": kept,
            "optimizer_files_bytes": file_bytes,
        })
    );
    Ok(())
}
