//! Training checkpoints: `DIR/step-N/` holds the model in the HF layout (config.json + model.safetensors,
//! loadable by transformers and `LlamaModel::load`) in the model's own dtype (config.json's `torch_dtype`;
//! written from the f32 master weights when training in bf16/f16, so an f32 model trained in bf16 is saved
//! exactly), the tokenizer when the model has one, `optimizer.safetensors` (AdamW's moments,
//! `<param>.exp_avg` / `<param>.exp_avg_sq`, and `<param>.master`: the f32 master weights of bf16/f16
//! parameters, or the weights of any parameter the model file's dtype cannot hold exactly; `<param>` is the
//! model file's own name, Phi-3's fused ones included: [`state_names`]) and
//! `trainer_state.json` (step, optimizer step, data position, random state, the run's shape, schedule and
//! dtype, and the size and FNV-1a hash of every other file). A checkpoint is written into a hidden sibling
//! directory `.step-N.partial-PID`, every file and the directory are fsynced, and only then is it renamed into
//! place (and the parent directory fsynced), so an interrupted save or a power cut never damages the last good
//! checkpoint. Saving a step that already exists swaps the two directories in one atomic rename (Linux
//! `renameat2(RENAME_EXCHANGE)`) and then deletes the old one, so a complete `step-N` exists at every moment;
//! where the exchange is unavailable the old one is moved aside to `.step-N.old-PID` first, and the next save
//! puts it back if the process died between the two renames. Each save removes the hidden directories of
//! dead runs (their PID no longer runs; [`clean_stale`]). One run at a time saves into a directory: [`SaveLock`]
//! holds `DIR/.lock` (the owner's PID, `flock`ed) for the run, and a second run is refused naming that PID.
//! Loading ([`verify`]) checks every file, hashed streaming, against the recorded size and hash and names the
//! damage; [`restore_state`] puts AdamW's state and the master weights back, each rank reading only its own
//! elements from the files' byte ranges, on any mesh, so a resumed run continues bit for bit on the same mesh
//! and within f32 rounding on another.

mod atomic;
mod lock;
pub mod model_slices;
mod ranges;
mod resume;
pub mod resume_fit;
mod sharded;
pub(crate) use sharded::agree;
mod state_names;
mod streamed_model;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use autosp_core::optim::AdamW;
use autosp_core::Param;
use autosp_core::Precision;
use autosp_models::peft::{ADAPTER_CONFIG, BASE_CONFIG};
use autosp_models::{save_adapter, save_model, LlamaModel, SaveOptions};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

pub use atomic::clean_stale;
pub use lock::{SaveLock, LOCK_FILE};
pub use ranges::{Entry, TensorFile};
pub use resume::{check_state, restore_state};
pub use sharded::{rank_file, save_sharded};

use super::error::{IoContext, Result, TrainError};
use super::fingerprint::fingerprint;
use super::stream::Position;

