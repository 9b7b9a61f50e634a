//! Saves a model as HF transformers expects it: `config.json` plus `model.safetensors`, or shards
//! `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` past a size limit. The files are
//! written into a temporary sibling directory that is renamed into place at the end, so an interrupted
//! save never leaves a half-written model where a good one was.

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::weights::{INDEX_FILE, SINGLE_FILE};
use candle_core::{DType, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// How to write the weights.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// dtype on disk (F32, BF16 or F16); `None` keeps each tensor's own dtype.
    pub dtype: Option<DType>,
    /// Largest shard in bytes of tensor data; past it the checkpoint is sharded. transformers uses 5 GB.
    pub max_shard_bytes: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions { dtype: None, max_shard_bytes: 5_000_000_000 }
    }
}

/// Writes `config` and `weights` (HF name -> tensor, exactly the names and shapes of
/// [`LlamaConfig::expected_tensors`], or Phi-3's fused projections split as the model holds them) into `dir`,
/// replacing a model already there only once the new one is complete.
pub fn save_model(
    dir: &Path,
    config: &LlamaConfig,
    weights: &HashMap<String, Tensor>,
    opts: &SaveOptions,
) -> Result<()> {
    let expected = config.expected_tensors();
    // Phi-3's files fuse what the model holds split.
    let weights = &crate::fused::fuse(config, weights)?;
    check_weights(dir, &expected, weights)?;
    if let Some(d) = opts.dtype {
        if !matches!(d, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::UnsupportedDtype {
                name: "(save dtype)".into(),
                dtype: format!("{d:?}"),
                path: dir.into(),
            });
        }
    }

    // Tensors to write, in the config's order, converted to the save dtype.
    let mut tensors = Vec::with_capacity(expected.len());
    for (name, _) in &expected {
        let t = &weights[name];
        let t = match opts.dtype {
            Some(d) => t.to_dtype(d)?,
            None => t.clone(),
        };
        tensors.push((name.clone(), t.contiguous()?));
    }
    let mut config = config.clone();
    config.torch_dtype = Some(opts.dtype.unwrap_or_else(|| tensors[0].1.dtype()));

    // Greedy sharding in the config's order.
    let mut shards: Vec<Vec<(String, Tensor)>> = vec![vec![]];
    let mut bytes = 0usize;
    let mut total = 0usize;
    for (name, t) in tensors {
        let n = t.elem_count() * t.dtype().size_in_bytes();
        if bytes > 0 && bytes + n > opts.max_shard_bytes {
            shards.push(vec![]);
            bytes = 0;
        }
        bytes += n;
        total += n;
        shards.last_mut().expect("never empty").push((name, t));
    }

    let tmp = sibling(dir, "tmp")?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = write_files(&tmp, &config, &shards, total);
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    replace_dir(&tmp, dir)
}

fn check_weights(dir: &Path, expected: &[(String, Vec<usize>)], weights: &HashMap<String, Tensor>) -> Result<()> {
    let names: HashMap<&str, &Vec<usize>> = expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
    for (name, shape) in expected {
        match weights.get(name) {
            None => return Err(Error::MissingTensor { name: name.clone(), expected: shape.clone(), path: dir.into() }),
            Some(t) if t.dims() != shape.as_slice() => {
                return Err(Error::ShapeMismatch {
                    name: name.clone(),
                    expected: shape.clone(),
                    found: t.dims().to_vec(),
                    path: dir.into(),
                })
            }
            Some(_) => {}
        }
    }
    let mut extra: Vec<&String> = weights.keys().filter(|k| !names.contains_key(k.as_str())).collect();
    extra.sort();
    if let Some(name) = extra.first() {
        return Err(Error::UnexpectedTensor {
            name: (*name).clone(),
            found: weights[*name].dims().to_vec(),
            path: dir.into(),
        });
    }
    Ok(())
}

fn write_files(tmp: &Path, config: &LlamaConfig, shards: &[Vec<(String, Tensor)>], total: usize) -> Result<()> {
    let cfg_path = tmp.join("config.json");
    std::fs::write(&cfg_path, config.to_json()).map_err(|e| Error::io(&cfg_path, e))?;
    // transformers refuses safetensors files without format metadata.
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 { SINGLE_FILE.to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) };
        let path = tmp.join(&file);
        let data: Vec<(&str, &Tensor)> = shard.iter().map(|(k, t)| (k.as_str(), t)).collect();
        safetensors::serialize_to_file(data, Some(meta.clone()), &path)
            .map_err(|e| Error::Safetensors { path: path.clone(), message: e.to_string() })?;
        match_permissions(&path, &cfg_path)?;
        for (name, _) in shard {
            weight_map.insert(name.clone(), file.clone());
        }
    }
    if n > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let path = tmp.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index).expect("a JSON map always serialises");
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
    }
    Ok(())
}

/// Gives `path` the permissions of `like`, a file this process wrote with `std::fs` (so the user's umask
/// applied). safetensors writes through a temporary file created with mode 0600, which would leave a saved
/// model readable by its owner only (a shared model cache, a job run as another user) while the config
/// beside it is not.
pub fn match_permissions(path: &Path, like: &Path) -> Result<()> {
    let perms = std::fs::metadata(like).map_err(|e| Error::io(like, e))?.permissions();
    std::fs::set_permissions(path, perms).map_err(|e| Error::io(path, e))
}

/// `.<name>.<tag>-<pid>` next to `dir`.
pub(crate) fn sibling(dir: &Path, tag: &str) -> Result<PathBuf> {
    let name = dir.file_name().ok_or_else(|| {
        Error::io(dir, std::io::Error::new(std::io::ErrorKind::InvalidInput, "save path has no directory name"))
    })?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
    Ok(parent.join(format!(".{}.{tag}-{}", name.to_string_lossy(), std::process::id())))
}

/// Moves the complete `tmp` to `dir`; an old `dir` is moved aside first and deleted after.
pub(crate) fn replace_dir(tmp: &Path, dir: &Path) -> Result<()> {
    if dir.exists() {
        let old = sibling(dir, "old")?;
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
        }
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
        std::fs::rename(tmp, dir).map_err(|e| Error::io(dir, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    } else {
        std::fs::rename(tmp, dir).map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}
