//! `llama_longctx --packing`: with `documents` a window's first step is the sum of its documents run one at a
//! time (each line of an `ids:` file a document; the loss and every gradient, at `--sp 2` against one rank);
//! `stream` is the document-blind step on the same window, bit for bit; held-out windows are scored with their
//! documents (a document split across windows at its continuing positions); text data packs by documents
//! unless told otherwise, resumes bit for bit and keeps its packing; a document whose positions pass the
//! model's window is warned about; `--packing` with the synthetic tasks is refused.

mod longctx_cli;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use autosp::train::data;
use autosp::{compile, Checkpointing, CompileConfig, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::ops::Documents;
use autosp_core::CheckpointPolicy;
use autosp_models::{write_tiny, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};
use longctx_cli::{losses, max_diff, run_err, run_ok, s, tensors};

/// Window length of the runs.
const SEQ: usize = 64;

/// A tiny random Llama (vocabulary 128) in `tmp/model`.
fn model(tmp: &Path) -> PathBuf {
    let dir = tmp.join("model");
    write_tiny(&dir, &TinySpec::default(), 11, DType::F32).unwrap();
    dir
}

/// An `ids:` file of documents of 20, 15, 40, 50 and 30 tokens, one per line: the first window of 64 holds the
/// first two whole and the first 29 tokens of the third, which goes on in the second window.
fn documents(tmp: &Path) -> (PathBuf, Vec<Vec<u32>>) {
    let docs: Vec<Vec<u32>> = [20u32, 15, 40, 50, 30]
        .iter()
        .enumerate()
        .map(|(d, &len)| (0..len).map(|i| (i * 37 + d as u32 * 11 + i * i % 7) % 128).collect())
        .collect();
    let text: String = docs.iter().map(|d| d.iter().map(u32::to_string).collect::<Vec<_>>().join(" ") + "\n").collect();
    let f = tmp.join("docs.txt");
    std::fs::write(&f, text).unwrap();
    (f, docs)
}

/// The first step's loss (from `--metrics`) and gradients (`--dump-grads`) of a one-step run with `extra`.
fn first_step(tmp: &Path, model: &Path, data: &str, name: &str, extra: &[&str]) -> (f64, HashMap<String, Tensor>) {
    let (g, m) = (tmp.join(format!("{name}.safetensors")), tmp.join(format!("{name}.jsonl")));
    let save = tmp.join(name);
    let args = ["--model", s(model), "--data", data, "--seq-len", "64", "--steps", "1", "--warmup", "1"];
    let run = ["--dump-grads", s(&g), "--metrics", s(&m), "--save", s(&save)];
    run_ok(tmp, &[&args[..], &run[..], extra].concat());
    (losses(&m)[0].1, tensors(&g))
}

/// One rank's training step on each of `seqs` alone (the model at `dir`, compiled on one rank): the loss and
/// the gradients (HF names) of their token-weighted mean, as one step on them packed with documents is.
fn one_at_a_time(dir: &Path, seqs: &[&[u32]]) -> (f64, HashMap<String, Tensor>) {
    let out = run_ranks(1, Duration::from_secs(120), |pg| {
        let model = LlamaModel::load(dir.to_str().unwrap(), DType::F32).unwrap();
        let c = compile(model, CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None)))
            .unwrap();
        let (mut loss, mut count) = (0f64, 0usize);
        let mut grads: HashMap<String, Tensor> = HashMap::new();
        for seq in seqs {
            let ids = Tensor::from_vec(seq.to_vec(), (1, seq.len()), &Device::Cpu).unwrap();
            let step = c.train_step(&ids, None).unwrap();
            loss += step.loss * step.valid_tokens as f64;
            count += step.valid_tokens;
            for p in c.params() {
                let g = (step.grads.get(&p).unwrap() * step.valid_tokens as f64).unwrap();
                let sum = match grads.remove(p.name()) {
                    Some(acc) => (acc + g).unwrap(),
                    None => g,
                };
                grads.insert(p.name().to_string(), sum);
            }
        }
        let grads = grads.into_iter().map(|(n, g)| (n, (g / count as f64).unwrap())).collect();
        (loss / count as f64, grads)
    });
    out.into_iter().next().unwrap().unwrap()
}

