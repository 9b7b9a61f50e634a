//! A model built from each rank's own byte ranges of its safetensors files (#41). At `--shard parameters`
//! every weight's slice (the elements [`ShardLayout::owned`] gives of the flattened weight, padded to the
//! chunk) is read with positioned reads ([`TensorFile`]) and becomes the parameter's slice
//! ([`autosp_core::Param::shard_from_slice`]): no rank holds a whole weight of the checkpoint, in f32 or any dtype, and a
//! rank reads about 1/W of the file. The values are those of loading the whole model in f32, converting to
//! the run's dtype and slicing, bit for bit (the same conversions, file dtype → f32 → run dtype).
//!
//! The model is first made as a [`skeleton`]: every weight a stride-0 broadcast of one zero, its shape,
//! dtype and device and nothing else. The job checks a run on it before any rank allocates (the counts, the
//! adapters LoRA adds, the optimizer state's headers), and a rank fills it in.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::memory::storage_key;
use autosp_core::shard::{ShardLayout, ShardLevel};
use autosp_core::{Param, Precision};
use autosp_models::weights::{TensorCheck, WeightFiles};
use autosp_models::{LlamaConfig, LlamaModel};
use candle_core::{DType, Device, Tensor};

use super::ranges::TensorFile;
use super::sharded::agree;
use crate::train::error::{Result, TrainError};

/// The safetensors files of a model whose weights can be read in ranges: single or split with an index
/// (HF checkpoints and ours), of a family whose files hold the weights as the model does (not Phi-3's fused
/// projections). A GGUF file is read whole (its weights are quantised: no byte range is an element range).
#[derive(Clone, Debug, PartialEq)]
pub struct WeightPaths(pub WeightFiles);

impl WeightPaths {
    /// The files of `weights` for a model of `config`, when its weights can be read in ranges.
    pub fn of(weights: &WeightFiles, config: &LlamaConfig) -> Option<Self> {
        if config.model_type.fuses_projections() {
            return None;
        }
        Some(Self(weights.clone()))
    }
}

/// The open weight files of a model, by tensor name: headers read, tensors read on demand. Opened once per
/// process (the job's, [`crate::train::Job::weight_ranges`]) and shared by its ranks: each reads its own
/// ranges through the same files, with positioned reads.
pub struct WeightRanges {
    files: Vec<TensorFile>,
    by_name: HashMap<String, usize>,
    /// What a missing tensor's message names: the single file, or the index of split files.
    whole: PathBuf,
}

impl WeightRanges {
    /// Opens every file of `paths` and reads its header.
    pub fn open(paths: &WeightPaths) -> Result<Self> {
        let (paths, whole) = match &paths.0 {
            WeightFiles::Single(p) => (std::slice::from_ref(p), p),
            WeightFiles::Sharded { index, shards } => (&shards[..], index),
        };
        let files = paths.iter().map(|p| TensorFile::open(p)).collect::<Result<Vec<_>>>()?;
        let mut by_name = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            by_name.extend(f.names().map(|n| (n.to_string(), i)));
        }
        Ok(Self { files, by_name, whole: whole.clone() })
    }

    /// Checks the headers against `config` as loading the whole model does (the same checks:
    /// [`TensorCheck`]). Reads nothing but the headers.
    pub fn check(&self, config: &LlamaConfig) -> Result<()> {
        let mut check = TensorCheck::new(config);
        let mut names: Vec<&String> = self.by_name.keys().collect();
        names.sort();
        for name in names {
            let file = &self.files[self.by_name[name]];
            let e = file.entry(name).expect("indexed from this file");
            check.tensor(file.path(), name, &e.shape, e.dtype.into())?;
        }
        Ok(check.finish(&self.whole)?)
    }

    /// Elements `elems` of weight `name` flattened, `[elems.len()]` in the master dtype of `dtype` (f32 for
    /// f32/bf16/f16): one positioned read of those bytes in the file's dtype, then converted. With the bytes
    /// read.
    fn read(&self, name: &str, elems: Range<usize>, dtype: DType) -> Result<(Tensor, u64)> {
        let i = *self.by_name.get(name).ok_or_else(|| {
            TrainError::Config(format!("the model's files hold no `{name}`: give a model whose files have it"))
        })?;
        let t = self.files[i].read(name, elems)?;
        let bytes = (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        Ok((t.to_dtype(Precision::float(dtype).master())?, bytes))
    }

    /// The dtype every weight a model of `config` reads is stored in, when they all share one (`None` for mixed
    /// dtypes, or none held). Tensors the model does not read (RoPE buffers, a tied model's `lm_head.weight`)
    /// do not count.
    pub fn stored_dtype(&self, config: &LlamaConfig) -> Option<DType> {
        let mut dtypes = config.expected_tensors().into_iter().map(|(name, _)| {
            let file = &self.files[*self.by_name.get(&name)?];
            file.entry(&name).map(|e| e.dtype)
        });
        let first = dtypes.next()??;
        dtypes.all(|d| d == Some(first)).then_some(first)
    }

    /// The bytes of tensors read from the files so far, all files and all readers together (the ranks of a
    /// process share one `WeightRanges`).
    pub fn bytes_read(&self) -> u64 {
        self.files.iter().map(TensorFile::bytes_read).sum()
    }
}