/// The state file's name.
pub const STATE_FILE: &str = "trainer_state.json";
/// The optimizer file's name.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// What a run is, as far as resuming goes: the settings a checkpoint records, which a resumed run must match
/// (`micro_batches`, `data_source`, `seed`, `dtype`) or may change only when asked to (the others).
#[derive(Clone, Debug, PartialEq)]
pub struct RunShape {
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Micro-batches per optimizer step.
    pub micro_batches: usize,
    /// Data-parallel replicas (each takes its own sequences of every micro-batch).
    pub data_parallel: usize,
    /// What the data is (`needles`, `ids:FILE`, a file name, or any label a caller gives).
    pub data_source: String,
    /// The data's seed.
    pub seed: u64,
    /// The compute dtype.
    pub dtype: DType,
    /// Optimizer steps of the whole run.
    pub steps: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Whether weight decay falls on norms, biases and embeddings too (`--decay-all`; see
    /// [`crate::train::config::TrainConfig::decay_all`]).
    pub decay_all: bool,
    /// Warm-up steps.
    pub warmup: usize,
    /// The sliding attention window, if any.
    pub max_attention_distance: Option<usize>,
    /// The sequence-length curriculum as `--curriculum` spells it (`none` without one).
    pub curriculum: String,
    /// The base model a LoRA run trains adapters on (`--model` as given); `None` for full fine-tuning.
    pub base_model: Option<String>,
    /// The RoPE extension the run applied (`--rope-scaling` as it spells it); `None`: none.
    pub rope_scaling: Option<String>,
    /// How windows are packed from documents (`--packing` as it spells it); `None`: synthetic data.
    pub packing: Option<String>,
}

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
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Data-parallel replicas (1 in checkpoints written before meshes existed).
    pub data_parallel: usize,
    /// The ranks the optimizer state is sharded over, when it is (one file per rank); `None`: one
    /// `optimizer.safetensors` with the whole state.
    pub sharded_over: Option<usize>,
    /// The data source as given.
    pub data_source: String,
    /// The data's seed.
    pub seed: u64,
    /// The compute dtype (`--dtype`); checkpoints written before it was recorded were f32.
    pub dtype: DType,
    /// The schedule it was trained with (`None` in checkpoints written before these were recorded): a resumed
    /// run that changes them says so ([`TrainerState::resume_changes`]).
    pub steps: Option<usize>,
    /// Peak learning rate (`None` in older checkpoints).
    pub lr: Option<f64>,
    /// Whether weight decay fell on norms, biases and embeddings too (`None` in older checkpoints, which
    /// decayed everything).
    pub decay_all: Option<bool>,
    /// Warm-up steps (`None` in older checkpoints).
    pub warmup: Option<usize>,
    /// The sliding attention window (`--max-attention-distance`); `None` also for checkpoints written before
    /// it existed (they were trained without one).
    pub max_attention_distance: Option<usize>,
    /// The sequence-length curriculum of `--data needles` as `--curriculum` spells it (`none` for other
    /// data; `None` in checkpoints written before it was recorded).
    pub curriculum: Option<String>,
    /// The base model of a LoRA run, whose checkpoints hold the adapter instead of the model; `None` for full
    /// fine-tuning.
    pub base_model: Option<String>,
    /// The f16 loss scaler's scale and good steps since it last changed, when the run scales its loss.
    pub loss_scale: Option<(f64, u32)>,
    /// The RoPE extension the run applied (`--rope-scaling`); `None`: none, or a checkpoint written before
    /// it was recorded.
    pub rope_scaling: Option<String>,
    /// How windows were packed from documents (`--packing`); `None`: synthetic data, or a checkpoint written
    /// before it was recorded (file data was then packed document-blind, `stream`).
    pub packing: Option<String>,
}

impl TrainerState {
    /// The state of a run of `shape` after `step` steps, AdamW at `optimizer_step`, the data at `data`.
    pub fn new(step: usize, optimizer_step: u64, data: Position, shape: &RunShape) -> Self {
        Self {
            step,
            optimizer_step,
            data,
            seq_len: shape.seq_len,
            micro_batches: shape.micro_batches,
            data_parallel: shape.data_parallel,
            sharded_over: None,
            data_source: shape.data_source.clone(),
            seed: shape.seed,
            dtype: shape.dtype,
            steps: Some(shape.steps),
            lr: Some(shape.lr),
            decay_all: Some(shape.decay_all),
            warmup: Some(shape.warmup),
            max_attention_distance: shape.max_attention_distance,
            curriculum: Some(shape.curriculum.clone()),
            base_model: shape.base_model.clone(),
            loss_scale: None,
            rope_scaling: shape.rope_scaling.clone(),
            packing: shape.packing.clone(),
        }
    }

