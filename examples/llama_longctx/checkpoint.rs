//! Training checkpoints: `DIR/step-N/` holds the model in the HF layout (config.json + model.safetensors,
//! loadable by transformers and `LlamaModel::load`) in the model's own dtype (config.json's `torch_dtype`;
//! written from the f32 master weights when training in bf16/f16, so an f32 model trained in bf16 is saved
//! exactly), the tokenizer when the model has one, `optimizer.safetensors` (AdamW's moments,
//! `<param>.exp_avg` / `<param>.exp_avg_sq`, and `<param>.master`: the f32 master weights of bf16/f16
//! parameters, or the weights of any parameter the model file's dtype cannot hold exactly) and
//! `trainer_state.json` (step, optimizer step, data position, random state, the run's shape, schedule and
//! dtype, and the size and FNV-1a hash of every other file). A checkpoint is written into a hidden sibling
//! directory `.step-N.partial-PID`, every file and the directory are fsynced, and only then is it renamed into
//! place (and the parent directory fsynced), so an interrupted save or a power cut never damages the last good
//! checkpoint. Saving a step that already exists swaps the two directories in one atomic rename (Linux
//! `renameat2(RENAME_EXCHANGE)`) and then deletes the old one, so a complete `step-N` exists at every moment;
//! where the exchange is unavailable the old one is moved aside to `.step-N.old-PID` first, and the next save
//! puts it back if the process died between the two renames. Each save removes the hidden directories of
//! dead runs (their PID no longer runs). One run at a time saves into a directory: [`SaveLock`] holds
//! `DIR/.lock` (the owner's PID, `flock`ed) for the run, and a second run is refused naming that PID. Loading checks every file, hashed streaming, against the recorded
//! size and hash and names the damage.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use autosp::core::optim::AdamW;
use autosp::core::Param;
use autosp::core::Precision;
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
    /// The schedule it was trained with (`None` in checkpoints written before these were recorded): a resumed
    /// run that changes them says so (see `Job::prepare`).
    pub steps: Option<usize>,
    pub lr: Option<f64>,
    pub warmup: Option<usize>,
    /// The sliding attention window (`--max-attention-distance`); `None` also for checkpoints written before
    /// it existed (they were trained without one).
    pub max_attention_distance: Option<usize>,
    /// The sequence-length curriculum of `--data needles` as `--curriculum` spells it (`none` for other
    /// data; `None` in checkpoints written before it was recorded).
    pub curriculum: Option<String>,
}

/// Bytes read at a time when hashing a file.
const HASH_CHUNK: usize = 1 << 20;

/// FNV-1a (64-bit) of a file's bytes and its length, read in [`HASH_CHUNK`] pieces (a checkpoint's files
/// can be larger than the memory left).
fn fingerprint(path: &Path) -> Result<(u64, String)> {
    let mut f = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut buf = vec![0u8; HASH_CHUNK];
    let (mut h, mut len) = (0xcbf2_9ce4_8422_2325u64, 0u64);
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(anyhow::Error::from(e).context(format!("reading {}", path.display()))),
        };
        h = buf[..n].iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
        len += n as u64;
    }
    Ok((len, format!("{h:016x}")))
}

/// fsyncs every file directly in `dir`, then `dir` itself.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_file() {
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("flushing {} to disk", path.display()))?;
        }
    }
    sync_dir(dir)
}

/// fsyncs a directory (its entries: names created, renamed or removed in it). A no-op where directories
/// cannot be opened as files (Windows).
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("flushing {} to disk", dir.display()))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Swaps the directories `a` and `b` in one atomic rename, when the OS can (Linux 3.15+ on most file
/// systems). `Ok(false)`: not supported here; nothing changed.
fn exchange(a: &Path, b: &Path) -> Result<bool> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(anyhow::Error::from);
        let (ca, cb) = (c(a)?, c(b)?);
        // SAFETY: two valid NUL-terminated paths; renameat2 reads them and touches no memory of ours.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                ca.as_ptr(),
                libc::AT_FDCWD,
                cb.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if rc == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(false),
            _ => Err(anyhow::Error::from(e).context(format!("swapping {} and {}", a.display(), b.display()))),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (a, b);
        Ok(false)
    }
}

