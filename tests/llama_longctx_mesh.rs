//! `llama_longctx` on a data × sequence mesh with sharded model states (thread ranks; the same runs under
//! `mpirun -np 4` are in `.ci/run`): a 2 × 2 mesh at every `--shard` level trains like one rank on the same
//! whole batch (the loss of each step, every gradient of the first, the parameters after 3 AdamW steps), and
//! the `parameters`-sharded checkpoint is the HF layout that loads and scores like the one-rank run's; a
//! sharded checkpoint resumes bit for bit on its mesh, is refused on another world size or unsharded, names a
//! damaged rank file; a whole checkpoint resumes into a sharded run.

mod longctx_cli;

use std::path::Path;

use candle_core::Tensor;
use longctx_cli::{losses, run_err, run_ok, s, tensors};

/// The largest difference between same-named tensors of two safetensors files, relative to each tensor's
/// largest magnitude in `a` (the worst tensor's name with it).
fn worst_relative(a: &Path, b: &Path) -> (String, f32) {
    let (a, b) = (tensors(a), tensors(b));
    assert_eq!(a.len(), b.len(), "the files hold different tensors");
    let mut worst = (String::new(), 0f32);
    for (name, x) in &a {
        let y: &Tensor = &b[name];
        let scale = x.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-12);
        let d = (x - y).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() / scale;
        if d >= worst.1 {
            worst = (name.clone(), d);
        }
    }
    worst
}

/// `--eval-tokens` of a checkpoint's model on `ids` (a token-id file), on one rank.
fn eval_loss(t: &Path, model: &Path, ids: &Path) -> f64 {
    let out = run_ok(t, &["--model", s(model), "--eval-tokens", s(ids), "--sp", "1"]);
    let line = out.lines().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no JSON line:\n{out}"));
    serde_json::from_str::<serde_json::Value>(line).unwrap()["eval_loss"].as_f64().unwrap()
}

/// One rank training 2 sequences per step (two micro-batches: the token-weighted mean is the global token
/// mean) against D × S = 2 × 2 (and 2 × 1 at `parameters`), where each replica trains one of the two: the
/// same sequences in the same order. f32 throughout; the mesh sums the same terms in another order (the
/// loss's token sums over 4 ranks, Ring's partial softmaxes at P = 2, gradients reduced over the world), so:
/// losses to 1e-6 relative (measured 5e-8), the first step's gradients to 1e-5 of each tensor's scale
/// (DESIGN.md's Ring tolerance 1e-5 · P at P = 2 is 2e-5; measured 1.1e-6), the parameters after 3 AdamW
/// steps to 1e-4 of each tensor's scale (AdamW's m / sqrt(v) turns a 1e-6 gradient difference of a
/// near-zero element into a step-sized one; measured 3.2e-5). A mesh that dropped a replica's rows or
/// failed to reduce a slice is off by O(1) (the reference and its own gradients differ by 1.6 of scale).
#[test]
fn a_2x2_mesh_at_every_shard_level_trains_like_one_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let quick = ["--quick", "--steps", "3"];
    let train = |name: &str, mesh: &[&str]| {
        let (save, metrics, grads) =
            (t.join(name), t.join(format!("{name}.jsonl")), t.join(format!("{name}.grads.safetensors")));
        let out = run_ok(
            t,
            &[&quick[..], mesh, &["--save", s(&save), "--metrics", s(&metrics), "--dump-grads", s(&grads)]].concat(),
        );
        (out, save.join("step-3"), losses(&metrics), grads)
    };
    let (_, ref_dir, ref_losses, ref_grads) = train("one", &["--sp", "1", "--batch-tokens", "1024"]);
    assert_eq!(ref_losses.len(), 3);
    let mut runs = vec![];
    for level in ["none", "optimizer", "gradients", "parameters"] {
        runs.push((format!("2x2-{level}"), vec!["--dp", "2", "--sp", "2", "--shard", level]));
    }
    runs.push(("2x1-parameters".into(), vec!["--dp", "2", "--sp", "1", "--shard", "parameters"]));
    for (name, mesh) in &runs {
        let (out, dir, l, grads) = train(name, mesh);
        assert!(out.contains("data-parallel replicas") && out.contains("2 sequence(s) per step"), "{name}: {out}");
        let level = mesh[5];
        assert!(out.contains(&format!("model states (--shard {level}: asked for")), "{name}: {out}");
        // At `parameters` the ranks build the model in turn, each keeping only its slices.
        assert_eq!(out.contains("built sharded"), level == "parameters", "{name}: {out}");
        for ((step, a), (_, b)) in ref_losses.iter().zip(&l) {
            assert!((a - b).abs() <= 1e-6 * a.abs(), "{name} step {step}: loss {b} vs one rank's {a}");
        }
        let (worst, d) = worst_relative(&ref_grads, &grads);
        assert!(d <= 1e-5, "{name}: gradient of {worst} differs by {d:.2e} of its scale from one rank's");
        let (worst, d) = worst_relative(&ref_dir.join("model.safetensors"), &dir.join("model.safetensors"));
        assert!(d <= 1e-4, "{name}: after 3 steps {worst} differs by {d:.2e} of its scale from one rank's");
        let files: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        if level == "none" {
            assert!(files.contains(&"optimizer.safetensors".to_string()), "{name}: {files:?}");
        } else {
            let ranks = if name.starts_with("2x2") { 4 } else { 2 };
            for r in 0..ranks {
                let f = format!("optimizer-rank-{r:05}-of-{ranks:05}.safetensors");
                assert!(files.contains(&f), "{name}: no {f} in {files:?}");
            }
            assert!(!files.contains(&"optimizer.safetensors".to_string()), "{name}: {files:?}");
        }
    }

    // The parameters-sharded checkpoint is the HF layout: it loads as a model and scores a sequence as the
    // one-rank run's checkpoint does (the weights agree to 1e-4 of scale, above; the loss to 1e-4 relative).
    let ids: Vec<String> = (0..301u32).map(|i| ((i * 37 + 11) % 128).to_string()).collect();
    let f = t.join("ids.txt");
    std::fs::write(&f, ids.join(" ")).unwrap();
    let (one, sharded) = (eval_loss(t, &ref_dir, &f), eval_loss(t, &t.join("2x2-parameters").join("step-3"), &f));
    assert!((one - sharded).abs() <= 1e-4 * one.abs(), "the sharded checkpoint scores {sharded}, one rank's {one}");
}