    /// Checks that a run of shape `now` may resume this checkpoint (at `dir`, for the messages). A change of
    /// `--dp` is allowed and reported (any mesh resumes any checkpoint). The micro-batches, data, seed and
    /// dtype must be the same ([`TrainError::Checkpoint`] otherwise). The sequence
    /// length, window, steps, learning rate, warm-up, curriculum, RoPE scaling and packing may differ only with
    /// `allow_changes` ([`TrainError::Config`] naming each change otherwise); returns the changes
    /// (`--steps 4 -> 8`), which the caller should report. Older checkpoints that did not record the schedule
    /// compare only what they hold (one without a packing was packed document-blind: `stream`).
    pub fn resume_changes(&self, now: &RunShape, dir: &Path, allow_changes: bool) -> Result<Vec<String>> {
        let window = |w: Option<usize>| w.map_or("none".to_string(), |w| w.to_string());
        let may_change = [
            ("--seq-len", Some(self.seq_len.to_string()), now.seq_len.to_string()),
            ("--max-attention-distance", Some(window(self.max_attention_distance)), window(now.max_attention_distance)),
            ("--steps", self.steps.map(|x| x.to_string()), now.steps.to_string()),
            ("--lr", self.lr.map(|x| x.to_string()), now.lr.to_string()),
            ("--decay-all", Some(self.decay_all.unwrap_or(true).to_string()), now.decay_all.to_string()),
            ("--warmup", self.warmup.map(|x| x.to_string()), now.warmup.to_string()),
            ("--curriculum", self.curriculum.clone(), now.curriculum.clone()),
            (
                "--rope-scaling",
                Some(self.rope_scaling.clone().unwrap_or_else(|| "(not given)".into())),
                now.rope_scaling.clone().unwrap_or_else(|| "(not given)".into()),
            ),
            (
                "--packing",
                Some(self.packing.clone().unwrap_or_else(|| "stream".into())),
                now.packing.clone().unwrap_or_else(|| "stream".into()),
            ),
        ];
        let mut changes = Vec::new();
        for (what, saved, now) in may_change {
            if let Some(saved) = saved.filter(|s| *s != now) {
                changes.push(format!("{what} {saved} -> {now}"));
            }
        }
        if !changes.is_empty() && !allow_changes {
            return Err(TrainError::Config(format!(
                "--resume {}: this run changes {} from the checkpoint's run; resume with the checkpoint's values, or \
                 pass --allow-changes to go on with the new ones",
                dir.display(),
                changes.join(", ")
            )));
        }
        let same = [
            ("--batch-tokens / --seq-len", self.micro_batches.to_string(), now.micro_batches.to_string()),
            ("--data", self.data_source.clone(), now.data_source.clone()),
            ("--seed", self.seed.to_string(), now.seed.to_string()),
            ("--dtype", self.dtype.as_str().to_string(), now.dtype.as_str().to_string()),
            (
                "base model (LoRA's --model)",
                self.base_model.clone().unwrap_or_else(|| "none (full fine-tuning)".into()),
                now.base_model.clone().unwrap_or_else(|| "none (full fine-tuning)".into()),
            ),
        ];
        for (what, saved, now) in same {
            if saved != now {
                return Err(TrainError::checkpoint(format!(
                    "--resume {}: the checkpoint was trained with {what} {saved}, this run has {now}; resume with \
                     the same options",
                    dir.display()
                )));
            }
        }
        // Another mesh needs no permission: the state is re-split, and the data position counts global samples
        // (every replica's), so the stream goes on from the same sample; a step then trains `--dp` replicas'.
        if self.data_parallel != now.data_parallel {
            changes.push(format!("--dp {} -> {}", self.data_parallel, now.data_parallel));
        }
        Ok(changes)
    }
}

/// Where the checkpoint of `step` goes under `root`: `root/step-{step}`.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step}"))
}

/// A checkpoint written by [`save`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Saved {
    /// Its directory, `root/step-N`.
    pub dir: PathBuf,
    /// What the save cleaned up first, one line each ([`clean_stale`]): a dead run's leftovers.
    pub cleaned: Vec<String>,
}

