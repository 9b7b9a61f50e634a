//! The model file of a sharded save, written tensor by tensor: the safetensors headers are made first from
//! the shapes alone (the HF names and order of [`autosp_models::LlamaConfig::expected_tensors`], the files
//! split past 5 GB with an index, as [`autosp_models::save_model`] does), then each weight is appended by rank
//! 0 in the file's dtype (from AdamW's f32 master where it keeps one). A sharded weight goes slice by slice:
//! the ranks' flat slices in rank order are its elements in order, so rank 0 writes its own and then each
//! other rank's as it receives it (each converted by its owner). The save never holds a whole sharded weight,
//! nor the whole model on rank 0, nor a second copy of it in the disk dtype.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use autosp_core::optim::AdamW;
use autosp_core::{Param, ShardLayout, ShardLevel};
use autosp_models::weights::{INDEX_FILE, SINGLE_FILE};
use autosp_models::{LlamaModel, SaveOptions};
use candle_core::{DType, Tensor};
use serde_json::{json, Value};

use crate::train::error::{IoContext, Result, TrainError};

/// One weight of the model file: its HF name, shape and parameter.
struct Planned<'a> {
    name: String,
    shape: Vec<usize>,
    param: &'a Param,
}

/// The weights to stream, in the file's order, when the model can be streamed: full fine-tuning (a LoRA run
/// saves its small adapter whole), a family whose files hold the weights as the model does (not Phi-3's
/// fused projections), every weight a trained parameter of its shape, and a disk dtype of f32, bf16 or f16.
fn plan<'a>(model: &LlamaModel, params: &'a [Param], disk: DType) -> Option<Vec<Planned<'a>>> {
    let config = &model.config;
    if model.lora_config().is_some()
        || config.model_type.fuses_projections()
        || !matches!(disk, DType::F32 | DType::BF16 | DType::F16)
    {
        return None;
    }
    let by_name: HashMap<&str, &Param> = params.iter().map(|p| (p.name(), p)).collect();
    config
        .expected_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let param = *by_name.get(name.as_str())?;
            (param.shape().dims() == shape.as_slice()).then_some(Planned { name, shape, param })
        })
        .collect()
}

/// Whether [`write`] can stream this model's file (else the caller gathers it whole).
pub(super) fn streamable(model: &LlamaModel, params: &[Param], disk: DType) -> bool {
    plan(model, params, disk).is_some()
}

/// safetensors' name of a dtype.
fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        _ => "F32",
    }
}

