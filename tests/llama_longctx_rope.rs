//! `llama_longctx --rope-scaling`: a run extends a checkpoint's context window and every checkpoint it writes
//! says so in its config.json (`rope_type`, `factor`, `original_max_position_embeddings`, an explicit
//! `rope_theta`, `max_position_embeddings` = original × factor), which loads back with the positions trained
//! (transformers' loss on it is checked against ours in `.ci/run`); a sequence past the window with no scaling
//! is warned about; bad specs are refused naming the option.

mod longctx_cli;

use std::path::{Path, PathBuf};

use autosp_models::{write_tiny, LlamaConfig, TinySpec};
use candle_core::DType;
use longctx_cli::{eval_loss, ids_file, losses, run_err, run_ok, s};

/// A tiny random Llama with a window of 64 tokens (`max_position_embeddings`) in `tmp/base`.
fn tiny_with_window_64(tmp: &Path) -> PathBuf {
    let dir = tmp.join("base");
    write_tiny(&dir, &TinySpec::default(), 3, DType::F32).unwrap();
    let mut config = LlamaConfig::from_file(dir.join("config.json")).unwrap();
    config.max_position_embeddings = 64;
    std::fs::write(dir.join("config.json"), config.to_json()).unwrap();
    dir
}

fn config_json(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn yarn_4_is_trained_with_and_written_into_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let base = tiny_with_window_64(t);
    let save = t.join("run");
    let args = ["--model", s(&base), "--seq-len", "256", "--steps", "2", "--warmup", "1", "--save", s(&save)];
    let out = run_ok(t, &[&args[..], &["--rope-scaling", "yarn:4"]].concat());
    assert!(
        out.contains("RoPE: yarn x4 from a window of 64 -> 256 tokens (--rope-scaling yarn:4)")
            && !out.contains("RoPE scaling yarn by 4"),
        "{out}"
    );
    let c = config_json(&save.join("step-2"));
    let r = &c["rope_scaling"];
    assert_eq!(r["rope_type"], "yarn", "{c}");
    assert_eq!(r["factor"].as_f64(), Some(4.0), "{c}");
    assert_eq!(r["original_max_position_embeddings"].as_u64(), Some(64), "{c}");
    assert_eq!(c["rope_theta"].as_f64(), Some(10000.0), "{c}");
    assert_eq!(c["max_position_embeddings"].as_u64(), Some(256), "{c}");

    // The saved model scores with the positions it trained with: its loss is the run's model's loss, which
    // the scaling changes (the 301 ids run past the window of 64).
    let ids = ids_file(t);
    let step = save.join("step-2");
    let saved = eval_loss(t, &["--model", s(&step), "--eval-tokens", s(&ids), "--sp", "1"]);
    let unscaled = eval_loss(t, &["--model", s(&base), "--eval-tokens", s(&ids), "--sp", "1"]);
    let scaled =
        eval_loss(t, &["--model", s(&base), "--eval-tokens", s(&ids), "--sp", "1", "--rope-scaling", "yarn:4"]);
    assert!((scaled - unscaled).abs() > 1e-3 * unscaled, "yarn:4 must change the loss: {scaled} vs {unscaled}");
    assert!(saved.is_finite() && (saved - scaled).abs() > 0.0, "the saved model trained: {saved} vs {scaled}");
    // Sequence parallel, the same positions.
    let two = eval_loss(t, &["--model", s(&step), "--eval-tokens", s(&ids), "--sp", "2"]);
    assert!((two - saved).abs() <= 1e-4 * saved, "--sp 2 {two} vs --sp 1 {saved}");
}

#[test]
fn a_sequence_past_the_window_without_a_scaling_is_warned_about() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let base = tiny_with_window_64(t);
    let (a, b) = (t.join("a"), t.join("b"));
    let args = ["--model", s(&base), "--seq-len", "256", "--steps", "1", "--warmup", "1"];
    let out = run_ok(t, &[&args[..], &["--save", s(&a)]].concat());
    assert!(
        out.contains("--seq-len 256 is past the model's window of 64 tokens") && out.contains("--rope-scaling yarn:4"),
        "{out}"
    );
    let out = run_ok(t, &[&args[..], &["--rope-scaling", "linear:2", "--save", s(&b)]].concat());
    assert!(!out.contains("past the model's window"), "{out}");
    let c = config_json(&t.join("b/step-1"));
    assert_eq!(
        (c["rope_scaling"]["rope_type"].as_str(), c["max_position_embeddings"].as_u64()),
        (Some("linear"), Some(128))
    );
}

#[test]
fn bad_specs_are_refused_naming_the_option() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let save = t.join("never");
    let e = run_err(t, &["--quick", "--rope-scaling", "ntk:2", "--save", s(&save)]);
    assert!(e.contains("--rope-scaling ntk:2: unknown type `ntk`") && e.contains("linear, dynamic, yarn"), "{e}");
    let e = run_err(t, &["--quick", "--rope-scaling", "yarn:1", "--save", s(&save)]);
    assert!(e.contains("--rope-scaling yarn:1: factor 1") && e.contains("a factor > 1 extends"), "{e}");
    let e = run_err(t, &["--quick", "--rope-scaling", "yarn:0.5", "--save", s(&save)]);
    assert!(e.contains("factor 0.5") && e.contains("`none` for no scaling"), "{e}");
    assert!(!save.exists(), "a refused run writes nothing");
}