/// Writes the checkpoint of `state.step` into `root/step-{step}` atomically (see the module doc): the model
/// (`params` by HF name, from the optimizer's master weights where it keeps them, in `model`'s config dtype),
/// AdamW's state, the `tokenizer` files (name and text: `tokenizer.json`, `tokenizer_config.json`), and `state`
/// with every file's hash.
/// On failure nothing is replaced ([`TrainError::Save`]).
pub fn save(
    root: &Path,
    model: &LlamaModel,
    opt: &AdamW,
    params: &[Param],
    state: &TrainerState,
    tokenizer: &[(String, String)],
) -> Result<Saved> {
    std::fs::create_dir_all(root).io(|| format!("creating the checkpoint directory {}", root.display()))?;
    let cleaned = clean_stale(root)?;
    let dir = step_dir(root, state.step);
    let name = format!("step-{}", state.step);
    let tmp = root.join(format!(".{name}.partial-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).io(|| format!("removing {}", tmp.display()))?;
    }
    let written = write_into(&tmp, model, opt, params, state, tokenizer).and_then(|()| atomic::sync_tree(&tmp));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(TrainError::Save { dir, cause: Box::new(e) });
    }
    let old = root.join(format!(".{name}.old-{}", std::process::id()));
    atomic::install(root, &tmp, &dir, &old, &mut |_| {})?;
    Ok(Saved { dir, cleaned })
}

fn write_into(
    tmp: &Path,
    model: &LlamaModel,
    opt: &AdamW,
    params: &[Param],
    state: &TrainerState,
    tokenizer: &[(String, String)],
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
    write_model(tmp, model, disk, &weights, state.base_model.as_deref())?;
    drop(weights);
    let moments = state_names::to_file_names(&model.config, moments)?;
    candle_core::safetensors::save(&moments, tmp.join(OPTIMIZER_FILE))?;
    drop(moments);
    write_rest(tmp, state, tokenizer, None)
}

/// Makes `tmp` holding the model in the HF layout (`weights` by HF name, saved in `disk`), or, for a model
/// with LoRA adapters, the adapter in PEFT's layout (`weights`: what trains, saved in f32; `base_model` names
/// the base) and the model's config as [`BASE_CONFIG`] (the base with the run's RoPE scaling, which PEFT would
/// not apply from the base's own); it must be the first thing written there (written atomically, replacing
/// the directory).
fn write_model(
    tmp: &Path,
    model: &LlamaModel,
    disk: DType,
    weights: &HashMap<String, Tensor>,
    base_model: Option<&str>,
) -> Result<()> {
    match model.lora_config() {
        Some(lora) => {
            let tied = model.config.tie_word_embeddings;
            save_adapter(tmp, &lora, weights, base_model.unwrap_or_default(), tied, Some(DType::F32))?;
            let path = tmp.join(BASE_CONFIG);
            std::fs::write(&path, model.config.to_json()).io(|| format!("writing {}", path.display()))?;
        }
        None => save_model(tmp, &model.config, weights, &SaveOptions { dtype: Some(disk), ..SaveOptions::default() })?,
    }
    Ok(())
}

/// The file every checkpoint's permissions follow: `config.json`, or an adapter's `adapter_config.json`.
fn model_config_file(dir: &Path) -> PathBuf {
    if dir.join(ADAPTER_CONFIG).is_file() {
        dir.join(ADAPTER_CONFIG)
    } else {
        dir.join("config.json")
    }
}

