//! Save / load of HF checkpoints: bit-exact round trips (f32, bf16), sharding, atomic replacement, and
//! the errors for a corrupted header, a truncated file, a missing shard, a wrong shape, a missing tensor.

use autosp_models::{load_dir, random_weights, save_model, write_tiny, Error, LlamaConfig, SaveOptions, TinySpec};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

fn bits(t: &Tensor) -> Vec<u8> {
    // Compare raw bytes: bit-exact, NaN-safe.
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t.to_vec1::<f32>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect(),
        d => panic!("unexpected dtype {d:?}"),
    }
}

fn assert_same(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) {
    assert_eq!(a.len(), b.len());
    for (k, t) in a {
        assert_eq!(t.dtype(), b[k].dtype(), "{k}");
        assert_eq!(t.dims(), b[k].dims(), "{k}");
        assert_eq!(bits(t), bits(&b[k]), "{k} differs");
    }
}

fn round_trip(dtype: DType, spec: TinySpec) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let config = spec.config();
    let w = random_weights(&config, 7, dtype, &Device::Cpu).unwrap();
    save_model(&dir, &config, &w, &SaveOptions::default()).unwrap();
    let (c2, w2) = load_dir(&dir, dtype, &Device::Cpu).unwrap();
    assert_eq!(c2.torch_dtype, Some(dtype));
    let mut c1 = config.clone();
    c1.torch_dtype = Some(dtype);
    assert_eq!(c1, c2);
    assert_same(&w, &w2);
}

#[test]
fn save_load_round_trip_f32_bit_exact() {
    round_trip(DType::F32, TinySpec::default());
}

#[test]
fn save_load_round_trip_bf16_bit_exact() {
    round_trip(DType::BF16, TinySpec { tied: true, bias: true, ..TinySpec::default() });
}

#[test]
fn bf16_on_disk_loads_into_f32_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let spec = TinySpec::default();
    write_tiny(&dir, &spec, 3, DType::BF16).unwrap();
    let (_, w32) = load_dir(&dir, DType::F32, &Device::Cpu).unwrap();
    let w16 = random_weights(&spec.config(), 3, DType::BF16, &Device::Cpu).unwrap();
    for (k, t) in &w16 {
        // bf16 -> f32 is exact, so converting back gives the same bits.
        assert_eq!(bits(t), bits(&w32[k].to_dtype(DType::BF16).unwrap()), "{k}");
        assert_eq!(w32[k].dtype(), DType::F32);
    }
}

#[test]
fn tiny_is_deterministic_per_seed() {
    let c = TinySpec::default().config();
    let a = random_weights(&c, 11, DType::F32, &Device::Cpu).unwrap();
    let b = random_weights(&c, 11, DType::F32, &Device::Cpu).unwrap();
    let d = random_weights(&c, 12, DType::F32, &Device::Cpu).unwrap();
    assert_same(&a, &b);
    let k = "model.layers.0.mlp.up_proj.weight";
    assert_ne!(bits(&a[k]), bits(&d[k]));
}

fn write_sharded(dir: &Path) -> (LlamaConfig, HashMap<String, Tensor>) {
    let config = TinySpec::default().config();
    let w = random_weights(&config, 5, DType::F32, &Device::Cpu).unwrap();
    // Embedding alone is 128*64*4 = 32 KiB; 40 KB shards make several files.
    let opts = SaveOptions { dtype: None, max_shard_bytes: 40_000 };
    save_model(dir, &config, &w, &opts).unwrap();
    (config, w)
}

#[test]
fn sharded_save_load_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let (_, w) = write_sharded(&dir);
    assert!(dir.join("model.safetensors.index.json").is_file());
    assert!(!dir.join("model.safetensors").exists());
    let shards = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("model-"))
        .count();
    assert!(shards >= 3, "{shards} shards");
    let (_, w2) = load_dir(&dir, DType::F32, &Device::Cpu).unwrap();
    assert_same(&w, &w2);
}