/// Writes `config.json` and the model's safetensors file(s) into `tmp` (`Some` on rank 0 only), one weight at a
/// time, a sharded one slice by slice from its owners (collective: every rank calls it, in the same order). Rank
/// 0 goes on receiving after a write fails, so the ranks stay in step, and returns the first error.
pub(super) fn write(tmp: Option<&Path>, model: &LlamaModel, opt: &AdamW, params: &[Param], disk: DType) -> Result<()> {
    let planned = plan(model, params, disk)
        .ok_or_else(|| TrainError::Config("this model's file cannot be streamed: save it whole".into()))?;
    // Greedy files in the config's order, as save_model splits them.
    let limit = SaveOptions::default().max_shard_bytes;
    let bytes = |p: &Planned| p.shape.iter().product::<usize>() * disk.size_in_bytes();
    let mut files: Vec<Vec<&Planned>> = vec![Vec::new()];
    let mut size = 0;
    for p in &planned {
        if size > 0 && size + bytes(p) > limit {
            files.push(Vec::new());
            size = 0;
        }
        size += bytes(p);
        files.last_mut().expect("never empty").push(p);
    }
    let n = files.len();
    let file_name =
        |i: usize| if n == 1 { SINGLE_FILE.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
    let mut failed: Option<TrainError> = None;
    if let Some(tmp) = tmp {
        let mut config = model.config.clone();
        config.torch_dtype = Some(disk);
        let path = tmp.join("config.json");
        failed = std::fs::write(&path, config.to_json()).io(|| format!("writing {}", path.display())).err();
    }
    let mut weight_map = BTreeMap::new();
    for (i, file) in files.iter().enumerate() {
        let name = file_name(i);
        let path = tmp.map(|t| t.join(&name));
        let mut out = match (&path, &failed) {
            (Some(path), None) => match open_with_header(path, file, disk) {
                Ok(out) => Some(out),
                Err(e) => {
                    failed = Some(e);
                    None
                }
            },
            _ => None,
        };
        for p in file {
            weight_map.insert(p.name.clone(), name.clone());
            // The master when AdamW keeps one, else the weight; a rank's slice of it when it is sharded.
            let sliced = match (opt.master(p.param), p.param.shard()) {
                (Some(m), Some(s)) => Some((m.clone(), s)),
                (None, Some(s)) if s.level == ShardLevel::Parameters => Some((p.param.tensor(), s)),
                _ => None,
            };
            // Rank 0 appends `t`; a tensor that could not be made, or not written, fails the save (kept in `failed`,
            // the ranks going on in step).
            let mut write = |t: candle_core::Result<Tensor>| {
                if let Some(w) = out.as_mut() {
                    if let Err(e) = t.and_then(|t| t.write_bytes(w)) {
                        failed =
                            Some(TrainError::Tensors { what: format!("writing `{}`", p.name), cause: Box::new(e) });
                        out = None;
                    }
                }
            };
            match sliced {
                // The slices in rank order are the weight's elements in order: rank 0 writes its own, then
                // takes each other rank's in turn (collective on every rank alike), so no rank holds it whole.
                Some((slice, s)) => {
                    let (group, layout) = (s.group.as_ref(), &s.layout);
                    let mut mine = Some(slice.narrow(0, 0, layout.owned().len()).and_then(|t| t.to_dtype(disk)));
                    let rank = group.rank();
                    for r in 0..group.size() {
                        if rank == 0 {
                            let piece = if r == 0 {
                                mine.take().expect("rank 0 takes its own once")
                            } else {
                                Ok(group.recv(r)?)
                            };
                            let want = ShardLayout { rank: r, ..*layout }.owned().len();
                            write(piece.and_then(|t| match t.elem_count() == want {
                                true => Ok(t),
                                false => Err(candle_core::Error::Msg(format!(
                                    "rank {r} could not convert its slice of {want} elements (its own error says why)"
                                ))),
                            }));
                        } else if rank == r {
                            // A slice that could not be converted goes as an empty tensor: rank 0 fails the save
                            // on its length, and no rank waits for a message that never comes.
                            let t = match &mine {
                                Some(Ok(t)) => t.clone(),
                                _ => Tensor::zeros(0, disk, slice.device())?,
                            };
                            group.send(&t, 0)?;
                        }
                    }
                    // Every weight ends together: a sender never runs ahead of rank 0's writes (a thread rank's
                    // send is buffered: it would hold its converted slices of the whole model).
                    group.barrier()?;
                    if let Some(Err(e)) = mine {
                        failed.get_or_insert(TrainError::Tensors {
                            what: format!("converting this rank's slice of `{}`", p.name),
                            cause: Box::new(e),
                        });
                    }
                }
                None => {
                    let whole = match opt.master(p.param) {
                        Some(m) => m.clone(),
                        None => p.param.whole()?,
                    };
                    if tmp.is_some() {
                        write(whole.to_dtype(disk));
                    }
                }
            }
        }
        if let (Some(mut w), Some(path)) = (out, &path) {
            if let Err(e) = w.flush().io(|| format!("writing {}", path.display())) {
                failed = failed.or(Some(e));
            }
        }
        if let (Some(path), Some(tmp), None) = (&path, tmp, &failed) {
            failed = autosp_models::save::match_permissions(path, &tmp.join("config.json")).err().map(Into::into);
        }
    }
    if let (Some(tmp), None, true) = (tmp, &failed, n > 1) {
        let total: usize = planned.iter().map(bytes).sum();
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        let path = tmp.join(INDEX_FILE);
        failed = std::fs::write(&path, index.to_string()).io(|| format!("writing {}", path.display())).err();
    }
    failed.map_or(Ok(()), Err)
}

/// `path` created with the safetensors header of `tensors` in `disk` written (8 little-endian bytes of
/// length, the JSON header padded with spaces to a multiple of 8), ready for the data in that order.
fn open_with_header(path: &Path, tensors: &[&Planned], disk: DType) -> Result<std::io::BufWriter<std::fs::File>> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut at = 0usize;
    for p in tensors {
        let end = at + p.shape.iter().product::<usize>() * disk.size_in_bytes();
        header
            .insert(p.name.clone(), json!({ "dtype": dtype_name(disk), "shape": p.shape, "data_offsets": [at, end] }));
        at = end;
    }
    let mut text = Value::Object(header).to_string().into_bytes();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let file = std::fs::File::create(path).io(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(text.len() as u64).to_le_bytes())
        .and_then(|()| out.write_all(&text))
        .io(|| format!("writing {}", path.display()))?;
    Ok(out)
}