/// Finishes `tmp` (which holds the model and the optimizer state already): the optimizer files get the model
/// files' permissions, the tokenizer is written, then `trainer_state.json` with `state`, `extra`'s fields and
/// every file's size and hash.
fn write_rest(tmp: &Path, state: &TrainerState, tokenizer: &[(String, String)], extra: Option<Value>) -> Result<()> {
    for entry in std::fs::read_dir(tmp).io(|| format!("listing {}", tmp.display()))? {
        let path = entry.io(|| format!("listing {}", tmp.display()))?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with("optimizer") && name.ends_with(".safetensors") {
            autosp_models::save::match_permissions(&path, &model_config_file(tmp))?;
        }
    }
    for (name, text) in tokenizer {
        let path = tmp.join(name);
        std::fs::write(&path, text).io(|| format!("writing {}", path.display()))?;
    }
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(tmp).io(|| format!("listing {}", tmp.display()))? {
        let path = entry.io(|| format!("listing {}", tmp.display()))?.path();
        let (bytes, fnv) = fingerprint(&path)?;
        let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
        files.insert(name, json!({ "bytes": bytes, "fnv1a64": fnv }));
    }
    let mut doc = json!({
        "step": state.step,
        "optimizer_step": state.optimizer_step,
        "data_drawn": state.data.drawn,
        "data_rng": state.data.rng.to_string(),
        "seq_len": state.seq_len,
        "micro_batches": state.micro_batches,
        "data_parallel": state.data_parallel,
        "data_source": state.data_source,
        "seed": state.seed.to_string(),
        "dtype": state.dtype.as_str(),
        "steps": state.steps,
        "lr": state.lr,
        "decay_all": state.decay_all,
        "warmup": state.warmup,
        "max_attention_distance": state.max_attention_distance,
        "curriculum": state.curriculum,
        "base_model": state.base_model,
        "loss_scale": state.loss_scale.map(|(scale, good)| json!({ "scale": scale, "good_steps": good })),
        "rope_scaling": state.rope_scaling,
        "packing": state.packing,
        "files": files,
    });
    if let (Some(Value::Object(extra)), Some(map)) = (extra, doc.as_object_mut()) {
        map.extend(extra);
    }
    let path = tmp.join(STATE_FILE);
    let text = serde_json::to_string_pretty(&doc)
        .map_err(|e| TrainError::io(format!("writing {}", path.display()), e.into()))?;
    std::fs::write(&path, text).io(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Reads `dir/trainer_state.json` and checks every file it lists (size and hash). The error
/// ([`TrainError::Checkpoint`]) names the damaged file and what is wrong with it, or, for a `--save` directory
/// given instead of one of its checkpoints, the newest checkpoint in it.
pub fn verify(dir: &Path) -> Result<TrainerState> {
    let damaged = |what: String| {
        TrainError::checkpoint(format!(
            "checkpoint {} is damaged: {what}; nothing was written; resume from another checkpoint",
            dir.display()
        ))
    };
    if !dir.is_dir() {
        return Err(TrainError::checkpoint(format!(
            "--resume {}: no such directory (give a `.../step-N` directory written by --save)",
            dir.display()
        )));
    }
    let path = dir.join(STATE_FILE);
    if !path.exists() {
        // A `--save` directory given for one of its checkpoints: name its newest.
        let newest = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.parse::<usize>().ok())
            .max();
        let hint = match newest {
            Some(n) => format!("; it holds checkpoints: the newest is --resume {}", step_dir(dir, n).display()),
            None => String::new(),
        };
        return Err(TrainError::checkpoint(format!(
            "--resume {}: not a checkpoint (it has no {STATE_FILE}); give a `.../step-N` directory written by \
             --save{hint}",
            dir.display()
        )));
    }
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
    let sharded = sharded::listed_files(&doc);
    let optimizer: Vec<String> = match &sharded {
        Some((_, list)) => list.keys().cloned().collect(),
        None => vec![OPTIMIZER_FILE.to_string()],
    };
    let model_file = if files.contains_key(ADAPTER_CONFIG) { ADAPTER_CONFIG } else { "config.json" };
    for name in std::iter::once(model_file.to_string()).chain(optimizer) {
        if !files.contains_key(&name) {
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
        data_parallel: doc.get("data_parallel").and_then(Value::as_u64).unwrap_or(1) as usize,
        sharded_over: sharded.map(|(world, _)| world),
        data_source: field("data_source")?.as_str().unwrap_or_default().to_string(),
        seed: num("seed")?,
        dtype: match doc.get("dtype") {
            None => DType::F32,
            Some(v) => v
                .as_str()
                .and_then(|d| crate::precision::parse_dtype(d).ok())
                .ok_or_else(|| damaged(format!("{STATE_FILE}: `dtype` is not bf16, f16 or f32")))?,
        },
        steps: doc.get("steps").and_then(Value::as_u64).map(|x| x as usize),
        lr: doc.get("lr").and_then(Value::as_f64),
        decay_all: doc.get("decay_all").and_then(Value::as_bool),
        warmup: doc.get("warmup").and_then(Value::as_u64).map(|x| x as usize),
        max_attention_distance: match doc.get("max_attention_distance") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                damaged(format!("{STATE_FILE}: `max_attention_distance` is not a whole number or null"))
            })? as usize),
        },
        curriculum: doc.get("curriculum").and_then(Value::as_str).map(str::to_string),
        base_model: doc.get("base_model").and_then(Value::as_str).map(str::to_string),
        rope_scaling: doc.get("rope_scaling").and_then(Value::as_str).map(str::to_string),
        packing: doc.get("packing").and_then(Value::as_str).map(str::to_string),
        loss_scale: match doc.get("loss_scale") {
            None | Some(Value::Null) => None,
            Some(v) => Some((
                v.get("scale")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| damaged(format!("{STATE_FILE}: bad `loss_scale`")))?,
                v.get("good_steps").and_then(Value::as_u64).unwrap_or(0) as u32,
            )),
        },
    })
}

