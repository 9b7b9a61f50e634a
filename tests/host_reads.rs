//! Host synchronisations per training step: every read of a computed tensor back to the host goes through
//! `autosp_core::host_read`, which counts it, and each step's count is in the `--metrics` line (`host_reads`,
//! rank 0). With the device-generic kernels forced on the CPU (`AUTOSP_KERNELS=generic`, the kernels a GPU
//! runs), a step reads the same number of times whatever the number of layers (and so of parameters), under
//! each strategy and sharding level: at most 3 (the loss door's one read of its targets' count, the loss, and
//! the gradient norm). On a GPU each read drains the device's queue, so a count that grew with the layers
//! would stall every layer.

mod longctx_cli;

use std::path::Path;

use autosp_models::{write_tiny, TinySpec};
use candle_core::DType;
use longctx_cli::{command, s};

/// Each step's `host_reads` from a `--metrics` file.
fn reads(metrics: &Path) -> Vec<u64> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("host_reads")?.as_u64())
        .collect()
}

#[test]
fn a_step_reads_a_constant_few_times_whatever_the_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let runs: [&[&str]; 4] = [
        &["--sp", "1"],
        &["--sp", "2", "--strategy", "ulysses"],
        &["--sp", "2", "--strategy", "ring", "--checkpoint", "full"],
        &["--sp", "2", "--strategy", "ulysses", "--shard", "parameters"],
    ];
    for layers in [1, 3] {
        let model = t.join(format!("model{layers}"));
        write_tiny(&model, &TinySpec { layers, ..TinySpec::default() }, 5, DType::F32).unwrap();
    }
    for run in runs {
        let mut counts = Vec::new();
        for layers in [1, 3] {
            let m = t.join(format!("m{layers}-{}.jsonl", run.join("")));
            let model = t.join(format!("model{layers}"));
            let base = ["--model", s(&model), "--data", "passkey", "--seq-len", "128", "--steps", "3", "--warmup", "1"];
            let save = t.join("save");
            let args = [&base[..], run, &["--save", s(&save), "--metrics", s(&m)]].concat();
            let out = command(t, &args).env("AUTOSP_KERNELS", "generic").output().unwrap();
            assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
            counts.push(reads(&m));
        }
        eprintln!("{run:?}: host reads per step with 1 and 3 layers: {counts:?}");
        assert_eq!(counts[0].len(), 3);
        assert_eq!(counts[0], counts[1], "{run:?}: the reads per step must not grow with the layers");
        assert!(counts[0].iter().all(|&c| c <= 3), "{run:?}: {:?} reads per step (at most 3)", counts[0]);
    }
}
