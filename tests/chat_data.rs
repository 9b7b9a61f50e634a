//! Chat data: conversations rendered with the model's chat template exactly as transformers'
//! `apply_chat_template` renders and tokenises them, and the assistant-only mask equal to transformers' own
//! (`return_assistant_tokens_mask`, from the template's `{% generation %}` tags, which autosp does not read:
//! it finds the answers by rendering each turn's prefix); the token cache holds the same ids and mask, packed
//! or one conversation per window; `llama_longctx` fine-tunes on conversations with LoRA. Golden values:
//! tests/fixtures/chat (made by tests/fixtures/make_chat_golden.py with transformers).

mod longctx_cli;

use std::path::{Path, PathBuf};

use autosp::train::corpus::{ChatLayout, Corpus, Tokenising};
use autosp_models::{load_tokenizer, write_tiny, ChatTemplate, TinySpec};
use candle_core::DType;
use longctx_cli::{losses, metrics_summary, run_ok, s};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

struct Golden {
    messages: Vec<serde_json::Value>,
    text: String,
    ids: Vec<u32>,
    mask: Vec<bool>,
}

fn golden() -> Vec<Golden> {
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("golden.json")).unwrap()).unwrap();
    let convs = std::fs::read_to_string(fixture().join("conversations.jsonl")).unwrap();
    convs
        .lines()
        .zip(g.as_array().unwrap())
        .map(|(line, g)| {
            let c: serde_json::Value = serde_json::from_str(line).unwrap();
            Golden {
                messages: c["messages"].as_array().unwrap().clone(),
                text: g["text"].as_str().unwrap().to_string(),
                ids: g["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
                mask: g["assistant_mask"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() == 1).collect(),
            }
        })
        .collect()
}

#[test]
fn conversations_render_tokenise_and_mask_as_transformers_does() {
    let template = ChatTemplate::beside_tokenizer(&fixture().join("tokenizer.json")).unwrap().expect("a template");
    let tok = load_tokenizer(&fixture().join("tokenizer.json")).unwrap();
    let cases = golden();
    assert_eq!(cases.len(), 3);
    for (i, g) in cases.iter().enumerate() {
        assert_eq!(template.render(&g.messages, false).unwrap(), g.text, "conversation {i}: rendering");
        let (ids, mask) = template.encode(&tok, &g.messages).unwrap();
        assert_eq!(ids, g.ids, "conversation {i}: token ids");
        assert_eq!(mask, g.mask, "conversation {i}: assistant mask");
        assert!(mask.iter().any(|&m| m) && !mask.iter().all(|&m| m), "conversation {i}: a real mask");
    }
    // The generation prompt ends the text when asked for.
    let prompt = template.render(&cases[0].messages[..1], true).unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
}

#[test]
fn the_token_cache_packs_or_truncates_conversations_with_their_masks() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("chat.jsonl");
    std::fs::copy(fixture().join("conversations.jsonl"), &data).unwrap();
    let template = ChatTemplate::beside_tokenizer(&fixture().join("tokenizer.json")).unwrap();
    let tok = load_tokenizer(&fixture().join("tokenizer.json")).unwrap();
    let json = std::fs::read_to_string(fixture().join("tokenizer.json")).unwrap();
    let t = |layout, seq_len| Tokenising {
        tokenizer: &tok,
        tokenizer_json: &json,
        template: template.as_ref(),
        eos: Some(2),
        layout,
        seq_len,
    };
    let cases = golden();
    let packed = Corpus::prepare(&data, &t(ChatLayout::Pack, 32)).unwrap();
    assert!(packed.chat);
    let (ids, trained) = packed.read(0, 10_000).unwrap();
    assert_eq!(ids, cases.iter().flat_map(|g| g.ids.clone()).collect::<Vec<_>>());
    assert_eq!(trained, cases.iter().flat_map(|g| g.mask.clone()).collect::<Vec<_>>());
    // A window's answers are its trained positions.
    let (_, answers) = packed.window(1, 32).unwrap();
    let want: Vec<usize> = (0..32).filter(|&k| trained[32 + k]).collect();
    assert_eq!(answers, want);
    // Truncated: each conversation starts a window of its own, cut at 48 tokens or padded with EOS (untrained).
    let cut = Corpus::prepare(&data, &t(ChatLayout::Truncate, 48)).unwrap();
    assert_ne!(cut.path, packed.path, "the layout is part of the cache key");
    assert_eq!(cut.windows(48), 3);
    for (k, g) in cases.iter().enumerate() {
        let (ids, trained) = cut.read((k * 48) as u64, 48).unwrap();
        let n = g.ids.len().min(48);
        assert_eq!(ids[..n], g.ids[..n]);
        assert_eq!(trained[..n], g.mask[..n]);
        assert!(ids[n..].iter().all(|&x| x == 2) && trained[n..].iter().all(|&x| !x));
    }
}

/// A tiny model in the HF layout with the fixture's tokenizer and chat template.
fn chat_model(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    write_tiny(&m, &TinySpec { vocab: 400, ..TinySpec::default() }, 5, DType::F32).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture().join(f), m.join(f)).unwrap();
    }
    m
}

#[test]
fn llama_longctx_fine_tunes_on_conversations_with_lora() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = chat_model(t);
    let data = t.join("chat.jsonl");
    let text = std::fs::read_to_string(fixture().join("conversations.jsonl")).unwrap();
    std::fs::write(&data, text.repeat(8)).unwrap();
    let (save, metrics) = (t.join("run"), t.join("m.jsonl"));
    let args = [
        "--model",
        s(&model),
        "--data",
        s(&data),
        "--eval-data",
        s(&data),
        "--eval-tokens-max",
        "256",
        "--seq-len",
        "64",
        "--steps",
        "8",
        "--lora",
        "8",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--save",
        s(&save),
        "--metrics",
        s(&metrics),
    ];
    let out = run_ok(t, &args);
    assert!(out.contains("LoRA: rank 8"), "{out}");
    let l = losses(&metrics);
    assert_eq!(l.len(), 8);
    let sum = metrics_summary(&metrics);
    let (before, after) = (sum["eval"]["before"].as_f64().unwrap(), sum["eval"]["after"].as_f64().unwrap());
    assert!(after < before, "the held-out loss on the assistant's tokens must fall: {before} -> {after}\n{out}");
    // The checkpoint holds the adapter and the tokenizer with its chat template; the cache sits beside the data.
    let step = save.join("step-8");
    for f in ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        assert!(step.join(f).is_file(), "{f} missing");
    }
    let caches = std::fs::read_dir(t).unwrap().filter(|e| {
        let n = e.as_ref().unwrap().file_name().to_string_lossy().to_string();
        n.starts_with(".chat.jsonl.autosp-") && n.ends_with(".tokens")
    });
    assert_eq!(caches.count(), 1, "one cache, shared by --data and --eval-data");
    // A second run reads the cache instead of tokenising again, and trains the same.
    let (save2, metrics2) = (t.join("run2"), t.join("m2.jsonl"));
    let mut again = args.to_vec();
    let (i, j) = (again.len() - 3, again.len() - 1);
    again[i] = s(&save2);
    again[j] = s(&metrics2);
    run_ok(t, &again);
    assert_eq!(losses(&metrics2), l);
}
