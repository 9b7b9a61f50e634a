//! `HF_HUB_OFFLINE=1` and `HF_HUB_CACHE` from the environment (its own test binary with one test, so
//! setting the environment races with nothing): cache hits resolve, a miss says it was offline.

use autosp_models::{resolve_model, write_tiny, Error, HubOptions, TinySpec};
use candle_core::DType;

#[test]
fn env_offline_uses_only_the_env_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models--org--cached");
    let snap = repo.join("snapshots").join("abc");
    write_tiny(&snap, &TinySpec::default(), 1, DType::F32).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), "abc\n").unwrap();
    std::env::set_var("HF_HUB_OFFLINE", "1");
    std::env::set_var("HF_HUB_CACHE", tmp.path());

    let r = resolve_model("org/cached", &HubOptions::default()).unwrap();
    assert_eq!(r.config, snap.join("config.json"));
    // Not cached: with HF_HUB_OFFLINE the hub is never asked, and the error says so.
    let e = resolve_model("org/other", &HubOptions::default()).unwrap_err();
    assert!(matches!(&e, Error::NotFound { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("HF_HUB_OFFLINE") && msg.contains("models--org--other"), "{msg}");
}
