//! Training checkpoints: `DIR/step-N/` holds the model in the HF layout (config.json + model.safetensors,
//! loadable by transformers and `LlamaModel::load`) in the model's own dtype (config.json's `torch_dtype`;
//! written from the f32 master weights when training in bf16/f16, so an f32 model trained in bf16 is saved
//! exactly), the tokenizer when the model has one, `optimizer.safetensors` (AdamW's moments,
//! `<param>.exp_avg` / `<param>.exp_avg_sq`, and `<param>.master`: the f32 master weights of bf16/f16
//! parameters, or the weights of any parameter the model file's dtype cannot hold exactly) and
//! `trainer_state.json` (step, optimizer step, data position, random state, the run's shape and dtype, and
//! the size and FNV-1a hash of every other file). A checkpoint is written into a hidden sibling directory and renamed
//! into place only when complete, so an interrupted save never damages the last good checkpoint; loading
//! checks every file against the recorded size and hash and names the damage.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use autosp::core::optim::{needs_master, AdamW};
use autosp::core::Param;
use autosp::models::{save_model, LlamaModel, SaveOptions};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::data::Position;

/// The state file's name.
pub const STATE_FILE: &str = "trainer_state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// What a checkpoint records besides the tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub step: usize,
    /// AdamW's step count (equals `step` unless the run started from another optimizer state).
    pub optimizer_step: u64,
    /// Where the data stream is.
    pub data: Position,
    /// The run's shape, which a resumed run must match: seq_len, micro-batches, data source, seed (and dtype).
    pub seq_len: usize,
    pub micro_batches: usize,
    pub data_source: String,
    pub seed: u64,
    /// The compute dtype (`--dtype`); checkpoints written before it was recorded were f32.
    pub dtype: DType,
}

/// FNV-1a (64-bit) of a file's bytes and its length.
fn fingerprint(path: &Path) -> Result<(u64, String)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    Ok((bytes.len() as u64, format!("{h:016x}")))
}

/// Writes the checkpoint of `step` into `root/step-{step}` atomically and returns its path.
pub fn save(
    root: &Path,
    model: &LlamaModel,
    opt: &AdamW,
    params: &[Param],
    state: &TrainerState,
    tokenizer: Option<&str>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(root).with_context(|| format!("creating the checkpoint directory {}", root.display()))?;
    let name = format!("step-{}", state.step);
    let dir = root.join(&name);
    let tmp = root.join(format!(".{name}.partial-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    let written = write_into(&tmp, model, opt, params, state, tokenizer);
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("saving the checkpoint {} (nothing was replaced)", dir.display())));
    }
    if dir.exists() {
        let old = root.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(&dir, &old).with_context(|| format!("moving the old {} aside", dir.display()))?;
        std::fs::rename(&tmp, &dir).with_context(|| format!("renaming {} into place", tmp.display()))?;
        std::fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    } else {
        std::fs::rename(&tmp, &dir).with_context(|| format!("renaming {} into place", tmp.display()))?;
    }
    Ok(dir)
}