#[test]
fn missing_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    write_sharded(&dir);
    let gone = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .find(|n| n.starts_with("model-00002"))
        .unwrap();
    std::fs::remove_file(dir.join(&gone)).unwrap();
    let e = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    assert!(matches!(&e, Error::MissingShard { shard, .. } if *shard == gone), "{e}");
    assert!(e.to_string().contains(&gone) && e.to_string().contains("download the checkpoint again"), "{e}");
}

fn single(dir: &Path) -> std::path::PathBuf {
    write_tiny(dir, &TinySpec::default(), 1, DType::F32).unwrap();
    dir.join("model.safetensors")
}

#[test]
fn corrupted_header_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let f = single(&dir);
    let mut bytes = std::fs::read(&f).unwrap();
    // Byte 8 starts the JSON header `{`: break it.
    bytes[8] = b'#';
    std::fs::write(&f, bytes).unwrap();
    let e = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    assert!(matches!(&e, Error::Safetensors { path, .. } if *path == f), "{e}");
    assert!(e.to_string().contains("model.safetensors"));
}

#[test]
fn truncated_file_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let f = single(&dir);
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len - 100).unwrap();
    let e = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    assert!(matches!(&e, Error::Safetensors { path, .. } if *path == f), "{e}");
    assert!(e.to_string().contains(&f.display().to_string()));
}

#[test]
fn wrong_shape_names_tensor_shapes_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    single(&dir);
    // Same weights, but a config with a larger intermediate size.
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(&cfg_path, text.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96")).unwrap();
    let e = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    match &e {
        Error::ShapeMismatch { name, expected, found, path } => {
            assert!(name.contains("mlp"), "{name}");
            assert!(expected.contains(&96) && found.contains(&128));
            assert!(path.ends_with("model.safetensors"));
        }
        other => panic!("expected ShapeMismatch, got {other}"),
    }
    assert!(e.to_string().contains("[96, 64]") || e.to_string().contains("[64, 96]"), "{e}");
}

#[test]
fn missing_and_unexpected_tensors_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    single(&dir);
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    // Three layers expected, two saved.
    std::fs::write(&cfg_path, text.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3")).unwrap();
    let e = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    assert!(matches!(&e, Error::MissingTensor { name, .. } if name.starts_with("model.layers.2.")), "{e}");
    // One layer expected, two saved.
    std::fs::write(&cfg_path, text.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1")).unwrap();
    let e = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    assert!(matches!(&e, Error::UnexpectedTensor { name, .. } if name.starts_with("model.layers.1.")), "{e}");
}

#[test]
fn failed_save_leaves_the_old_model_and_no_temporaries() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    single(&dir);
    let before = std::fs::read(dir.join("model.safetensors")).unwrap();
    // A save that fails part way (a tensor missing) must not touch the good model.
    let config = TinySpec::default().config();
    let mut w = random_weights(&config, 9, DType::F32, &Device::Cpu).unwrap();
    w.remove("model.norm.weight");
    let e = save_model(&dir, &config, &w, &SaveOptions::default()).unwrap_err();
    assert!(matches!(&e, Error::MissingTensor { name, .. } if name == "model.norm.weight"));
    assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), before);
    // A successful save replaces it whole and leaves only `m` in the parent.
    let w = random_weights(&config, 9, DType::F32, &Device::Cpu).unwrap();
    save_model(&dir, &config, &w, &SaveOptions::default()).unwrap();
    assert_ne!(std::fs::read(dir.join("model.safetensors")).unwrap(), before);
    let entries: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    assert_eq!(entries, vec!["m".to_string()]);
}

/// safetensors writes through a 0600 temporary file; every saved file must instead carry the mode the
/// user's umask gives (that of config.json), or a shared model cache is unreadable to the group.
#[cfg(unix)]
#[test]
fn weight_files_get_the_config_files_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    write_sharded(&dir);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let want = mode(&dir.join("config.json"));
    let mut weights = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            assert_eq!(mode(&path), want, "{} has mode {:o}, config.json {want:o}", path.display(), mode(&path));
            weights += 1;
        }
    }
    assert!(weights > 1, "the sharded save wrote {weights} weight files");
}