/// Restores AdamW's moments of `params` (by HF name; the file's fused names of a Phi-3 model split into the
/// parts of `config`'s model), its step count `step` and the master weights from `dir/optimizer.safetensors`:
/// a bf16/f16 parameter's f32 master goes back into AdamW (and, rounded, into the parameter); an f32
/// parameter saved in a narrower model file gets its exact weights back.
pub fn restore_optimizer(
    dir: &Path,
    config: &autosp_models::LlamaConfig,
    opt: &mut AdamW,
    params: &[Param],
    step: u64,
) -> Result<()> {
    let path = dir.join(OPTIMIZER_FILE);
    let t = candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| TrainError::Checkpoint {
        message: format!("checkpoint {} is damaged: {OPTIMIZER_FILE} cannot be read", dir.display()),
        cause: Some(Box::new(e.into())),
    })?;
    let mut t = state_names::to_model_names(config, t)?;
    for p in params {
        let (m, v) = (t.remove(&format!("{}.exp_avg", p.name())), t.remove(&format!("{}.exp_avg_sq", p.name())));
        match (m, v) {
            (Some(m), Some(v)) if m.dims() == p.shape().dims() && v.dims() == p.shape().dims() => {
                opt.set_state(step, p, m, v)?
            }
            (None, None) if step == 0 => {}
            _ => {
                return Err(TrainError::checkpoint(format!(
                    "checkpoint {}: {OPTIMIZER_FILE} lacks the moments of `{}` (shape {:?}) or has another shape; \
                     it belongs to another model",
                    dir.display(),
                    p.name(),
                    p.shape().dims()
                )))
            }
        }
        if let Some(master) = t.remove(&format!("{}.master", p.name())) {
            let w = p.tensor();
            if master.dims() != p.shape().dims() {
                return Err(TrainError::checkpoint(format!(
                    "checkpoint {}: {OPTIMIZER_FILE} holds master weights of `{}` with shape {:?}, but the parameter \
                     has {:?}; it belongs to another model",
                    dir.display(),
                    p.name(),
                    master.dims(),
                    p.shape().dims()
                )));
            }
            if Precision::float(w.dtype()).needs_master() {
                opt.set_master(p, &master)?;
            } else {
                let exact = master.to_dtype(w.dtype())?.to_device(w.device())?;
                match p.shard() {
                    Some(s) => p.set_update(s.slice(&exact)?)?,
                    None => p.set(exact)?,
                }
            }
        }
    }
    Ok(())
}
