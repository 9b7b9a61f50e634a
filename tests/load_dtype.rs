//! Below `--shard parameters` every process reads the whole checkpoint (#41 item 1): in the run's dtype where
//! the files hold nothing wider, else in the master dtype. A bf16 checkpoint trained in bf16 is read in bf16
//! (half the bytes of the f32 read), and trains bit for bit as from its f32 widening (the f32 masters are
//! the same values: widening bf16 is exact), at `none`, `optimizer` and `gradients`, on 2 thread ranks.

mod common;

use std::path::{Path, PathBuf};

use autosp::core::ShardLevel;
use autosp::models::{random_weights, save_model, SaveOptions, TinySpec};
use autosp::train::model::load_dtype;
use autosp::train::{Job, RunOptions};
use candle_core::{DType, Device};

/// The tiny model with bf16-rounded weights, saved in `disk` (split into files when `split`).
fn write_model(dir: &Path, disk: DType, split: bool) {
    let config = TinySpec::default().config();
    let weights = random_weights(&config, 7, DType::F32, &Device::Cpu).unwrap();
    let rounded = weights.into_iter().map(|(k, t)| (k, t.to_dtype(DType::BF16).unwrap())).collect();
    let max_shard_bytes = if split { 40_000 } else { usize::MAX };
    save_model(dir, &config, &rounded, &SaveOptions { dtype: Some(disk), max_shard_bytes }).unwrap();
}

/// The files under `dir` named `name`, found at any depth.
fn find(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            found.extend(find(&p, name));
        } else if p.file_name().is_some_and(|n| n == name) {
            found.push(p);
        }
    }
    found
}

#[test]
fn a_checkpoint_is_read_in_the_runs_dtype_only_when_it_holds_nothing_wider() {
    let tmp = tempfile::tempdir().unwrap();
    let (bf16, split, f32) = (tmp.path().join("bf16"), tmp.path().join("split"), tmp.path().join("f32"));
    write_model(&bf16, DType::BF16, false);
    write_model(&split, DType::BF16, true);
    assert!(split.join("model.safetensors.index.json").is_file(), "the model is split into files");
    write_model(&f32, DType::F32, false);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    assert_eq!(load_dtype(&s(&bf16), DType::BF16).unwrap(), DType::BF16);
    assert_eq!(load_dtype(&s(&split), DType::BF16).unwrap(), DType::BF16, "split files");
    assert_eq!(load_dtype(&s(&bf16), DType::F32).unwrap(), DType::F32);
    assert_eq!(load_dtype(&s(&bf16), DType::F16).unwrap(), DType::F32, "bf16 files for an f16 run");
    assert_eq!(load_dtype(&s(&f32), DType::BF16).unwrap(), DType::F32, "f32 files keep the f32 masters");
    // An f32 RoPE buffer beside bf16 weights (old Llama saves) is not a weight: the files still read in bf16.
    let with_buffer = tmp.path().join("buffer");
    write_model(&with_buffer, DType::BF16, false);
    let file = with_buffer.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    tensors.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        candle_core::Tensor::ones(4, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, &file).unwrap();
    assert_eq!(load_dtype(&s(&with_buffer), DType::BF16).unwrap(), DType::BF16, "a RoPE buffer in f32");
}

#[test]
fn a_bf16_checkpoint_read_in_bf16_trains_bit_for_bit_as_its_f32_widening() {
    let tmp = tempfile::tempdir().unwrap();
    let (bf16, f32) = (tmp.path().join("bf16"), tmp.path().join("f32"));
    write_model(&bf16, DType::BF16, false);
    write_model(&f32, DType::F32, false);
    for level in [ShardLevel::None, ShardLevel::Optimizer, ShardLevel::Gradients] {
        let mut saved = Vec::new();
        for (model, read_in) in [(&bf16, DType::BF16), (&f32, DType::F32)] {
            let save = tmp.path().join(format!("save-{level}-{read_in:?}"));
            let o = RunOptions {
                model: Some(model.to_str().unwrap().into()),
                dtype: Some(DType::BF16),
                shard: Some(level),
                steps: 2,
                ..common::quick_run(&save)
            };
            let job = Job::prepare(o, 2, true).unwrap();
            let base = job.base.lock().unwrap().clone().expect("the job holds the starting weights");
            assert!(base.values().all(|t| t.dtype() == read_in), "{level}: the job must read in {read_in:?}");
            drop(base);
            common::run_job(&job, 2);
            let files = find(&save, "model.safetensors");
            assert_eq!(files.len(), 1, "{level}: {files:?}");
            let optimizer: Vec<Vec<u8>> = {
                let mut f = find(&save, "optimizer.safetensors");
                f.extend(find(&save, "optimizer-rank-00000-of-00002.safetensors"));
                f.iter().map(|p| std::fs::read(p).unwrap()).collect()
            };
            // The model file is saved in the source's dtype (bf16 and f32 here): compare the values in bf16.
            let mut model: Vec<(String, Vec<u32>)> = candle_core::safetensors::load(&files[0], &Device::Cpu)
                .unwrap()
                .into_iter()
                .map(|(k, t)| (k, common::bits(&t.to_dtype(DType::BF16).unwrap())))
                .collect();
            model.sort();
            saved.push((model, optimizer));
        }
        // The optimizer's files hold the f32 masters and moments: bit for bit.
        assert!(!saved[0].1.is_empty() && saved[0].1 == saved[1].1, "{level}: the optimizer states differ");
        assert!(saved[0].0 == saved[1].0, "{level}: the trained models differ");
    }
}
