//! Checkpoints of a run whose model states are sharded over W ranks ([`autosp_core::shard`]): the same
//! `step-N` as an unsharded run, the model whole in the HF layout that transformers loads, and AdamW's state
//! in one file per rank, `optimizer-rank-RRRRR-of-WWWWW.safetensors`, each holding that rank's slices (the
//! same names as `optimizer.safetensors`: `<param>.exp_avg`, `<param>.exp_avg_sq`, `<param>.master`).
//!
//! Saving is collective: rank 0 makes the hidden `.step-N.partial-PID` directory (PID: rank 0's); the model
//! file streams there one weight at a time (every rank gathers it, rank 0 appends it and frees it:
//! [`super::streamed_model`]; a LoRA adapter or a Phi-3 model, whose files fuse projections, is gathered whole
//! onto rank 0 first and written as before), every rank writes and fsyncs its optimizer file there, and rank 0 writes the rest, hashes every file (the other ranks' too) into
//! `trainer_state.json` and renames the directory into place as an unsharded save does. Each stage ends with
//! the ranks agreeing that it succeeded (one all-reduce), so a failure on one rank stops them all at once, the
//! directory is removed and the last good checkpoint is untouched. The directory must be on storage every
//! rank sees (one machine, or a shared file system).
//!
//! Resuming ([`super::restore_state`]) reads from the rank files the byte ranges of the elements this rank's
//! own layout owns, so a sharded checkpoint resumes on any W, D and S, sharded at any level or not at all.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use autosp_core::comm::{ProcessGroup, ReduceOp};
use autosp_core::optim::AdamW;
use autosp_core::{Param, ShardLevel};
use autosp_models::LlamaModel;
use candle_core::{DType, Device, Tensor};

use super::{atomic, clean_stale, step_dir, streamed_model, write_model, write_rest, Saved, TrainerState};
use crate::train::error::{IoContext, Result, TrainError};

/// The optimizer file of `rank` of `world`.
pub fn rank_file(rank: usize, world: usize) -> String {
    format!("optimizer-rank-{rank:05}-of-{world:05}.safetensors")
}

/// Whether every rank of `world` says `ok` (one all-reduce of the failures).
pub(crate) fn agree(world: &dyn ProcessGroup, ok: bool) -> Result<bool> {
    let failed = Tensor::new(&[f64::from(u8::from(!ok))], &Device::Cpu)?;
    Ok(world.all_reduce(&failed, ReduceOp::Max)?.to_vec1::<f64>()?[0] == 0.0)
}

/// A stage's result on this rank, agreed over the world: `Ok` when every rank's is, else this rank's error or
/// one naming the rank that failed.
pub(super) fn settle<T>(world: &dyn ProcessGroup, stage: &str, result: Result<T>) -> Result<T> {
    let all_ok = agree(world, result.is_ok())?;
    match (result, all_ok) {
        (Ok(v), true) => Ok(v),
        (Err(e), _) => Err(e),
        (Ok(_), false) => Err(TrainError::checkpoint(format!("another rank failed while {stage}; nothing was saved"))),
    }
}

