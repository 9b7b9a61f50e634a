//! Restoring a checkpoint's optimizer state onto any mesh. The state of a parameter is a flat array (AdamW's
//! two moments and, where kept, the f32 master): a whole checkpoint holds it whole in
//! `optimizer.safetensors`, a sharded one as W slices of `ceil(numel / W)` elements, one per rank file. A
//! resuming rank wants the elements its own layout owns (the whole array unsharded; `layout.owned()` padded
//! to `chunk` when sharded over W' ranks at any level), so it reads exactly those byte ranges from the files
//! that hold them ([`TensorFile`]), whatever W was: a checkpoint resumes on any W, D and S.
//!
//! Everything is checked from the headers first (every parameter's moments present with its element count,
//! nothing held for a parameter this run does not train, the master's too) and the ranks agree on it before
//! any of them reads a tensor: another model, or a run that trains other parameters, is refused naming the
//! parameter, and nothing was allocated.

use std::ops::Range;
use std::path::Path;

use autosp_core::comm::ProcessGroup;
use autosp_core::optim::AdamW;
use autosp_core::{Param, Precision};
use candle_core::Tensor;

use super::ranges::TensorFile;
use super::sharded::{rank_file, settle};
use super::{TrainerState, OPTIMIZER_FILE};
use crate::train::error::{Result, TrainError};

/// The suffixes of the state kept per parameter: the two moments, then the optional master.
const MOMENTS: [&str; 2] = [".exp_avg", ".exp_avg_sq"];
const MASTER: &str = ".master";

/// Where a checkpoint's flat optimizer state lies.
enum Source {
    /// `optimizer.safetensors`, every tensor whole.
    Whole(TensorFile),
    /// One file per saved rank, rank r holding elements `r·chunk .. (r+1)·chunk` (zero-padded at the end).
    Sharded(Vec<TensorFile>),
}

impl Source {
    /// The element count a parameter of `numel` elements is stored with in each file (`numel` whole;
    /// `ceil(numel / W)` per slice).
    fn stored(&self, numel: usize) -> usize {
        match self {
            Source::Whole(_) => numel,
            Source::Sharded(files) => numel.div_ceil(files.len()),
        }
    }

    /// The files, for listing what they hold.
    fn files(&self) -> &[TensorFile] {
        match self {
            Source::Whole(f) => std::slice::from_ref(f),
            Source::Sharded(files) => files,
        }
    }

    /// The stored shape of `key` (in every file that holds it), `None` when absent; an error when the files
    /// disagree or only some hold it.
    fn shape(&self, key: &str) -> std::result::Result<Option<Vec<usize>>, String> {
        let shapes: Vec<Option<Vec<usize>>> =
            self.files().iter().map(|f| f.entry(key).map(|e| e.shape.clone())).collect();
        match shapes.iter().all(|s| s == &shapes[0]) {
            true => Ok(shapes[0].clone()),
            false => Err(format!("the rank files disagree on `{key}` ({shapes:?})")),
        }
    }

    /// Elements `elems` of the flat state `key` of a parameter of `numel` elements: `[elems.len()]` f32/f64 as
    /// stored, read from the files that hold them.
    fn read(&self, key: &str, numel: usize, elems: Range<usize>) -> Result<Tensor> {
        match self {
            Source::Whole(f) => f.read(key, elems),
            Source::Sharded(files) => {
                let chunk = self.stored(numel);
                let mut parts = Vec::new();
                let mut at = elems.start;
                while at < elems.end {
                    let r = at / chunk;
                    let end = elems.end.min((r + 1) * chunk);
                    parts.push(files[r].read(key, at - r * chunk..end - r * chunk)?);
                    at = end;
                }
                match parts.len() {
                    1 => Ok(parts.remove(0)),
                    _ => Ok(Tensor::cat(&parts, 0)?),
                }
            }
        }
    }
}

