//! The harness of the `llama_longctx` command-line tests (`tests/llama_longctx*.rs`): the example binary (built
//! by `cargo test`, refused when older than its sources), run offline with a private cache, and readers of
//! what it writes (metrics, tensors, directory snapshots).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{Device, Tensor};

/// `target/<profile>/examples/llama_longctx`, next to this test's `deps/` directory.
pub fn binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let bin = dir.join("examples").join(format!("llama_longctx{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.is_file(), "{} is missing: `cargo test` builds the examples", bin.display());
    // `cargo test --test llama_longctx` alone does not rebuild examples: refuse to test a stale binary (the
    // command line, and the trainer it runs).
    let built = std::fs::metadata(&bin).unwrap().modified().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut dirs = vec![root.join("examples").join("llama_longctx"), root.join("src").join("train")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
                continue;
            }
            let changed = std::fs::metadata(&p).unwrap().modified().unwrap();
            assert!(
                changed <= built,
                "{} is newer than {}: run `cargo build --release --example llama_longctx` (or `cargo test -p autosp`)",
                p.display(),
                bin.display()
            );
        }
    }
    bin
}

/// The binary with a private cache under `tmp`, offline.
pub fn command(tmp: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(binary());
    c.args(args).arg("--no-progress").env("AUTOSP_CACHE", tmp.join("cache")).env("HF_HUB_OFFLINE", "1");
    c
}

pub fn run(tmp: &Path, args: &[&str]) -> Output {
    command(tmp, args).output().unwrap()
}

pub fn run_ok(tmp: &Path, args: &[&str]) -> String {
    let out = run(tmp, args);
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "llama_longctx {args:?} failed: {}\nstdout:\n{so}\nstderr:\n{se}", out.status);
    so.to_string()
}

/// A failing run's stderr (asserting that it failed).
pub fn run_err(tmp: &Path, args: &[&str]) -> String {
    let out = run(tmp, args);
    assert!(
        !out.status.success(),
        "llama_longctx {args:?} should have failed:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).to_string()
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The `--metrics` file's training losses, in step order (its held-out and summary lines left out).
pub fn losses(metrics: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((v["step"].as_u64()?, v.get("loss")?.as_f64().unwrap()))
        })
        .collect()
}

/// The `--metrics` file's summary object (its last line).
pub fn metrics_summary(metrics: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(metrics).unwrap();
    let last = text.lines().last().unwrap_or_else(|| panic!("{} is empty", metrics.display()));
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert!(v["summary"].is_object(), "the last --metrics line is not the summary: {last}");
    v["summary"].clone()
}

pub fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// Every file of a directory tree with its bytes (to show nothing changed).
pub fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    if dir.is_dir() {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(snapshot(&p));
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// The mean token loss `--eval-tokens` prints (its JSON line) for `args`.
pub fn eval_loss(tmp: &Path, args: &[&str]) -> f64 {
    let out = run_ok(tmp, args);
    let line = out.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON line:\n{out}"));
    serde_json::from_str::<serde_json::Value>(line).unwrap()["eval_loss"].as_f64().unwrap()
}

/// 301 token ids below 128, written as one line to `tmp/ids.txt` (an `--eval-tokens` file).
pub fn ids_file(tmp: &Path) -> PathBuf {
    let ids: Vec<String> = (0..301u32).map(|i| ((i * 37 + 11) % 128).to_string()).collect();
    let f = tmp.join("ids.txt");
    std::fs::write(&f, ids.join(" ")).unwrap();
    f
}

/// `(max |a - b|, max |a|)` of two f32 tensors of one shape (the difference relative to `a`'s largest element
/// is the first over the second).
pub fn max_diff(a: &Tensor, b: &Tensor) -> (f32, f32) {
    let scale = a.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-12);
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    (d, scale)
}