/// Puts the complete checkpoint `tmp` at `dir` (a sibling in `root`). When `dir` exists the two are swapped
/// atomically and the old one deleted, so a complete `dir` exists at every moment; without an atomic swap
/// the old one is moved aside to `old` first (the next save restores it if we die in between).
/// `observe(what)` is called after every step that changes the directory tree (tests check the invariant
/// there).
fn install(root: &Path, tmp: &Path, dir: &Path, old: &Path, observe: &mut dyn FnMut(&str)) -> Result<()> {
    if !dir.exists() {
        std::fs::rename(tmp, dir).with_context(|| format!("renaming {} into place", tmp.display()))?;
        observe("renamed into place");
    } else if exchange(tmp, dir)? {
        observe("swapped with the old checkpoint");
        sync_dir(root)?;
        // `tmp` now holds the old checkpoint.
        std::fs::remove_dir_all(tmp).with_context(|| format!("removing the old checkpoint at {}", tmp.display()))?;
        observe("old checkpoint removed");
    } else {
        std::fs::rename(dir, old).with_context(|| format!("moving the old {} aside", dir.display()))?;
        observe("old checkpoint moved aside");
        std::fs::rename(tmp, dir).with_context(|| format!("renaming {} into place", tmp.display()))?;
        observe("renamed into place");
        sync_dir(root)?;
        std::fs::remove_dir_all(old).with_context(|| format!("removing {}", old.display()))?;
        observe("old checkpoint removed");
    }
    sync_dir(root)
}

/// Whether process `pid` is running (on Unix; elsewhere every process is assumed alive, so nothing of
/// another run is ever removed).
fn alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        if pid == std::process::id() {
            return true;
        }
        // SAFETY: signal 0 only checks that the process exists; it sends nothing.
        let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
        rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Cleans up after runs that died while saving into `root`: hidden `.step-N.partial-PID` directories
/// (unfinished saves) of processes no longer running are removed; a `.step-N.old-PID` (a complete
/// checkpoint moved aside) is renamed back to `step-N` when that is missing, else removed. Returns what
/// it did, one line each.
pub fn clean_stale(root: &Path) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else { return Ok(done) };
    for entry in entries {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix(".step-") else { continue };
        let parsed = [(".partial-", false), (".old-", true)].into_iter().find_map(|(tag, old)| {
            let (step, pid) = rest.split_once(tag)?;
            Some((step.parse::<u64>().ok()?, pid.parse::<u32>().ok()?, old))
        });
        let Some((step, pid, old)) = parsed else { continue };
        if alive(pid) || !path.is_dir() {
            continue;
        }
        let target = root.join(format!("step-{step}"));
        if old && !target.exists() {
            std::fs::rename(&path, &target)
                .with_context(|| format!("restoring {} to {}", path.display(), target.display()))?;
            done.push(format!("restored {} (a save of process {pid} died between two renames)", target.display()));
        } else {
            std::fs::remove_dir_all(&path).with_context(|| format!("removing the stale {}", path.display()))?;
            done.push(format!("removed {} (left by process {pid}, which is no longer running)", path.display()));
        }
    }
    if !done.is_empty() {
        sync_dir(root)?;
    }
    Ok(done)
}

/// The lock file's name inside a save directory.
pub const LOCK_FILE: &str = ".lock";

/// The lock that makes one run at a time save into a directory: `DIR/.lock`, holding the owner's process
/// id, locked with `flock` (released by the OS when the process dies, so a crashed run never leaves the
/// directory locked) for as long as this value lives. Dropping it removes the file, and the directory too
/// when the lock created it and nothing else was written there.
pub struct SaveLock {
    path: PathBuf,
    created_dir: Option<PathBuf>,
    _file: std::fs::File,
}

impl SaveLock {
    /// Locks `root` for this process (creating it if needed). Refused, naming the other run's process id,
    /// while another live process holds the lock.
    pub fn acquire(root: &Path) -> Result<Self> {
        let created_dir = if root.exists() { None } else { Some(root.to_path_buf()) };
        std::fs::create_dir_all(root)
            .with_context(|| format!("--save {}: creating the checkpoint directory", root.display()))?;
        let path = root.join(LOCK_FILE);
        let cleanup = |e: anyhow::Error| {
            if let Some(d) = &created_dir {
                let _ = std::fs::remove_dir(d);
            }
            e
        };
        // A file another process unlinked while we waited is not the lock: retry on the new one.
        for _ in 0..8 {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .with_context(|| format!("--save {}: opening the lock file {}", root.display(), path.display()))
                .map_err(cleanup)?;
            if !try_lock(&file).map_err(cleanup)? {
                let mut owner = String::new();
                let _ = (&file).read_to_string(&mut owner);
                let owner = owner.trim();
                let who = if owner.is_empty() { "another process".to_string() } else { format!("process {owner}") };
                return Err(cleanup(anyhow!(
                    "--save {}: another run ({who}) is saving checkpoints into this directory; wait for it to \
                     finish or stop it, or give this run another --save directory",
                    root.display()
                )));
            }
            if !same_file(&file, &path) {
                continue;
            }
            file.set_len(0)
                .and_then(|()| {
                    use std::io::Write;
                    (&file).write_all(std::process::id().to_string().as_bytes())
                })
                .with_context(|| format!("--save {}: writing the lock file {}", root.display(), path.display()))
                .map_err(cleanup)?;
            return Ok(SaveLock { path, created_dir, _file: file });
        }
        Err(cleanup(anyhow!(
            "--save {}: could not take the lock file {} (it keeps being replaced)",
            root.display(),
            path.display()
        )))
    }
}

