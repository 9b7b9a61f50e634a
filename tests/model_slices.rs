//! A model built from each rank's byte ranges of its safetensors files (`checkpoint::model_slices`, #41) holds
//! exactly what loading the whole model in f32, converting it to the run's dtype and sharding it at
//! `parameters` holds: every parameter's slice bit for bit, and the f32 masters of bf16 training, at W = 1, 2
//! and 4 thread ranks; single and multi-file checkpoints, in f32 and bf16 on disk, tied and untied
//! embeddings; LoRA's frozen base from slice reads beside adapters (and trained norms) that a saved adapter
//! sets whole. Each rank reads exactly the bytes of its own elements: 1/W of the file's tensors, each
//! element by one rank.

mod common;
use common::bits;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use autosp::build_sharded;
use autosp::compile::CompileError;
use autosp::core::comm::{run_ranks, ProcessGroup};
use autosp::core::lora::LoraConfig;
use autosp::core::shard::ShardLayout;
use autosp::core::ShardLevel;
use autosp::models::weights::weight_files;
use autosp::models::{random_weights, save_model, LlamaConfig, LlamaModel, SaveOptions, TinySpec};
use autosp::train::checkpoint::model_slices::{build, skeleton, WeightPaths, WeightRanges};
use candle_core::{DType, Device, Tensor};

/// A tiny model written into `dir`: `disk` dtype, split into files of at most `max_shard_bytes`.
fn write_model(dir: &Path, tied: bool, disk: DType, max_shard_bytes: usize) -> LlamaConfig {
    let config = TinySpec { tied, ..TinySpec::default() }.config();
    let weights = random_weights(&config, 11, DType::F32, &Device::Cpu).unwrap();
    save_model(dir, &config, &weights, &SaveOptions { dtype: Some(disk), max_shard_bytes }).unwrap();
    config
}

/// Today's path on one rank: the whole model loaded in f32, built in `dtype`, adapted, sharded at `parameters`
/// (in turn) over `pg`; with the whole f32 weights, for the masters.
fn whole_then_shard(
    dir: &Path,
    dtype: DType,
    pg: &Arc<dyn ProcessGroup>,
    adapt: &dyn Fn(&mut LlamaModel),
) -> (LlamaModel, HashMap<String, Tensor>) {
    let loaded = LlamaModel::load(dir.to_str().unwrap(), DType::F32).unwrap();
    let base = loaded.to_weights();
    let config = loaded.config.clone();
    let build = || -> Result<LlamaModel, CompileError> {
        let w = base.iter().map(|(k, t)| (k.clone(), t.to_dtype(dtype).unwrap())).collect();
        let mut m = LlamaModel::from_weights(&config, w).unwrap();
        adapt(&mut m);
        Ok(m)
    };
    (build_sharded(pg, ShardLevel::Parameters, build).unwrap(), base)
}

/// The adapter tensors a LoRA run starts from: rank-2 adapters on q/v with the norms trained, every tensor
/// made different from the base's (norms scaled by 3, B non-zero).
fn saved_adapter(config: &LlamaConfig) -> (LoraConfig, HashMap<String, Tensor>) {
    let lora = LoraConfig { targets: vec!["q_proj".into(), "v_proj".into()], train_norm: true, ..LoraConfig::new(2) };
    let mut m = LlamaModel::from_weights(config, random_weights(config, 5, DType::F32, &Device::Cpu).unwrap()).unwrap();
    m.add_lora(&lora).unwrap();
    let adapter = m.adapter_weights().into_iter().map(|(k, t)| (k, ((t + 0.5).unwrap() * 3.0).unwrap())).collect();
    (lora, adapter)
}