/// Restores AdamW's state of `params` (this run's, in model order, sharded over `group` or not) from the
/// checkpoint at `dir` that [`super::verify`] read as `state`: every rank reads its own elements, whatever mesh
/// the checkpoint was saved on (see the module doc). Collective: the ranks agree on the headers' check before
/// reading, and masters are written through [`Param::set_update`] in model order on every rank. A whole
/// checkpoint of a family whose file fuses projections (Phi-3) is read whole and split, as before.
pub fn restore_state(
    dir: &Path,
    state: &TrainerState,
    config: &autosp_models::LlamaConfig,
    group: &dyn ProcessGroup,
    opt: &mut AdamW,
    params: &[Param],
) -> Result<()> {
    let step = state.optimizer_step;
    let Some(source) = open(dir, state, config).transpose() else {
        return super::restore_optimizer(dir, config, opt, params, step);
    };
    let checked = source.and_then(|s| check(dir, &s, params, step).map(|()| s));
    let source = settle(group, "checking the checkpoint's optimizer state", checked)?;
    for p in params {
        let numel = p.shape().elem_count();
        let (elems, pad) = match p.shard() {
            Some(s) => (s.layout.owned(), s.layout.chunk - s.layout.owned().len()),
            None => (0..numel, 0),
        };
        let read = |suffix: &str| -> Result<Tensor> {
            let t = source.read(&format!("{}{suffix}", p.name()), numel, elems.clone())?;
            let t = if pad > 0 { t.pad_with_zeros(0, 0, pad)? } else { t };
            Ok(if p.shard().is_some() { t } else { t.reshape(p.shape())? })
        };
        if source.shape(&format!("{}.exp_avg", p.name())).ok().flatten().is_some() {
            opt.set_state(step, p, read(".exp_avg")?, read(".exp_avg_sq")?)?;
        }
        if source.shape(&format!("{}{MASTER}", p.name())).ok().flatten().is_some() {
            let master = read(MASTER)?;
            let w = p.tensor();
            if Precision::float(w.dtype()).needs_master() {
                opt.set_master(p, &master)?;
            } else if p.shard().is_some() {
                p.set_update(master.to_dtype(w.dtype())?.to_device(w.device())?)?;
            } else {
                p.set(master.to_dtype(w.dtype())?.to_device(w.device())?)?;
            }
        }
    }
    Ok(())
}

/// The files of the checkpoint at `dir` holding its optimizer state, headers read; `None` for a whole
/// checkpoint of a family whose file fuses projections (Phi-3), which is read whole.
fn open(dir: &Path, state: &TrainerState, config: &autosp_models::LlamaConfig) -> Result<Option<Source>> {
    Ok(Some(match state.sharded_over {
        None if config.model_type.fuses_projections() => return Ok(None),
        None => Source::Whole(TensorFile::open(&dir.join(OPTIMIZER_FILE))?),
        Some(world) => Source::Sharded(
            (0..world).map(|r| TensorFile::open(&dir.join(rank_file(r, world)))).collect::<Result<_>>()?,
        ),
    }))
}

/// Whether the checkpoint at `dir` ([`super::verify`] read `state`) holds the optimizer state of `params`
/// (this run's parameters that train, whole or as a skeleton: only names and shapes are used), by its files'
/// headers alone (see [`restore_state`]'s checks): another model, or a run that trains other parameters, is
/// refused naming the parameter. No collective; nothing but headers read.
pub fn check_state(
    dir: &Path,
    state: &TrainerState,
    config: &autosp_models::LlamaConfig,
    params: &[Param],
) -> Result<()> {
    match open(dir, state, config)? {
        Some(source) => check(dir, &source, params, state.optimizer_step),
        None => Ok(()),
    }
}

/// The headers' check (nothing read but headers): every parameter's moments present (unless at step 0) and
/// its master optional, each stored with the element count a parameter of its shape has in these files;
/// no moments for a parameter this run does not train.
fn check(dir: &Path, source: &Source, params: &[Param], step: u64) -> Result<()> {
    let other = |why: String| {
        TrainError::checkpoint(format!(
            "--resume {}: {why}; it belongs to another model or run (resume with the model, --lora and \
             --lora-train it was trained with)",
            dir.display()
        ))
    };
    let files = match source {
        Source::Whole(_) => OPTIMIZER_FILE.to_string(),
        Source::Sharded(f) => format!("the {} rank files", f.len()),
    };
    for p in params {
        let numel = p.shape().elem_count();
        let want = match source {
            Source::Whole(_) => p.shape().dims().to_vec(),
            Source::Sharded(_) => vec![source.stored(numel)],
        };
        for (i, suffix) in MOMENTS.iter().chain([&MASTER]).enumerate() {
            let key = format!("{}{suffix}", p.name());
            match source.shape(&key).map_err(|e| other(e.to_string()))? {
                Some(shape) if shape != want => {
                    return Err(other(format!(
                        "{files} hold `{key}` as {shape:?}, but this run's `{}` {:?} is stored as {want:?}",
                        p.name(),
                        p.shape().dims()
                    )))
                }
                None if i < 2 && step > 0 => {
                    return Err(other(format!("{files} hold no `{key}` for this run's parameter `{}`", p.name())))
                }
                _ => {}
            }
        }
    }
    let trained: std::collections::HashSet<&str> = params.iter().map(|p| p.name()).collect();
    for f in source.files() {
        if let Some(name) = f.names().find_map(|k| k.strip_suffix(".exp_avg").filter(|n| !trained.contains(n))) {
            return Err(other(format!("{files} hold the state of `{name}`, which this run does not train")));
        }
    }
    Ok(())
}