#[test]
fn a_packed_windows_first_step_is_the_sum_of_its_documents_one_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = model(t);
    let (f, docs) = documents(t);
    let data = format!("ids:{}", s(&f));
    let (loss, grads) = first_step(t, &model, &data, "documents", &["--packing", "documents", "--sp", "2"]);
    // The first window: documents 0 and 1 whole, the first 29 tokens of document 2 (all from position 0). At
    // P = 2 against one rank: DESIGN.md's Ring tolerance, 1e-5 * P.
    let (want, want_grads) = one_at_a_time(&model, &[&docs[0], &docs[1], &docs[2][..29]]);
    assert!((loss - want).abs() <= 2e-5 * want, "packed {loss} vs the documents one at a time {want}");
    assert_eq!(grads.len(), want_grads.len());
    for (name, g) in &want_grads {
        let (d, scale) = max_diff(g, &grads[name]);
        assert!(d <= 2e-5 * scale, "{name}: packed vs one at a time differ by {d} (max {scale})");
    }
    // Document-blind, the same window is another loss (the documents see each other).
    let (blind, _) = first_step(t, &model, &data, "blind", &["--packing", "stream", "--sp", "2"]);
    assert!((blind - loss).abs() > 1e-4 * loss, "stream {blind} vs documents {loss}");
}

#[test]
fn stream_packing_is_the_document_blind_step_bit_for_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = model(t);
    let (f, _) = documents(t);
    let data = format!("ids:{}", s(&f));
    // ids: files are packed document-blind unless asked: the default is `stream`.
    let (default_loss, default_grads) = first_step(t, &model, &data, "default", &["--sp", "1"]);
    let (loss, grads) = first_step(t, &model, &data, "stream", &["--packing", "stream", "--sp", "1"]);
    assert_eq!(loss.to_bits(), default_loss.to_bits());
    // The window is the file's first 64 ids, as `data::pack` cuts them, run as one sequence.
    let ids = data::read_ids(&f, 128).unwrap();
    let window = data::pack(&ids, SEQ, "docs").unwrap().remove(0);
    let out = run_ranks(1, Duration::from_secs(120), |pg| {
        let m = LlamaModel::load(model.to_str().unwrap(), DType::F32).unwrap();
        let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
        let c = compile(m, CompileConfig::new(pg, Strategy::Auto, policy)).unwrap();
        let step = c.train_step(&Tensor::from_vec(window.clone(), (1, SEQ), &Device::Cpu).unwrap(), None).unwrap();
        let g: HashMap<String, Vec<f32>> = c
            .params()
            .iter()
            .map(|p| (p.name().to_string(), step.grads.get(p).unwrap().flatten_all().unwrap().to_vec1().unwrap()))
            .collect();
        (step.loss, g)
    });
    let (want, want_grads) = out.into_iter().next().unwrap().unwrap();
    assert_eq!(loss.to_bits(), want.to_bits(), "--packing stream {loss} vs the window as one sequence {want}");
    for (name, g) in &want_grads {
        let got: Vec<f32> = grads[name].flatten_all().unwrap().to_vec1().unwrap();
        let same = got.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: --packing stream differs from the document-blind step");
        let d: Vec<f32> = default_grads[name].flatten_all().unwrap().to_vec1().unwrap();
        assert!(d.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: the default is not stream");
    }
}

/// A tiny model (vocabulary 400) with the chat fixture's tokenizer, for text data.
fn text_model(tmp: &Path) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let m = tmp.join("text-model");
    write_tiny(&m, &TinySpec { vocab: 400, ..TinySpec::default() }, 5, DType::F32).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(f), m.join(f)).unwrap();
    }
    m
}

#[test]
fn text_data_packs_by_documents_and_a_resume_keeps_the_packing() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = text_model(t);
    let data = t.join("d.jsonl");
    let line = |i: usize| format!("{{\"text\": \"{}\"}}\n", "the cat sat on the mat and looked ".repeat(1 + i % 4));
    std::fs::write(&data, (0..24).map(line).collect::<String>()).unwrap();
    let (a, b, ma, mb) = (t.join("a"), t.join("b"), t.join("a.jsonl"), t.join("b.jsonl"));
    let args = ["--model", s(&model), "--data", s(&data), "--seq-len", "64", "--warmup", "1", "--lr", "1e-2"];
    let args = [&args[..], &["--steps", "4", "--sp", "2"]].concat();
    let out = run_ok(t, &[&args[..], &["--save-every", "2", "--save", s(&a), "--metrics", s(&ma)]].concat());
    assert!(out.contains("packing: documents (each token attends only to its own document"), "{out}");
    // The cache keeps where the documents start beside the tokens.
    let names: Vec<String> =
        std::fs::read_dir(t).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
    assert!(names.iter().any(|n| n.starts_with(".d.jsonl.autosp-") && n.ends_with(".starts")), "{names:?}");
    // 2 steps + resume + 2 steps train on the windows, with their documents, of 4 steps in one go.
    let step2 = a.join("step-2");
    let resume = [&args[..], &["--resume", s(&step2)]].concat();
    run_ok(t, &[&resume[..], &["--save", s(&b), "--metrics", s(&mb)]].concat());
    let (la, lb) = (losses(&ma), losses(&mb));
    assert_eq!(la[2..], lb[..], "the resumed steps' losses must be bit-identical");
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let (x, y) = (std::fs::read(a.join("step-4").join(f)).unwrap(), std::fs::read(b.join("step-4").join(f)));
        assert!(x == y.unwrap(), "{f} after 4 steps differs from 2 steps + resume + 2 steps");
    }
    // Resuming with the other packing changes the run: refused unless allowed.
    let e = run_err(t, &[&resume[..], &["--packing", "stream"]].concat());
    assert!(e.contains("--packing documents -> stream") && e.contains("--allow-changes"), "{e}");
    let c = t.join("c");
    let out = run_ok(t, &[&resume[..], &["--packing", "stream", "--allow-changes", "--save", s(&c)]].concat());
    assert!(out.contains("packing: stream (document-blind"), "{out}");
}