/// At W ranks: every parameter of the slice-read model equals today's (bitwise, its stored slice), the masters
/// equal the slices of the f32 weights, and the bytes read are exactly the rank's own elements of the file.
fn check(dir: &Path, dtype: DType, world: usize, lora: bool) {
    let config = LlamaConfig::from_file(LlamaConfig::path_in(dir)).unwrap();
    let paths = WeightPaths::of(&weight_files(dir).unwrap(), &config).expect("safetensors files read in ranges");
    let ranges = WeightRanges::open(&paths).unwrap();
    ranges.check(&config).unwrap();
    let adapter = lora.then(|| saved_adapter(&config));
    let file_dtype = config.torch_dtype.unwrap_or(DType::F32);
    let dir = dir.to_path_buf();
    let elems: usize = config.expected_tensors().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    let out = run_ranks(world, Duration::from_secs(120), move |pg| -> (u64, u64) {
        let adapt = |m: &mut LlamaModel| {
            if let Some((l, w)) = &adapter {
                m.add_lora(l).unwrap();
                m.set_adapter_weights(w).unwrap();
            }
        };
        let (want, whole) = whole_then_shard(&dir, dtype, &pg, &adapt);
        let built = build(&ranges, &config, dtype, &Device::Cpu, &pg, |m| {
            adapt(m);
            Ok(())
        })
        .unwrap();
        let got: HashMap<String, Tensor> = built.model.params().iter().map(|p| (p.name().into(), p.tensor())).collect();
        let mut own_bytes = 0;
        for p in want.params() {
            let name = p.name();
            let g = &got[name];
            assert_eq!((g.dims(), g.dtype()), (p.tensor().dims(), p.tensor().dtype()), "W={world} {name}");
            assert_eq!(bits(g), bits(&p.tensor()), "W={world} {dtype:?} {name}: the stored slice, bit for bit");
            let read = adapter.as_ref().is_none_or(|(_, w)| !w.contains_key(name));
            let layout = ShardLayout::new(p.shape().elem_count(), pg.rank(), pg.size());
            if read {
                own_bytes += (layout.owned().len() * file_dtype.size_in_bytes()) as u64;
            }
            // The f32 masters of the weights that train and are read, as set_master would slice the whole.
            match (dtype == DType::BF16 && !p.is_frozen() && read, built.masters.get(name)) {
                (true, Some(m)) => {
                    let want = if world > 1 { layout.slice(&whole[name]).unwrap() } else { whole[name].clone() };
                    assert_eq!(m.dims(), want.dims(), "{name}");
                    assert_eq!(bits(m), bits(&want), "W={world} {name}: the master from the file's values");
                }
                (false, None) => {}
                (expected, got) => panic!("W={world} {dtype:?} {name}: master expected {expected}, got {got:?}"),
            }
        }
        assert_eq!(got.len(), want.params().len());
        (built.bytes_read, own_bytes)
    });
    let read: Vec<(u64, u64)> = out.into_iter().map(|r| r.unwrap()).collect();
    for (r, (got, own)) in read.iter().enumerate() {
        assert_eq!(got, own, "rank {r} of {world} reads exactly its own elements' bytes");
    }
    // Every element of the file's tensors (a tied model's absent head aside) read by exactly one rank.
    if !lora {
        assert_eq!(read.iter().map(|r| r.0).sum::<u64>(), (elems * file_dtype.size_in_bytes()) as u64);
        let most = read.iter().map(|r| r.0).max().unwrap() as f64;
        let share = (elems * file_dtype.size_in_bytes()) as f64 / world as f64;
        assert!(most <= share * 1.02, "W={world}: the largest rank read {most} bytes, 1/W is {share}");
    }
}

/// A temporary directory (removed when dropped, a failed test's too) and `name`, not yet made, inside it.
fn temp(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    (tmp, dir)
}

#[test]
fn slices_read_from_one_file_equal_the_whole_load_sharded() {
    let (_tmp, dir) = temp("single");
    write_model(&dir, false, DType::F32, usize::MAX);
    for world in [1, 2, 4] {
        for dtype in [DType::F32, DType::BF16] {
            check(&dir, dtype, world, false);
        }
    }
}

#[test]
fn slices_read_from_split_bf16_files_of_a_tied_model_equal_the_whole_load_sharded() {
    let (_tmp, dir) = temp("split");
    let config = write_model(&dir, true, DType::BF16, 40_000);
    assert!(dir.join("model.safetensors.index.json").is_file(), "the model is split into files");
    // A tensor no file holds is named with the index, as loading the whole model names it.
    let more = LlamaConfig { num_hidden_layers: config.num_hidden_layers + 1, ..config };
    let paths = WeightPaths::of(&weight_files(&dir).unwrap(), &more).unwrap();
    let e = WeightRanges::open(&paths).unwrap().check(&more).unwrap_err().to_string();
    assert!(e.contains("model.layers.2.") && e.contains("model.safetensors.index.json"), "{e}");
    for world in [2, 4] {
        for dtype in [DType::F32, DType::BF16] {
            check(&dir, dtype, world, false);
        }
    }
}

