//! `llama_longctx --lora`: only the adapters (and what `--lora-train` names) get gradients and optimizer state;
//! checkpoints hold the adapter in PEFT's layout and resume bit for bit; `--lora-adapter` loads one for
//! evaluation and `--merge-lora` writes a merged HF model with the same loss; the adapters' gradients agree
//! between one rank and two under every strategy, checkpoint policy and sharding level; bad LoRA options are
//! refused naming the fix. PEFT itself loads the adapter in `.ci/run` (scripts/eval_checkpoint.py).

mod longctx_cli;

use std::collections::HashMap;

use autosp_models::LlamaModel;
use candle_core::{DType, Tensor};
use longctx_cli::{eval_loss, ids_file, losses, max_diff, run_err, run_ok, s, tensors};

#[test]
fn lora_trains_the_adapters_saves_them_for_peft_and_resumes_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (a, b) = (t.join("a"), t.join("b"));
    let (ma, mb) = (t.join("a.jsonl"), t.join("b.jsonl"));
    let lora = ["--lora", "4:8", "--lora-train", "norm", "--lora-dropout", "0.1"];
    let args = |extra: &[&str]| -> Vec<String> {
        ["--quick", "--steps", "4"].iter().chain(&lora).chain(extra).map(|x| x.to_string()).collect()
    };
    let run = |extra: &[&str]| {
        let v = args(extra);
        run_ok(t, &v.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let out = run(&["--save-every", "2", "--save", s(&a), "--metrics", s(&ma)]);
    assert!(out.contains("LoRA: rank 4, alpha 8, dropout 0.1") && out.contains("the base is frozen"), "{out}");
    let step = a.join("step-4");
    for f in ["adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "trainer_state.json"] {
        assert!(step.join(f).is_file(), "{f} missing");
    }
    assert!(!step.join("model.safetensors").exists(), "a LoRA checkpoint holds the adapter, not the model");
    let adapter = tensors(&step.join("adapter_model.safetensors"));
    // 7 projections x 2 layers x (A, B), plus 2 x 2 layer norms and the final norm.
    assert_eq!(adapter.len(), 7 * 2 * 2 + 2 * 2 + 1, "{:?}", adapter.keys());
    let a0 = &adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
    assert_eq!(a0.dims(), [4, 64]);
    let b0 = &adapter["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"];
    let moved = b0.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(moved > 0.0, "B starts at zero and must have trained");
    // The optimizer holds the adapters' and norms' state only.
    let opt = tensors(&step.join("optimizer.safetensors"));
    assert!(opt.keys().all(|k| k.contains("lora_") || k.contains("norm")), "{:?}", opt.keys());
    // Resume from step 2: the same losses and the same adapter, bit for bit (the dropout masks included).
    let out = run(&["--resume", s(&a.join("step-2")), "--save", s(&b), "--metrics", s(&mb)]);
    assert!(out.contains("resumed from"), "{out}");
    let (la, lb) = (losses(&ma), losses(&mb));
    assert_eq!(la[2..], lb[..], "the resumed steps' losses must be bit-identical");
    let (x, y) =
        (tensors(&step.join("adapter_model.safetensors")), tensors(&b.join("step-4/adapter_model.safetensors")));
    for (name, t1) in &x {
        let d = (t1 - &y[name]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(d, 0.0, "{name} differs after resuming");
    }
    // A resume asking for other LoRA settings is refused (the same ones, or none, resume).
    let err = run_err(t, &["--quick", "--steps", "6", "--resume", s(&step), "--lora", "8", "--save", s(&b)]);
    assert!(err.contains("the LoRA options ask for rank 8") && err.contains("is rank 4, alpha 8"), "{err}");
}

#[test]
fn an_adapter_loads_for_evaluation_and_merges_into_a_model_with_the_same_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (run_dir, merged) = (t.join("run"), t.join("merged"));
    run_ok(
        t,
        &["--quick", "--lora", "2", "--lora-targets", "q,v,up", "--save", s(&run_dir), "--merge-lora", s(&merged)],
    );
    let base = std::fs::read_dir(t.join("cache")).unwrap().map(|e| e.unwrap().path()).find(|p| p.is_dir()).unwrap();
    let ids = ids_file(t);
    let adapter = run_dir.join("step-12");
    let with_adapter = eval_loss(t, &["--model", s(&base), "--lora-adapter", s(&adapter), "--eval-tokens", s(&ids)]);
    // The adapter names its base: --model may be left out.
    let named = eval_loss(t, &["--lora-adapter", s(&adapter), "--eval-tokens", s(&ids), "--sp", "1"]);
    let merged_loss = eval_loss(t, &["--model", s(&merged), "--eval-tokens", s(&ids)]);
    let base_loss = eval_loss(t, &["--model", s(&base), "--eval-tokens", s(&ids)]);
    // f32 throughout; the merged weights round W + s·B·A once, the adapter path adds the two products.
    assert!((with_adapter - merged_loss).abs() <= 1e-5 * with_adapter, "{with_adapter} vs merged {merged_loss}");
    assert!((with_adapter - named).abs() <= 2e-5 * with_adapter, "sp 2 vs sp 1: {with_adapter} vs {named}");
    assert!(with_adapter != base_loss, "the adapter changes the model");
    // The merged model is an ordinary HF checkpoint.
    let m = LlamaModel::load(s(&merged), DType::F32).unwrap();
    assert!(m.lora_config().is_none());
    // Merging alone (--steps 0) writes the same weights, training nothing.
    let alone = t.join("merged-alone");
    let out = run_ok(t, &["--lora-adapter", s(&adapter), "--steps", "0", "--merge-lora", s(&alone)]);
    assert!(out.contains("merged") && !out.contains("step "), "{out}");
    let (a, b) = (tensors(&merged.join("model.safetensors")), tensors(&alone.join("model.safetensors")));
    assert_eq!(a.len(), b.len());
    for (name, x) in &a {
        let d = (x - &b[name]).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(d, 0.0, "{name}");
    }
}

/// The adapters' gradients of the first step (`--dump-grads`) on 2 ranks (4 for Hybrid) against 1 rank, under
/// every strategy, policy and sharding level, with the norms and the embedding training too. Tolerance:
/// DESIGN.md's 1e-5 · P relative to each tensor's largest element (partial softmaxes merged in another order),
/// at P = 4.
#[test]
fn lora_gradients_agree_between_one_rank_and_several_on_every_strategy_policy_and_shard_level() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let dump = |tag: &str, extra: &[&str]| -> HashMap<String, Tensor> {
        let g = t.join(format!("{tag}.safetensors"));
        let mut args =
            vec!["--quick", "--steps", "1", "--lora", "4", "--lora-train", "norm,embed", "--dump-grads", s(&g)];
        let save = t.join(tag);
        args.extend(["--save", s(&save)]);
        args.extend(extra);
        run_ok(t, &args);
        tensors(&g)
    };
    let one = dump("one", &["--sp", "1", "--checkpoint", "none"]);
    assert_eq!(one.len(), 7 * 2 * 2 + 2 * 2 + 1 + 1, "adapters, norms and the embedding: {:?}", one.keys());
    let cases: &[&[&str]] = &[
        &["--strategy", "ulysses", "--checkpoint", "full"],
        &["--strategy", "ring", "--checkpoint", "sequence-aware"],
        &["--strategy", "ring", "--checkpoint", "none", "--shard", "optimizer"],
        &["--strategy", "ulysses", "--shard", "gradients"],
        &["--strategy", "ring", "--shard", "parameters"],
    ];
    // Hybrid needs 4 ranks: Ulysses over 2 of them inside Ring over 2 (the tolerance then 1e-5 · 4).
    let hybrid: &[&str] = &["--sp", "4", "--strategy", "hybrid:2", "--checkpoint", "sequence-aware"];
    for (i, case) in cases.iter().chain([&hybrid]).enumerate() {
        let mut args = if case.contains(&"--sp") { vec![] } else { vec!["--sp", "2"] };
        args.extend(case.iter());
        let two = dump(&format!("two{i}"), &args);
        assert_eq!(one.len(), two.len(), "{case:?}");
        for (name, a) in &one {
            let (d, scale) = max_diff(a, &two[name]);
            assert!(d <= 4e-5 * scale, "{case:?} {name}: 1 rank vs several differ by {d} (max {scale})");
        }
    }
}

#[test]
fn bad_lora_options_are_refused_naming_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let save = t.join("never");
    let cases: &[(&[&str], &str)] = &[
        (&["--lora", "0"], "the rank must be at least 1"),
        (&["--lora", "4:x"], "alpha is not a number"),
        (&["--lora", "4", "--lora-targets", "q,qkv"], "choose from q, k, v, o, gate, up, down"),
        (&["--lora", "4", "--lora-train", "head"], "choose from embed, norm"),
        (&["--lora", "4", "--lora-dropout", "1.5"], "outside [0, 1)"),
        (&["--lora-targets", "q"], "give --lora R"),
        (&["--merge-lora", "x"], "give --lora R or --lora-adapter DIR"),
        (&["--lora-adapter", "/nonexistent/adapter"], "adapter_config.json"),
    ];
    for (args, want) in cases {
        let mut v = vec!["--quick", "--save", s(&save)];
        v.extend(args.iter());
        let err = run_err(t, &v);
        assert!(err.contains(want), "{args:?}: expected `{want}` in:\n{err}");
    }
    assert!(!save.exists(), "a refused run writes nothing");
}