/// Saves the checkpoint of `state.step` of a sharded run (collective; see the module doc). `params` in model
/// order, `model` for its config, `opt` holding this rank's slices.
pub fn save_sharded(
    world: &Arc<dyn ProcessGroup>,
    root: &Path,
    model: &LlamaModel,
    opt: &AdamW,
    params: &[Param],
    state: &TrainerState,
    tokenizer: &[(String, String)],
) -> Result<Saved> {
    let (rank, size) = (world.rank(), world.size());
    let rank0 = rank == 0;
    let disk = model.config.torch_dtype.unwrap_or(DType::F32);
    // This rank's slices of the optimizer state for its own file. The model file streams one weight at a time
    // ([`streamed_model`]) where it can; otherwise (a LoRA adapter, Phi-3's fused files) the whole weights are
    // gathered first (rank 0 keeps them), from the masters where AdamW has them.
    let streamed = streamed_model::streamable(model, params, disk);
    let mut weights = HashMap::new();
    let mut mine: HashMap<String, Tensor> = HashMap::new();
    for p in params {
        let shard = p.shard().ok_or_else(|| {
            TrainError::Config(format!("parameter `{}` is not sharded: save with checkpoint::save", p.name()))
        })?;
        let master = opt.master(p).cloned();
        let own_master = match &master {
            Some(m) => Some(m.clone()),
            // An f32 weight the model file's dtype cannot hold exactly: its exact slice goes with the state.
            None if p.tensor().dtype() != disk => Some(p.update_view()?),
            None => None,
        };
        if let Some(m) = own_master {
            mine.insert(format!("{}.master", p.name()), m);
        }
        if let Some((m, v)) = opt.moments(p) {
            mine.insert(format!("{}.exp_avg", p.name()), m.clone());
            mine.insert(format!("{}.exp_avg_sq", p.name()), v.clone());
        }
        if !streamed {
            // Collective alike on every rank (the masters are the same parameters' everywhere).
            let whole = match &master {
                Some(m) => shard.gather(m)?,
                None => p.whole()?,
            };
            if rank0 {
                weights.insert(p.name().to_string(), whole);
            }
        }
    }
    let dir = step_dir(root, state.step);
    let name = format!("step-{}", state.step);
    // Rank 0 cleans up and makes the hidden directory holding the model, named after its own process id, which
    // every rank learns.
    let made = if rank0 {
        (|| -> Result<Vec<String>> {
            std::fs::create_dir_all(root).io(|| format!("creating the checkpoint directory {}", root.display()))?;
            let cleaned = clean_stale(root)?;
            let tmp = root.join(format!(".{name}.partial-{}", std::process::id()));
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).io(|| format!("removing {}", tmp.display()))?;
            }
            match streamed {
                true => std::fs::create_dir_all(&tmp).io(|| format!("creating {}", tmp.display()))?,
                false => write_model(&tmp, model, disk, &weights, state.base_model.as_deref())?,
            }
            Ok(cleaned)
        })()
    } else {
        Ok(Vec::new())
    };
    drop(weights);
    let cleaned = settle(world.as_ref(), "writing the model", made)?;
    let pid = Tensor::new(&[if rank0 { f64::from(std::process::id()) } else { 0.0 }], &Device::Cpu)?;
    let pid = world.all_reduce(&pid, ReduceOp::Max)?.to_vec1::<f64>()?[0] as u32;
    let tmp = root.join(format!(".{name}.partial-{pid}"));
    let fail = |e: TrainError| {
        if rank0 {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        TrainError::Save { dir: dir.clone(), cause: Box::new(e) }
    };
    if streamed {
        let written = streamed_model::write(rank0.then_some(tmp.as_path()), model, opt, params, disk);
        settle(world.as_ref(), "writing the model", written).map_err(fail)?;
    }
    // Every rank's optimizer file, written and flushed.
    let written = (|| -> Result<()> {
        let path = tmp.join(rank_file(rank, size));
        candle_core::safetensors::save(&mine, &path)?;
        std::fs::File::open(&path).and_then(|f| f.sync_all()).io(|| format!("flushing {} to disk", path.display()))
    })();
    settle(world.as_ref(), "writing the optimizer state", written).map_err(fail)?;
    drop(mine);
    // Rank 0: the tokenizer and the state with every file's hash; then into place.
    let finished = if rank0 {
        let optimizer_files: Vec<String> = (0..size).map(|r| rank_file(r, size)).collect();
        let extra = serde_json::json!({
            "world": size,
            "sharding": ShardLevel::name(params[0].shard().map_or(ShardLevel::None, |s| s.level)),
            "optimizer_files": optimizer_files,
        });
        write_rest(&tmp, state, tokenizer, Some(extra)).and_then(|()| atomic::sync_tree(&tmp)).map_err(&fail).and_then(
            |()| {
                let old = root.join(format!(".{name}.old-{}", std::process::id()));
                atomic::install(root, &tmp, &dir, &old, &mut |_| {})
            },
        )
    } else {
        Ok(())
    };
    settle(world.as_ref(), "putting the checkpoint in place", finished)?;
    Ok(Saved { dir, cleaned })
}

/// The per-rank optimizer files a sharded checkpoint's state lists (for [`super::verify`]).
pub(super) fn listed_files(doc: &serde_json::Value) -> Option<(usize, BTreeMap<String, ()>)> {
    let world = doc.get("world")?.as_u64()? as usize;
    let files = doc.get("optimizer_files")?.as_array()?;
    Some((world, files.iter().filter_map(|f| Some((f.as_str()?.to_string(), ()))).collect()))
}