#[test]
fn packing_is_refused_with_the_synthetic_tasks_and_misspelt() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let e = run_err(t, &["--quick", "--data", "passkey", "--packing", "documents"]);
    assert!(e.contains("--packing documents") && e.contains("--data passkey is synthetic"), "{e}");
    let e = run_err(t, &["--quick", "--packing", "stream"]);
    assert!(e.contains("--data needles is synthetic"), "{e}");
    let e = run_err(t, &["--quick", "--packing", "neat"]);
    assert!(e.contains("`neat` is not a packing: use documents"), "{e}");
}

#[test]
fn a_document_whose_positions_pass_the_models_window_is_warned_about() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = model(t);
    let mut config = autosp_models::LlamaConfig::from_file(model.join("config.json")).unwrap();
    config.max_position_embeddings = 100;
    std::fs::write(model.join("config.json"), config.to_json()).unwrap();
    let (f, _) = documents(t);
    let data = format!("ids:{}", s(&f));
    let args = ["--model", s(&model), "--data", &data, "--seq-len", "64", "--steps", "1", "--packing", "documents"];
    // The longest line has 50 tokens: within the window of 100.
    let out = run_ok(t, &[&args[..], &["--save", s(&t.join("a"))]].concat());
    assert!(out.contains("the longest document spans 50 positions") && !out.contains("warning: --packing"), "{out}");
    // One line of 155 tokens: a document split over the two windows of 64, its positions going on to 128.
    let text = std::fs::read_to_string(&f).unwrap().replace('\n', " ");
    std::fs::write(&f, text).unwrap();
    let out = run_ok(t, &[&args[..], &["--save", s(&t.join("b"))]].concat());
    assert!(out.contains("warning: --packing documents: the longest document spans 128 positions"), "{out}");
}

#[test]
fn held_out_windows_are_scored_with_their_documents() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = model(t);
    let (f, docs) = documents(t);
    let data = format!("ids:{}", s(&f));
    let m = t.join("m.jsonl");
    let args = ["--model", s(&model), "--data", &data, "--eval-data", &data, "--seq-len", "64", "--steps", "0"];
    run_ok(
        t,
        &[&args[..], &["--packing", "documents", "--sp", "2", "--metrics", s(&m), "--save", s(&t.join("r"))]].concat(),
    );
    let text = std::fs::read_to_string(&m).unwrap();
    let line = text.lines().find(|l| l.contains("eval_loss")).unwrap_or_else(|| panic!("{text}"));
    let got = serde_json::from_str::<serde_json::Value>(line).unwrap()["eval_loss"].as_f64().unwrap();
    // The 155 ids in windows of 64, 64 and 27, each piece of a document alone at its positions: the third
    // document goes on in the second window from position 29, the fifth in the third from position 3.
    let pieces: Vec<(&[u32], usize)> = vec![
        (&docs[0], 0),
        (&docs[1], 0),
        (&docs[2][..29], 0),
        (&docs[2][29..], 29),
        (&docs[3], 0),
        (&docs[4][..3], 0),
        (&docs[4][3..], 3),
    ];
    let out = run_ranks(1, Duration::from_secs(120), |pg| {
        let m = LlamaModel::load(model.to_str().unwrap(), DType::F32).unwrap();
        let c =
            compile(m, CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None))).unwrap();
        let (mut sum, mut count) = (0f64, 0usize);
        for (piece, first) in &pieces {
            let n = piece.len();
            let ids = Tensor::from_vec(piece.to_vec(), (1, n), &Device::Cpu).unwrap();
            let d = Documents::new(n, vec![0, n], *first).unwrap();
            let (loss, targets) = c.eval_loss_packed(&ids, None, &[d]).unwrap();
            sum += loss * targets as f64;
            count += targets;
        }
        sum / count as f64
    });
    let want = out.into_iter().next().unwrap().unwrap();
    // At P = 2 against one rank: DESIGN.md's Ring tolerance, 1e-5 * P.
    assert!((got - want).abs() <= 2e-5 * want, "held-out {got} vs its document pieces one at a time {want}");
}