/// The model of `config` with every weight a stride-0 broadcast of one zero in `dtype` on `device` (one
/// element stored for the whole model): its parameters' names, shapes, dtype and device, not their values.
pub fn skeleton(config: &LlamaConfig, dtype: DType, device: &Device) -> Result<LlamaModel> {
    skeleton_of(config, &Tensor::zeros((), dtype, device)?)
}

/// The [`skeleton`] whose every weight is a broadcast of `zero` (a one-element tensor).
fn skeleton_of(config: &LlamaConfig, zero: &Tensor) -> Result<LlamaModel> {
    let weights = config
        .expected_tensors()
        .into_iter()
        .map(|(name, shape)| Ok((name, zero.broadcast_as(shape)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    Ok(LlamaModel::from_weights(config, weights)?)
}

/// A rank's model read from its ranges ([`build`]).
pub struct Built {
    /// The model: at `Parameters` over more than one rank every parameter sharded (its slice stored), else
    /// whole.
    pub model: LlamaModel,
    /// The f32 master weights of the parameters that train, by name, as read (this rank's slice `[chunk]`
    /// when sharded), when `dtype` keeps masters (bf16, f16); empty otherwise.
    pub masters: HashMap<String, Tensor>,
    /// The bytes this rank read from the weight files.
    pub bytes_read: u64,
}

/// Builds one rank's model of `config` in `dtype` on `device` from the open files `ranges`, sharded at
/// `Parameters` over `group` (more than one rank): each weight's slice read from its byte range; over one
/// rank, each weight read whole. `adapt` runs on the skeleton first (LoRA adds its adapters and puts a saved
/// adapter's tensors in): what it sets whole (the adapters, a saved adapter's trained norms) is sharded
/// from its whole tensor as [`autosp_core::Param::shard_over`] does, everything else is read. The ranks read
/// at once (no collective) and then agree that every one of them read (collective: one all-reduce) before
/// the whole-set parameters are sharded (a broadcast each), so a rank whose read fails stops every rank at
/// the same collective: it returns its own error, the others one saying a rank failed.
pub fn build(
    ranges: &WeightRanges,
    config: &LlamaConfig,
    dtype: DType,
    device: &Device,
    group: &Arc<dyn ProcessGroup>,
    adapt: impl FnOnce(&mut LlamaModel) -> Result<()>,
) -> Result<Built> {
    let sliced = group.size() > 1;
    // This rank's reads, no collective: the model, its masters, the bytes read and the parameters `adapt`
    // set whole (sharded after the agreement).
    let read = || -> Result<(Built, Vec<Param>)> {
        let zero = Tensor::zeros((), dtype, device)?;
        let placeholder = storage_key(&zero);
        let mut model = skeleton_of(config, &zero)?;
        adapt(&mut model)?;
        let keeps_master = Precision::float(dtype).needs_master();
        let (mut masters, mut whole, mut bytes_read) = (HashMap::new(), Vec::new(), 0);
        for p in model.params() {
            if storage_key(&p.tensor()) != placeholder {
                whole.push(p);
                continue;
            }
            let shape = p.shape();
            let layout = ShardLayout::new(shape.elem_count(), group.rank(), group.size());
            let elems = if sliced { layout.owned() } else { 0..layout.numel };
            let (master, bytes) = ranges.read(p.name(), elems.clone(), dtype)?;
            bytes_read += bytes;
            let stored = master.to_dtype(dtype)?;
            let pad = if sliced { layout.chunk - elems.len() } else { 0 };
            let (stored, master) = match pad {
                0 => (stored, master),
                _ => (stored.pad_with_zeros(0, 0, pad)?, master.pad_with_zeros(0, 0, pad)?),
            };
            if keeps_master && !p.is_frozen() {
                let master = if sliced { master } else { master.reshape(&shape)? };
                masters.insert(p.name().to_string(), master);
            }
            let stored = stored.to_device(device)?;
            if sliced {
                p.shard_from_slice(group.clone(), stored)?;
            } else {
                p.set(stored.reshape(&shape)?)?;
            }
        }
        Ok((Built { model, masters, bytes_read }, whole))
    };
    let read = read();
    let (built, whole) = match (agree(group.as_ref(), read.is_ok())?, read) {
        (_, Err(e)) => return Err(e),
        (true, Ok(r)) => r,
        (false, Ok(_)) => {
            return Err(TrainError::Config(
                "another rank failed reading its slices of the model's weights (its own error says why); no rank \
                 went on"
                    .into(),
            ))
        }
    };
    // Set whole by `adapt`: sharded as build_sharded does (collective, every rank the same parameters).
    if sliced {
        for p in whole {
            p.shard_over(ShardLevel::Parameters, group.clone())?;
        }
    }
    Ok(built)
}
