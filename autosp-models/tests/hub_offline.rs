//! Model resolution without the network: a local directory, and hub ids served from a fake HF cache
//! (models--owner--name/{refs,snapshots}) in a temp dir, offline; a miss names the files and the folder.

use autosp_models::hub::{parse_model_spec, resolve_model, HubOptions, ModelSpec};
use autosp_models::{write_tiny, Error, TinySpec, WeightFiles};
use candle_core::DType;
use std::path::Path;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// Lays out `owner/tiny` at `COMMIT` with ref `main` in the cache `root`, as hf-hub does.
fn fake_cache(root: &Path) -> std::path::PathBuf {
    let repo = root.join("models--owner--tiny");
    let snap = repo.join("snapshots").join(COMMIT);
    write_tiny(&snap, &TinySpec::default(), 1, DType::F32).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), COMMIT).unwrap();
    snap
}

fn offline(root: &Path) -> HubOptions {
    HubOptions {
        cache_dir: Some(root.to_path_buf()),
        offline: true,
    }
}

#[test]
fn parses_model_strings() {
    assert_eq!(
        parse_model_spec("HuggingFaceTB/SmolLM2-135M@v1.0").unwrap(),
        ModelSpec::Hub {
            repo: "HuggingFaceTB/SmolLM2-135M".into(),
            revision: "v1.0".into()
        }
    );
    assert_eq!(
        parse_model_spec("a/b").unwrap(),
        ModelSpec::Hub {
            repo: "a/b".into(),
            revision: "main".into()
        }
    );
    assert!(matches!(
        parse_model_spec("not a model"),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn resolves_from_cache_offline_by_ref_and_by_commit() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = fake_cache(tmp.path());
    let r = resolve_model("owner/tiny", &offline(tmp.path())).unwrap();
    assert_eq!(r.config, snap.join("config.json"));
    assert_eq!(
        r.weights,
        WeightFiles::Single(snap.join("model.safetensors"))
    );
    assert_eq!(r.tokenizer, None);
    let r = resolve_model(&format!("owner/tiny@{COMMIT}"), &offline(tmp.path())).unwrap();
    assert_eq!(r.config, snap.join("config.json"));
}

#[test]
fn resolves_a_local_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("local");
    write_tiny(&dir, &TinySpec::default(), 1, DType::F32).unwrap();
    let r = resolve_model(dir.to_str().unwrap(), &HubOptions::default()).unwrap();
    assert_eq!(
        r.weights,
        WeightFiles::Single(dir.join("model.safetensors"))
    );
}

#[test]
fn cache_miss_offline_names_files_and_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = fake_cache(tmp.path());
    std::fs::remove_file(snap.join("model.safetensors")).unwrap();
    let e = resolve_model("owner/tiny", &offline(tmp.path())).unwrap_err();
    match &e {
        Error::NotFound {
            missing, looked_in, ..
        } => {
            assert_eq!(missing.len(), 1);
            assert!(missing[0].contains("model.safetensors"), "{missing:?}");
            assert!(looked_in.contains("models--owner--tiny"), "{looked_in}");
        }
        other => panic!("expected NotFound, got {other}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("offline") && msg.contains("owner/tiny"),
        "{msg}"
    );

    // A repo that is not in the cache at all: both files missing.
    let e = resolve_model("owner/absent@dev", &offline(tmp.path())).unwrap_err();
    assert!(
        matches!(&e, Error::NotFound { missing, .. } if missing.len() == 2),
        "{e}"
    );
    assert!(e.to_string().contains("models--owner--absent"));
}