fn write_into(
    tmp: &Path,
    model: &LlamaModel,
    opt: &AdamW,
    params: &[Param],
    state: &TrainerState,
    tokenizer: Option<&str>,
) -> Result<()> {
    // The model's own dtype on disk, from the masters where the optimizer has them.
    let disk = model.config.torch_dtype.unwrap_or(DType::F32);
    let mut weights = HashMap::new();
    let mut moments: HashMap<String, Tensor> = HashMap::new();
    for p in params {
        let w = p.tensor();
        let master = opt.master(p).cloned().or_else(|| (w.dtype() != disk).then(|| w.clone()));
        weights.insert(p.name().to_string(), master.clone().unwrap_or(w));
        if let Some(master) = master {
            moments.insert(format!("{}.master", p.name()), master);
        }
        if let Some((m, v)) = opt.moments(p) {
            moments.insert(format!("{}.exp_avg", p.name()), m.clone());
            moments.insert(format!("{}.exp_avg_sq", p.name()), v.clone());
        }
    }
    save_model(tmp, &model.config, &weights, &SaveOptions { dtype: Some(disk), ..SaveOptions::default() })?;
    candle_core::safetensors::save(&moments, tmp.join(OPTIMIZER_FILE))?;
    if let Some(t) = tokenizer {
        let path = tmp.join("tokenizer.json");
        std::fs::write(&path, t).with_context(|| format!("writing {}", path.display()))?;
    }
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(tmp)? {
        let path = entry?.path();
        let (bytes, fnv) = fingerprint(&path)?;
        let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
        files.insert(name, json!({ "bytes": bytes, "fnv1a64": fnv }));
    }
    let doc = json!({
        "step": state.step,
        "optimizer_step": state.optimizer_step,
        "data_drawn": state.data.drawn,
        "data_rng": state.data.rng.to_string(),
        "seq_len": state.seq_len,
        "micro_batches": state.micro_batches,
        "data_source": state.data_source,
        "seed": state.seed.to_string(),
        "dtype": state.dtype.as_str(),
        "files": files,
    });
    let path = tmp.join(STATE_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(&doc)?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Reads `dir/trainer_state.json` and checks every file it lists (size and hash). The error names the
/// damaged file and what is wrong with it.
pub fn verify(dir: &Path) -> Result<TrainerState> {
    let damaged = |what: String| {
        anyhow!("checkpoint {} is damaged: {what}; nothing was written; resume from another checkpoint", dir.display())
    };
    if !dir.is_dir() {
        bail!("checkpoint {} does not exist (give a `.../step-N` directory written by --save)", dir.display());
    }
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| damaged(format!("{STATE_FILE} cannot be read ({e})")))?;
    let doc: Value =
        serde_json::from_str(&text).map_err(|e| damaged(format!("{STATE_FILE} is not valid JSON ({e})")))?;
    let field = |k: &str| doc.get(k).ok_or_else(|| damaged(format!("{STATE_FILE} has no `{k}`")));
    let num = |k: &str| -> Result<u64> {
        let v = field(k)?;
        v.as_u64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .ok_or_else(|| damaged(format!("{STATE_FILE}: `{k}` is not a number")))
    };
    let files = field("files")?.as_object().ok_or_else(|| damaged(format!("{STATE_FILE}: `files` is not a map")))?;
    for name in ["config.json", OPTIMIZER_FILE] {
        if !files.contains_key(name) {
            return Err(damaged(format!("{STATE_FILE} does not list {name}")));
        }
    }
    for (name, rec) in files {
        let want_bytes = rec.get("bytes").and_then(Value::as_u64);
        let want_hash = rec.get("fnv1a64").and_then(Value::as_str);
        let p = dir.join(name);
        if !p.is_file() {
            return Err(damaged(format!("{name} is missing")));
        }
        let (bytes, hash) = fingerprint(&p)?;
        if Some(bytes) != want_bytes {
            return Err(damaged(format!(
                "{name} has {bytes} bytes but was saved with {} (truncated or changed after saving)",
                want_bytes.map_or("?".into(), |b| b.to_string())
            )));
        }
        if Some(hash.as_str()) != want_hash {
            return Err(damaged(format!(
                "{name} does not match the hash recorded when it was saved (its bytes changed)"
            )));
        }
    }
    Ok(TrainerState {
        step: num("step")? as usize,
        optimizer_step: num("optimizer_step")?,
        data: Position { drawn: num("data_drawn")?, rng: num("data_rng")? },
        seq_len: num("seq_len")? as usize,
        micro_batches: num("micro_batches")? as usize,
        data_source: field("data_source")?.as_str().unwrap_or_default().to_string(),
        seed: num("seed")?,
        dtype: match doc.get("dtype") {
            None => DType::F32,
            Some(v) => v
                .as_str()
                .and_then(|d| autosp::precision::parse_dtype(d).ok())
                .ok_or_else(|| damaged(format!("{STATE_FILE}: `dtype` is not bf16, f16 or f32")))?,
        },
    })
}

/// Restores AdamW's moments of `params` (by HF name), its step count and the master weights from
/// `dir/optimizer.safetensors`: a bf16/f16 parameter's f32 master goes back into AdamW (and, rounded, into
/// the parameter); an f32 parameter saved in a narrower model file gets its exact weights back.
pub fn restore_optimizer(dir: &Path, opt: &mut AdamW, params: &[Param], step: u64) -> Result<()> {
    let path = dir.join(OPTIMIZER_FILE);
    let mut t = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("checkpoint {} is damaged: {OPTIMIZER_FILE} cannot be read", dir.display()))?;
    for p in params {
        let (m, v) = (t.remove(&format!("{}.exp_avg", p.name())), t.remove(&format!("{}.exp_avg_sq", p.name())));
        match (m, v) {
            (Some(m), Some(v)) if m.dims() == p.tensor().dims() && v.dims() == p.tensor().dims() => {
                opt.set_state(step, p, m, v)?
            }
            (None, None) if step == 0 => {}
            _ => bail!(
                "checkpoint {}: {OPTIMIZER_FILE} lacks the moments of `{}` (shape {:?}) or has another shape; \
                 it belongs to another model",
                dir.display(),
                p.name(),
                p.tensor().dims()
            ),
        }
        if let Some(master) = t.remove(&format!("{}.master", p.name())) {
            let w = p.tensor();
            if master.dims() != w.dims() {
                bail!(
                    "checkpoint {}: {OPTIMIZER_FILE} holds master weights of `{}` with shape {:?}, but the parameter \
                     has {:?}; it belongs to another model",
                    dir.display(),
                    p.name(),
                    master.dims(),
                    w.dims()
                );
            }
            if needs_master(w.dtype()) {
                opt.set_master(p, &master)?;
            } else {
                p.set(master.to_dtype(w.dtype())?)?;
            }
        }
    }
    Ok(())
}