impl Drop for SaveLock {
    fn drop(&mut self) {
        // Unlinked while still locked: a process that opened it meanwhile sees another file at the path
        // (`same_file`) and retries.
        let _ = std::fs::remove_file(&self.path);
        if let Some(d) = &self.created_dir {
            // Only when empty: checkpoints saved by this run stay.
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Takes an exclusive `flock` on `file` without waiting: `Ok(false)` when another process holds it. Where
/// `flock` does not exist every lock succeeds (one run at a time is then up to the user).
fn try_lock(file: &std::fs::File) -> Result<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: a valid open file descriptor; flock touches no memory of ours.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Ok(false);
        }
        Err(anyhow::Error::from(e).context("locking the checkpoint directory"))
    }
    #[cfg(not(unix))]
    {
        let _ = file;
        Ok(true)
    }
}

/// Whether the open `file` is still the file at `path` (not unlinked or replaced since it was opened).
fn same_file(file: &std::fs::File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (file, path);
        true
    }
}

/// Where the checkpoint of `step` goes under `root`.
pub fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step}"))
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
    for line in clean_stale(root)? {
        eprintln!("llama_longctx: checkpoint directory {}: {line}", root.display());
    }
    let dir = step_dir(root, state.step);
    let name = format!("step-{}", state.step);
    let tmp = root.join(format!(".{name}.partial-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    let written = write_into(&tmp, model, opt, params, state, tokenizer).and_then(|()| sync_tree(&tmp));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("saving the checkpoint {} (nothing was replaced)", dir.display())));
    }
    let old = root.join(format!(".{name}.old-{}", std::process::id()));
    install(root, &tmp, &dir, &old, &mut |_| {})?;
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
    autosp::models::save::match_permissions(&tmp.join(OPTIMIZER_FILE), &tmp.join("config.json"))?;
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
        "steps": state.steps,
        "lr": state.lr,
        "warmup": state.warmup,
        "max_attention_distance": state.max_attention_distance,
        "curriculum": state.curriculum,
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
        bail!("--resume {}: no such directory (give a `.../step-N` directory written by --save)", dir.display());
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
        bail!(
            "--resume {}: not a checkpoint (it has no {STATE_FILE}); give a `.../step-N` directory written by \
             --save{hint}",
            dir.display()
        );
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
        steps: doc.get("steps").and_then(Value::as_u64).map(|x| x as usize),
        lr: doc.get("lr").and_then(Value::as_f64),
        warmup: doc.get("warmup").and_then(Value::as_u64).map(|x| x as usize),
        max_attention_distance: match doc.get("max_attention_distance") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                damaged(format!("{STATE_FILE}: `max_attention_distance` is not a whole number or null"))
            })? as usize),
        },
        curriculum: doc.get("curriculum").and_then(Value::as_str).map(str::to_string),
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
            if Precision::float(w.dtype()).needs_master() {
                opt.set_master(p, &master)?;
            } else {
                p.set(master.to_dtype(w.dtype())?)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A complete fake checkpoint: `a` and `b` hold the same `tag`.
    fn fake(dir: &Path, tag: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("a"), tag).unwrap();
        std::fs::write(dir.join("b"), tag).unwrap();
    }

    /// The tag of a complete fake checkpoint at `dir`, or why it is not one.
    fn complete(dir: &Path) -> std::result::Result<String, String> {
        let a = std::fs::read_to_string(dir.join("a")).map_err(|e| format!("{}: a: {e}", dir.display()))?;
        let b = std::fs::read_to_string(dir.join("b")).map_err(|e| format!("{}: b: {e}", dir.display()))?;
        if a == b {
            Ok(a)
        } else {
            Err(format!("{} mixes {a} and {b}", dir.display()))
        }
    }

    /// Saving a step that exists replaces it with no moment (between any two file-system operations)
    /// without a complete `step-N`, and leaves nothing hidden behind.
    #[test]
    fn replacing_a_step_always_leaves_a_complete_one() {
        let root = tempfile::tempdir().unwrap();
        let (dir, tmp, old) =
            (root.path().join("step-3"), root.path().join(".step-3.partial-1"), root.path().join(".step-3.old-1"));
        fake(&dir, "old");
        fake(&tmp, "new");
        let mut seen = Vec::new();
        install(root.path(), &tmp, &dir, &old, &mut |what| {
            let tag = complete(&dir).unwrap_or_else(|e| panic!("after `{what}` there is no complete step-3: {e}"));
            seen.push(format!("{what}: {tag}"));
        })
        .unwrap();
        assert_eq!(complete(&dir).unwrap(), "new", "{seen:?}");
        let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["step-3"], "{seen:?}");
    }

    /// A process id that no longer runs: a child that has exited and been waited for.
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    }

    /// Hidden directories of dead runs go (an unfinished save is removed; a complete checkpoint moved aside
    /// comes back when its step is missing); those of a running process stay.
    #[test]
    #[cfg(unix)]
    fn stale_hidden_directories_of_dead_runs_are_cleaned() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let (dead, live) = (dead_pid(), std::os::unix::process::parent_id());
        fake(&r.join(format!(".step-2.partial-{dead}")), "partial");
        fake(&r.join(format!(".step-2.partial-{live}")), "someone else's save in progress");
        fake(&r.join(format!(".step-5.old-{dead}")), "five");
        fake(&r.join("step-6"), "six");
        fake(&r.join(format!(".step-6.old-{dead}")), "six before");
        let done = clean_stale(r).unwrap();
        assert_eq!(done.len(), 3, "{done:?}");
        let mut left: Vec<String> =
            std::fs::read_dir(r).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
        left.sort();
        assert_eq!(left, [format!(".step-2.partial-{live}"), "step-5".into(), "step-6".into()]);
        assert_eq!(complete(&r.join("step-5")).unwrap(), "five");
        assert_eq!(complete(&r.join("step-6")).unwrap(), "six");
    }

    /// A `.lock` left by a dead run (not held) is taken over; while held, a second lock of the directory
    /// is refused naming the holder; dropping it removes the file, and the directory when the lock made it
    /// and it is empty (a directory that existed stays).
    #[test]
    #[cfg(unix)]
    fn the_save_lock_is_exclusive_and_leaves_no_trace() {
        let root = tempfile::tempdir().unwrap();
        let made = root.path().join("new");
        let lock = SaveLock::acquire(&made).unwrap();
        assert_eq!(std::fs::read_to_string(made.join(LOCK_FILE)).unwrap(), std::process::id().to_string());
        // flock locks belong to the open file: a second open in this process conflicts like another process.
        let e = SaveLock::acquire(&made).err().expect("a held lock must refuse a second one").to_string();
        assert!(e.contains(&format!("another run (process {})", std::process::id())), "{e}");
        assert!(made.join(LOCK_FILE).is_file(), "a refused lock must not remove the holder's file");
        drop(lock);
        assert!(!made.exists(), "the directory the lock made, left empty, goes with it");

        let kept = root.path().join("kept");
        std::fs::create_dir_all(&kept).unwrap();
        std::fs::write(kept.join(LOCK_FILE), "999999999").unwrap();
        let lock = SaveLock::acquire(&kept).unwrap();
        assert_eq!(std::fs::read_to_string(kept.join(LOCK_FILE)).unwrap(), std::process::id().to_string());
        drop(lock);
        let left: Vec<_> = std::fs::read_dir(&kept).unwrap().collect();
        assert!(kept.is_dir() && left.is_empty(), "a directory that existed stays, without the lock file");
    }

    /// The streaming hash equals FNV-1a over the whole file at once, across chunk boundaries, and hashing a
    /// file far larger than a chunk does not hold it in memory.
    #[test]
    fn file_hash_is_streamed() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("f");
        let bytes: Vec<u8> = (0..HASH_CHUNK * 2 + 12345).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let whole = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
        assert_eq!(fingerprint(&path).unwrap(), (bytes.len() as u64, format!("{whole:016x}")));
        drop(bytes);

        // 256 MiB (sparse) on disk; the hash may allocate its chunk (1 MiB) and small change, not the file.
        let big = root.path().join("big");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(256 << 20).unwrap();
        drop(f);
        let before = crate::ALLOC.live_bytes();
        crate::ALLOC.reset_peak();
        fingerprint(&big).unwrap();
        let extra = crate::ALLOC.peak_bytes().saturating_sub(before);
        // The allocator is process-wide and other tests of this binary allocate concurrently (one was seen to
        // take 34 MB): 96 MiB leaves room for them and is still far below the 256 MiB a whole-file read takes.
        assert!(extra < 96 << 20, "hashing a 256 MiB file took {extra} bytes of heap");
    }
}