/// A `parameters`-sharded 2 × 2 run saved at step 2 and resumed on the same mesh continues bit for bit (losses,
/// the model and every rank's optimizer file at step 4); at `optimizer` (the same slices) it continues within
/// f32 rounding; on another world size (2 x 1) and unsharded within 1e-5. A damaged rank file is refused,
/// naming it, and writes nothing. A whole checkpoint (`--shard none`) resumes into a sharded run.
#[test]
fn a_sharded_checkpoint_resumes_exactly_on_its_mesh_and_on_others() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let mesh = |shard: &'static str| ["--quick", "--steps", "4", "--dp", "2", "--sp", "2", "--shard", shard];
    let (a, ma) = (t.join("a"), t.join("a.jsonl"));
    run_ok(t, &[&mesh("parameters")[..], &["--save-every", "2", "--save", s(&a), "--metrics", s(&ma)]].concat());
    let ckpt = a.join("step-2");
    let (b, mb) = (t.join("b"), t.join("b.jsonl"));
    let out =
        run_ok(t, &[&mesh("parameters")[..], &["--resume", s(&ckpt), "--save", s(&b), "--metrics", s(&mb)]].concat());
    assert!(out.contains("resumed from"), "{out}");
    let (la, lb) = (losses(&ma), losses(&mb));
    assert_eq!(la[2..], lb[..], "the resumed steps' losses must be bit-identical");
    let mut files = vec!["model.safetensors".to_string()];
    files.extend((0..4).map(|r| format!("optimizer-rank-{r:05}-of-00004.safetensors")));
    for f in &files {
        let (x, y) =
            (std::fs::read(a.join("step-4").join(f)).unwrap(), std::fs::read(b.join("step-4").join(f)).unwrap());
        assert!(x == y, "{f} after 4 steps differs from 2 steps + resume + 2 steps");
    }

    // The same slices at another level: the state is restored exactly; the steps sum in another order.
    let (c, mc) = (t.join("c"), t.join("c.jsonl"));
    run_ok(t, &[&mesh("optimizer")[..], &["--resume", s(&ckpt), "--save", s(&c), "--metrics", s(&mc)]].concat());
    for ((step, x), (_, y)) in la[2..].iter().zip(&losses(&mc)) {
        assert!((x - y).abs() <= 1e-6 * x.abs(), "step {step} resumed at `optimizer`: {y} vs {x}");
    }

    // Another world size (2 x 1) and an unsharded run resume it too, each rank reading its own elements.
    for (name, shard, sp) in [("e", "parameters", "1"), ("f", "none", "2")] {
        let (e, me) = (t.join(name), t.join(format!("{name}.jsonl")));
        let args = ["--quick", "--steps", "4", "--dp", "2", "--sp", sp, "--shard", shard, "--resume", s(&ckpt)];
        run_ok(t, &[&args[..], &["--save", s(&e), "--metrics", s(&me)]].concat());
        for ((step, x), (_, y)) in la[2..].iter().zip(&losses(&me)) {
            assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step} resumed on --sp {sp} --shard {shard}: {y} vs {x}");
        }
    }
    // Refused: a damaged rank file. Nothing is written.
    let x = t.join("x");
    let rank2 = ckpt.join("optimizer-rank-00002-of-00004.safetensors");
    let mut bytes = std::fs::read(&rank2).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x11;
    std::fs::write(&rank2, &bytes).unwrap();
    let e = run_err(t, &[&mesh("parameters")[..], &["--resume", s(&ckpt), "--save", s(&x)]].concat());
    assert!(e.contains("damaged") && e.contains("optimizer-rank-00002-of-00004.safetensors"), "{e}");
    assert!(!x.exists(), "a refused resume must not create its save directory");

    // A whole checkpoint resumes into a sharded run: each rank takes its slices.
    let (w, mw) = (t.join("w"), t.join("w.jsonl"));
    run_ok(t, &[&mesh("none")[..], &["--save-every", "2", "--save", s(&w), "--metrics", s(&mw)]].concat());
    let (v, mv) = (t.join("v"), t.join("v.jsonl"));
    run_ok(
        t,
        &[&mesh("parameters")[..], &["--resume", s(&w.join("step-2")), "--save", s(&v), "--metrics", s(&mv)]].concat(),
    );
    for ((step, x), (_, y)) in losses(&mw)[2..].iter().zip(&losses(&mv)) {
        assert!((x - y).abs() <= 1e-6 * x.abs(), "step {step}, whole checkpoint resumed sharded: {y} vs {x}");
    }
}
