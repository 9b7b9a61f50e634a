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

/// The files of the training path a GPU runs (the generic kernels and their doors, the ops, the optimizers,
/// the tape, the compiled step, the trainer, the model), where a raw read of a tensor back to the host
/// (`to_scalar`, `to_vec0..3`, `to_device(&Device::Cpu)`) is allowed only on host data, said so in a `host data`
/// comment on its line or the line before; every other read goes through `autosp_core::host_read`, which counts
/// it. The CPU kernels (`cpu.rs`, `host.rs`, `vector/`) read CPU storage by design and are left out, as are the
/// collectives' transports (NCCL counts its header copy; MPI carries device tensors through the host by design)
/// and the test modules.
#[test]
fn no_uncounted_host_reads_on_the_training_path() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dirs = [
        "autosp-kernels/src",
        "autosp-core/src/ops",
        "autosp-core/src/optim",
        "autosp-core/src/nn",
        "autosp-models/src/llama",
        "src/compile",
    ];
    let files =
        ["autosp-core/src/tape.rs", "autosp-core/src/backward.rs", "autosp-core/src/lora.rs", "src/train/trainer.rs"];
    let mut paths: Vec<std::path::PathBuf> = files.iter().map(|f| root.join(f)).collect();
    for d in dirs {
        let mut stack = vec![root.join(d)];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                let name = p.file_name().unwrap().to_string_lossy().to_string();
                if p.is_dir() {
                    if name != "vector" {
                        stack.push(p);
                    }
                } else if name.ends_with(".rs") && !["cpu.rs", "host.rs", "generate.rs"].contains(&name.as_str()) {
                    paths.push(p);
                }
            }
        }
    }
    let raw = ["to_scalar", "to_vec0", "to_vec1", "to_vec2", "to_vec3", "to_device(&Device::Cpu)"];
    let mut found = Vec::new();
    for p in &paths {
        let text = std::fs::read_to_string(p).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        let lines: Vec<&str> = code.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let said = line.contains("host data") || (i > 0 && lines[i - 1].contains("host data"));
            if raw.iter().any(|r| line.contains(r)) && !line.trim_start().starts_with("//") && !said {
                found.push(format!("{}:{}: {}", p.strip_prefix(root).unwrap().display(), i + 1, line.trim()));
            }
        }
    }
    assert!(paths.len() > 40, "the scan must see the training path's files ({} found)", paths.len());
    assert!(found.is_empty(), "uncounted host reads (use autosp_core::host_read):\n{}", found.join("\n"));
}
