//! Loads a model's weights from `model.safetensors` or a sharded `model.safetensors.index.json`,
//! memory-mapped, converting f32/bf16/f16 on disk to the compute dtype, and validates every tensor name
//! and shape against [`LlamaConfig::expected_tensors`].

use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The weight files of a model directory: the single file, or every shard its index names.
#[derive(Debug, Clone, PartialEq)]
pub enum WeightFiles {
    /// `model.safetensors`.
    Single(PathBuf),
    /// `model.safetensors.index.json` and its shards, in the order of first appearance.
    Sharded { index: PathBuf, shards: Vec<PathBuf> },
}

/// Reads the `weight_map` of a sharded index: tensor name -> shard file name.
pub fn read_index(index: &Path) -> Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::Json { path: index.into(), message: e.to_string() })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Json { path: index.into(), message: "no `weight_map` object".into() })?;
    map.iter()
        .map(|(k, f)| match f.as_str() {
            Some(f) => Ok((k.clone(), f.to_string())),
            None => {
                Err(Error::Json { path: index.into(), message: format!("weight_map entry `{k}` is not a file name") })
            }
        })
        .collect()
}

/// Unique shard file names of a weight_map, sorted.
pub fn shard_names(weight_map: &HashMap<String, String>) -> Vec<String> {
    let set: BTreeSet<&String> = weight_map.values().collect();
    set.into_iter().cloned().collect()
}

/// Finds the weight files of `dir`; errors name the missing shard or say that neither file exists.
pub fn weight_files(dir: &Path) -> Result<WeightFiles> {
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        let map = read_index(&index)?;
        let mut shards = Vec::new();
        for name in shard_names(&map) {
            let path = dir.join(&name);
            if !path.is_file() {
                return Err(Error::MissingShard { shard: name, index, path });
            }
            shards.push(path);
        }
        return Ok(WeightFiles::Sharded { index, shards });
    }
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(WeightFiles::Single(single));
    }
    Err(Error::NotFound {
        model: dir.display().to_string(),
        missing: vec![SINGLE_FILE.into(), INDEX_FILE.into()],
        looked_in: dir.display().to_string(),
        hint: String::new(),
    })
}

/// Names HF checkpoints may hold that no computation reads (old Llama saves kept RoPE buffers).
pub(crate) fn ignorable(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// The checks of a model's safetensors files against its config, whether the tensors are loaded
/// ([`load_weights`]) or only their headers read (a rank reading its own byte ranges): every tensor the config
/// implies ([`LlamaConfig::expected_tensors`]) is there with its shape, in f32, bf16 or f16, and nothing else
/// but what no computation reads. Give it each tensor of the files ([`tensor`](Self::tensor)), then
/// [`finish`](Self::finish).
pub struct TensorCheck<'a> {
    config: &'a LlamaConfig,
    expected: HashMap<String, Vec<usize>>,
    seen: HashSet<String>,
}

impl<'a> TensorCheck<'a> {
    /// The checks for a model of `config`, no tensor seen yet.
    pub fn new(config: &'a LlamaConfig) -> Self {
        Self { config, expected: config.expected_tensors().into_iter().collect(), seen: HashSet::new() }
    }

    /// Checks tensor `name` of the file at `path`, of `shape` and `dtype` as the file's header gives them.
    /// `Ok(true)`: the model has it (counted as seen); `Ok(false)`: a tensor no computation reads, to skip
    /// (RoPE buffers, a tied model's `lm_head.weight`, which transformers skips too); an error naming the
    /// tensor and the file for one the model does not have, another shape, or a dtype other than f32, bf16
    /// or f16.
    pub fn tensor(&mut self, path: &Path, name: &str, shape: &[usize], dtype: safetensors::Dtype) -> Result<bool> {
        let Some(expected) = self.expected.get(name) else {
            if ignorable(name) || (self.config.tie_word_embeddings && name == "lm_head.weight") {
                return Ok(false);
            }
            return Err(Error::UnexpectedTensor { name: name.into(), found: shape.to_vec(), path: path.into() });
        };
        if expected != shape {
            let (name, expected, found) = (name.into(), expected.clone(), shape.to_vec());
            return Err(Error::ShapeMismatch { name, expected, found, path: path.into() });
        }
        use safetensors::Dtype as D;
        if !matches!(dtype, D::F32 | D::BF16 | D::F16) {
            return Err(Error::UnsupportedDtype { name: name.into(), dtype: format!("{dtype:?}"), path: path.into() });
        }
        self.seen.insert(name.to_string());
        Ok(true)
    }

    /// Fails naming the first tensor of the config's order that no file held, with `path` where it should
    /// have been (the single file, or the index of split files).
    pub fn finish(self, path: &Path) -> Result<()> {
        match self.config.expected_tensors().into_iter().find(|(name, _)| !self.seen.contains(name)) {
            Some((name, expected)) => Err(Error::MissingTensor { name, expected, path: path.into() }),
            None => Ok(()),
        }
    }
}

/// Loads every tensor of `files` into `dtype` on `device`, checked against `config` ([`TensorCheck`]).
///
/// Returns HF name -> tensor with the shapes of [`LlamaConfig::expected_tensors`]. A tied model's
/// `lm_head.weight`, if a file holds one anyway, is skipped, as transformers does.
pub fn load_weights(
    files: &WeightFiles,
    config: &LlamaConfig,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let (paths, whole) = match files {
        WeightFiles::Single(p) => (vec![p.clone()], p),
        WeightFiles::Sharded { index, shards } => (shards.clone(), index),
    };
    let mut check = TensorCheck::new(config);
    let mut out = HashMap::new();
    for path in &paths {
        load_file(path, &mut check, dtype, device, &mut out)?;
    }
    // Missing tensors are reported in the config's order, naming where they should have been.
    check.finish(whole)?;
    Ok(out)
}

fn load_file(
    path: &Path,
    check: &mut TensorCheck<'_>,
    dtype: DType,
    device: &Device,
    out: &mut HashMap<String, Tensor>,
) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the map is read-only and dropped before returning; a file changed by another process
    // while we read it is outside what any safetensors reader can guard against.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let st = safetensors::SafeTensors::deserialize(&mmap)
        .map_err(|e| Error::Safetensors { path: path.into(), message: e.to_string() })?;
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    for name in names {
        let view = st.tensor(&name).map_err(|e| Error::Safetensors { path: path.into(), message: e.to_string() })?;
        if !check.tensor(path, &name, view.shape(), view.dtype())? {
            continue;
        }
        let t = view.load(&Device::Cpu)?.to_dtype(dtype)?.to_device(device)?;
        out.insert(name, t);
    }
    Ok(())
}

/// Loads `config.json` and the weights of a local model directory.
pub fn load_dir(dir: &Path, dtype: DType, device: &Device) -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let config = LlamaConfig::from_file(LlamaConfig::path_in(dir))?;
    let files = weight_files(dir)?;
    let weights = load_weights(&files, &config, dtype, device)?;
    Ok((config, weights))
}