#[test]
fn lora_base_slices_are_read_and_a_saved_adapter_is_sharded_whole() {
    let (_tmp, dir) = temp("lora");
    write_model(&dir, true, DType::BF16, usize::MAX);
    for world in [2, 4] {
        check(&dir, DType::BF16, world, true);
    }
}

/// The skeleton stores one element for the whole model; the headers' check names a wrong shape and a
/// missing tensor as loading the whole model does.
#[test]
fn skeleton_holds_no_weights_and_headers_are_checked() {
    let (_tmp, dir) = temp("check");
    let config = write_model(&dir, false, DType::F32, usize::MAX);
    let s = skeleton(&config, DType::BF16, &Device::Cpu).unwrap();
    let keys: std::collections::HashSet<usize> =
        s.params().iter().map(|p| autosp::core::memory::storage_key(&p.tensor())).collect();
    assert_eq!(keys.len(), 1, "every weight is a view of one element");
    let paths = WeightPaths::of(&weight_files(&dir).unwrap(), &config).unwrap();
    let mut other = config.clone();
    other.intermediate_size += 1;
    let e = WeightRanges::open(&paths).unwrap().check(&other).unwrap_err().to_string();
    assert!(e.contains("mlp") && e.contains("129"), "{e}");
    let mut more = config.clone();
    more.num_hidden_layers += 1;
    let e = WeightRanges::open(&paths).unwrap().check(&more).unwrap_err().to_string();
    assert!(e.contains("model.layers.2."), "{e}");
}

/// `Param::shard_from_slice` stores the slice given, as `shard_over` would have cut it, and refuses a slice of
/// another length or dtype and a parameter sharded already, naming it.
#[test]
fn shard_from_slice_stores_the_slice_and_refuses_a_wrong_one() {
    use autosp::core::Param;
    let out = run_ranks(2, Duration::from_secs(30), |pg| {
        let whole = Tensor::arange(0f32, 5., &Device::Cpu).unwrap();
        let cut = Param::new("w", whole.clone());
        cut.shard_over(ShardLevel::Parameters, pg.clone()).unwrap();
        let given = Param::new("w", Tensor::zeros((), DType::F32, &Device::Cpu).unwrap().broadcast_as(5).unwrap());
        let wrong = given.shard_from_slice(pg.clone(), Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap());
        assert!(wrong.unwrap_err().to_string().contains("the slice of `w` is [2]"));
        let bf16 = given.shard_from_slice(pg.clone(), Tensor::zeros(3, DType::BF16, &Device::Cpu).unwrap());
        assert!(bf16.is_err(), "a slice in another dtype is refused");
        given.shard_from_slice(pg.clone(), cut.tensor()).unwrap();
        assert_eq!(bits(&given.tensor()), bits(&cut.tensor()));
        assert_eq!(given.shape().dims(), [5], "the whole shape is kept");
        assert_eq!(bits(&given.whole().unwrap()), bits(&whole), "gathered whole again");
        let again = given.shard_from_slice(pg.clone(), cut.tensor()).unwrap_err().to_string();
        assert!(again.contains("is sharded already"), "{again}");
    });
    out.into_iter().for_each(|r| r.unwrap());
}

/// A job at `--shard parameters` reads the files' headers once (in `Job::prepare`) and its ranks read their
/// slices through the job's open files: with the model's files gone after prepare (unlinked: the open files
/// still read), both thread ranks still build and train.
#[test]
fn the_ranks_of_a_job_read_through_the_files_it_opened() {
    use autosp::train::{Job, RunOptions};
    let (tmp, dir) = temp("job");
    let config = write_model(&dir, false, DType::F32, usize::MAX);
    let save = tmp.path().join("save");
    let o = RunOptions {
        model: Some(dir.to_str().unwrap().into()),
        shard: Some(ShardLevel::Parameters),
        ..common::quick_run(&save)
    };
    let job = Job::prepare(o, 2, true).unwrap();
    let ranges = job.weight_ranges.clone().expect("each rank reads its slices at parameters");
    std::fs::remove_dir_all(&dir).unwrap();
    common::run_job(&job, 2);
    // Every element of the file's tensors read once, by one of the two ranks, through the job's files.
    let elems: usize = config.expected_tensors().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(ranges.bytes_read(), (elems * DType::F32.size_in_bytes()) as u64);
}