#[test]
fn a_resumed_run_does_not_apply_the_extension_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let base = tiny_with_window_64(t);
    let (a, b, c) = (t.join("a"), t.join("b"), t.join("c"));
    let (ma, mb, mc) = (t.join("a.jsonl"), t.join("b.jsonl"), t.join("c.jsonl"));
    let args = ["--seq-len", "256", "--steps", "3", "--warmup", "1"];
    let run = |extra: &[&str]| run_ok(t, &[&args[..], extra].concat());
    run(&["--model", s(&base), "--rope-scaling", "yarn:4", "--save-every", "1", "--save", s(&a), "--metrics", s(&ma)]);
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(a.join("step-1/trainer_state.json")).unwrap()).unwrap();
    assert_eq!(state["rope_scaling"], "yarn:4");
    // The same option again, or none: the checkpoint's config holds yarn x4 already; the run goes on as the
    // uninterrupted one did, bit for bit, and saves x4, not x16.
    let step1 = a.join("step-1");
    let out = run(&["--resume", s(&step1), "--rope-scaling", "yarn:4", "--save", s(&b), "--metrics", s(&mb)]);
    assert!(!out.contains("RoPE: yarn x16"), "{out}");
    run(&["--resume", s(&step1), "--save", s(&c), "--metrics", s(&mc)]);
    for (dir, metrics) in [(&b, &mb), (&c, &mc)] {
        assert_eq!(losses(&ma)[1..], losses(metrics)[..], "{}", metrics.display());
        let cfg = config_json(&dir.join("step-3"));
        assert_eq!(
            (cfg["rope_scaling"]["factor"].as_f64(), cfg["max_position_embeddings"].as_u64()),
            (Some(4.0), Some(256))
        );
    }
    // Another extension is a change: refused without --allow-changes, applied on top of the checkpoint's with it.
    let d = t.join("d");
    let e = run_err(t, &[&args[..], &["--resume", s(&step1), "--rope-scaling", "yarn:2", "--save", s(&d)]].concat());
    assert!(e.contains("--rope-scaling yarn:4 -> yarn:2") && e.contains("--allow-changes"), "{e}");
    let out = run(&["--resume", s(&step1), "--rope-scaling", "yarn:2", "--allow-changes", "--save", s(&d)]);
    assert!(out.contains("RoPE: yarn x8 from a window of 64 -> 512 tokens (the checkpoint's yarn x4 times"), "{out}");
    assert_eq!(config_json(&d.join("step-3"))["rope_scaling"]["factor"].as_f64(), Some(8.0));
}

#[test]
fn a_lora_checkpoint_carries_the_extension_for_peft_resume_evaluation_and_merging() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let base = tiny_with_window_64(t);
    let (a, b, merged) = (t.join("a"), t.join("b"), t.join("merged"));
    let (ma, mb) = (t.join("a.jsonl"), t.join("b.jsonl"));
    let args = ["--seq-len", "256", "--steps", "3", "--warmup", "1"];
    let lora = ["--model", s(&base), "--lora", "4", "--lora-train", "norm", "--rope-scaling", "yarn:4"];
    let out = run_ok(
        t,
        &[&args[..], &lora, &["--save-every", "1", "--save", s(&a), "--metrics", s(&ma), "--merge-lora", s(&merged)]]
            .concat(),
    );
    let step3 = a.join("step-3");
    assert!(
        out.contains(&format!("config=AutoConfig.from_pretrained(\"{}/base_config.json\")", step3.display())),
        "{out}"
    );
    // Beside the adapter: the base's config with the run's scaling (not config.json, which would make
    // transformers take the directory for a whole model).
    assert!(!step3.join("config.json").exists());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(step3.join("base_config.json")).unwrap()).unwrap();
    assert_eq!(
        (cfg["rope_scaling"]["rope_type"].as_str(), cfg["max_position_embeddings"].as_u64()),
        (Some("yarn"), Some(256))
    );
    // The merged model has it in its config.json.
    let m = config_json(&merged);
    assert_eq!((m["rope_scaling"]["factor"].as_f64(), m["max_position_embeddings"].as_u64()), (Some(4.0), Some(256)));
    // Resumed without the option, the adapter's base gets the recorded scaling back: the same losses.
    run_ok(t, &[&args[..], &["--resume", s(&a.join("step-1")), "--save", s(&b), "--metrics", s(&mb)]].concat());
    assert_eq!(losses(&ma)[1..], losses(&mb)[..]);
    // --lora-adapter scores with it (the same loss with or without the option), as does the merged model.
    let ids = ids_file(t);
    let eval = ["--eval-tokens", s(&ids), "--sp", "1"];
    let adapter = eval_loss(t, &[&eval[..], &["--lora-adapter", s(&step3)]].concat());
    let asked = eval_loss(t, &[&eval[..], &["--lora-adapter", s(&step3), "--rope-scaling", "yarn:4"]].concat());
    let whole = eval_loss(t, &[&eval[..], &["--model", s(&merged)]].concat());
    assert_eq!(adapter, asked);
    assert!((whole - adapter).abs() <= 1e-5 * adapter, "merged {whole} vs adapter {adapter}");
    let unscaled = eval_loss(t, &[&eval[..], &["--lora-adapter", s(&step3), "--rope-scaling", "none"]].concat());
    assert!((unscaled - adapter).abs() > 1e-4 * adapter, "the scaling must matter: {unscaled} vs {adapter}");
}
