//! Chat data: conversations rendered with the model's chat template exactly as transformers'
//! `apply_chat_template` renders and tokenises them, and the assistant-only mask equal to transformers' own
//! (`return_assistant_tokens_mask`, from the template's `{% generation %}` tags, which autosp does not read:
//! it finds the answers by rendering each turn's prefix); the token cache holds the same ids and mask, packed
//! (none straddling two windows) or one conversation per window, and a conversation longer than the window
//! keeps its opening and its answer; `llama_longctx` fine-tunes on conversations with LoRA, trains every step
//! when the first conversation is longer than --seq-len, and processes started at once share one tokenising.
//! Golden values: tests/fixtures/chat (made by tests/fixtures/make_chat_golden.py with transformers).

mod longctx_cli;

use std::path::{Path, PathBuf};

use autosp::train::corpus::{ChatLayout, Corpus, Tokenising};
use autosp_models::{load_tokenizer, write_tiny, ChatTemplate, TinySpec};
use candle_core::DType;
use longctx_cli::{command, losses, metrics_summary, run_ok, s};

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
    let lens: Vec<usize> = cases.iter().map(|g| g.ids.len()).collect();
    assert_eq!(lens, [51, 64, 65]);
    // Packed in 128-token windows: the first two fill 115 of the first window; the third does not fit in the
    // 13 left, so they are padded with EOS (untrained) and it starts the second window.
    let packed = Corpus::prepare(&data, &t(ChatLayout::Pack, 128)).unwrap();
    assert!(packed.chat);
    assert_eq!((packed.tokens, packed.windows(128)), (256, 2));
    let (ids, trained) = packed.read(0, 10_000).unwrap();
    let pad = |n: usize| (vec![2u32; n], vec![false; n]);
    let want: Vec<(Vec<u32>, Vec<bool>)> = vec![
        (cases[0].ids.clone(), cases[0].mask.clone()),
        (cases[1].ids.clone(), cases[1].mask.clone()),
        pad(13),
        (cases[2].ids.clone(), cases[2].mask.clone()),
        pad(63),
    ];
    assert_eq!(ids, want.iter().flat_map(|w| w.0.clone()).collect::<Vec<_>>());
    assert_eq!(trained, want.iter().flat_map(|w| w.1.clone()).collect::<Vec<_>>());
    // A window's answers are its trained positions.
    let (_, answers) = packed.window(1, 128).unwrap();
    let want: Vec<usize> = (0..128).filter(|&k| trained[128 + k]).collect();
    assert_eq!(answers, want);
    // Each conversation is a document, and so is each run of padding; none goes on across windows.
    let docs = |k: u64| {
        let d = packed.documents(128 * k, 128).unwrap();
        (d.cu_seqlens().to_vec(), d.first_position())
    };
    assert_eq!((docs(0), docs(1)), ((vec![0, 51, 115, 128], 0), (vec![0, 65, 128], 0)));
    // Truncated: each conversation in a window of its own, padded with EOS (untrained).
    let cut = Corpus::prepare(&data, &t(ChatLayout::Truncate, 72)).unwrap();
    assert_ne!(cut.path, packed.path, "the layout is part of the cache key");
    assert_eq!(cut.windows(72), 3);
    for (k, g) in cases.iter().enumerate() {
        let (ids, trained) = cut.read((k * 72) as u64, 72).unwrap();
        let n = g.ids.len();
        assert_eq!(ids[..n], g.ids[..]);
        assert_eq!(trained[..n], g.mask[..]);
        assert!(ids[n..].iter().all(|&x| x == 2) && trained[n..].iter().all(|&x| !x));
    }
}

#[test]
fn the_opening_and_the_start_of_a_conversation_are_found_in_any_template() {
    let tok = load_tokenizer(&fixture().join("tokenizer.json")).unwrap();
    let messages = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."},
    ]);
    let messages = messages.as_array().unwrap();
    // A Llama 3 style template: the BOS first, and (like Llama 3's, which reads messages[0]) no rendering of
    // an empty conversation: the start is then found as the BOS the text begins with.
    let source = "{% if messages | length == 0 %}{{ raise_exception('no messages') }}{% endif %}{{ bos_token }}\
                  {% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}\
                  {% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}";
    let template = ChatTemplate::new(source, "<|endoftext|>", "<|im_end|>").unwrap();
    let c = template.encode_conversation(&tok, messages).unwrap();
    assert_eq!((c.start, c.ids[0]), (1, tok.token_to_id("<|endoftext|>").unwrap()));
    let opening = tok.decode(&c.ids[..c.opening], false).unwrap();
    assert!(
        opening == "<|endoftext|>system: Be brief.\nuser:" || opening == "<|endoftext|>system: Be brief.\nuser: ",
        "{opening:?}"
    );
    // The fixture's ChatML template renders nothing for no messages; its tokenizer_config.json names
    // `<|im_start|>` its BOS, which the text begins with: the start. The opening is the system turn and the
    // user's header.
    let chatml = ChatTemplate::beside_tokenizer(&fixture().join("tokenizer.json")).unwrap().unwrap();
    let c = chatml.encode_conversation(&tok, messages).unwrap();
    assert_eq!((c.start, c.ids[0]), (1, tok.token_to_id("<|im_start|>").unwrap()));
    let opening = tok.decode(&c.ids[..c.opening], false).unwrap();
    assert_eq!(opening, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n");
    assert_eq!((c.ids.clone(), c.trained.clone()), chatml.encode(&tok, messages).unwrap());
}

/// A conversation of `words` words of context in the user turn (a long document) before a question, then
/// the answer.
fn long_conversation(words: usize) -> serde_json::Value {
    let doc: Vec<&str> =
        ["the", "river", "runs", "past", "the", "old", "mill"].iter().copied().cycle().take(words).collect();
    serde_json::json!({"messages": [
        {"role": "user", "content": format!("{}. What is the capital of France?", doc.join(" "))},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ]})
}

/// Whether each window of `corpus` (of `seq_len`) holds whole conversations of `convs` (each as `fit` lays it
/// out: `convs[k]` is the ids and mask it must appear as), in order, then only untrained EOS: none straddles.
fn assert_whole_conversations(corpus: &Corpus, seq_len: usize, convs: &[(Vec<u32>, Vec<bool>)]) {
    let mut next = 0;
    for w in 0..corpus.windows(seq_len) {
        let (ids, trained) = corpus.read((w * seq_len) as u64, seq_len).unwrap();
        let mut at = 0;
        while next < convs.len() {
            let (c, m) = &convs[next];
            if at + c.len() > seq_len || ids[at..at + c.len()] != c[..] {
                break;
            }
            assert_eq!(trained[at..at + c.len()], m[..], "window {w}: conversation {next}'s mask");
            at += c.len();
            next += 1;
        }
        assert!(at > 0, "window {w} starts with no whole conversation (conversation {next} straddles?)");
        assert!(
            ids[at..].iter().all(|&x| x == 2) && trained[at..].iter().all(|&x| !x),
            "window {w}: after its whole conversations only padding, from {at}: {:?}",
            &ids[at..]
        );
    }
    assert_eq!(next, convs.len(), "every conversation laid out, in order");
}

#[test]
fn a_conversation_longer_than_the_window_keeps_its_opening_and_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let template = ChatTemplate::beside_tokenizer(&fixture().join("tokenizer.json")).unwrap().unwrap();
    let tok = load_tokenizer(&fixture().join("tokenizer.json")).unwrap();
    let json = std::fs::read_to_string(fixture().join("tokenizer.json")).unwrap();
    let seq_len = 128;
    let long = long_conversation(300);
    let full = template.encode_conversation(&tok, long["messages"].as_array().unwrap()).unwrap();
    assert!(full.ids.len() > 2 * seq_len, "{} tokens", full.ids.len());
    // The answer: the trained tokens of the whole conversation (its only assistant turn, with its end of turn).
    let answer: Vec<u32> = full.ids.iter().zip(&full.trained).filter(|(_, &t)| t).map(|(&i, _)| i).collect();
    assert!(tok.decode(&answer, false).unwrap().starts_with("The capital of France is Paris."));
    // The opening: the default system turn and the user turn's header, up to its content.
    let opening = tok.decode(&full.ids[..full.opening], false).unwrap();
    assert!(
        opening.starts_with("<|im_start|>system\nYou are a helpful") && opening.ends_with("<|im_start|>user\n"),
        "{opening:?}"
    );
    // The long conversation first, then the fixture's (short) ones.
    let data = dir.path().join("chat.jsonl");
    let rest = std::fs::read_to_string(fixture().join("conversations.jsonl")).unwrap();
    std::fs::write(&data, format!("{long}\n{rest}")).unwrap();
    let t = |layout| Tokenising {
        tokenizer: &tok,
        tokenizer_json: &json,
        template: Some(&template),
        eos: Some(2),
        layout,
        seq_len,
    };
    let cases = golden();
    for layout in [ChatLayout::Truncate, ChatLayout::Pack] {
        let corpus = Corpus::prepare(&data, &t(layout)).unwrap();
        let (ids, answers) = corpus.window(0, seq_len).unwrap();
        // The window's trainable tokens are the answer's, whole, at its end; it starts with the opening and
        // holds as much of the document and the question as fits between.
        let trained_ids: Vec<u32> = answers.iter().map(|&k| ids[k]).collect();
        assert_eq!(trained_ids, answer, "{layout:?}: the window trains the answer");
        assert_eq!(*answers.last().unwrap(), seq_len - 1, "{layout:?}: the answer ends the window");
        assert_eq!(ids[..full.opening], full.ids[..full.opening], "{layout:?}: the opening is kept");
        let tail = seq_len - full.opening;
        assert_eq!(ids[full.opening..], full.ids[full.ids.len() - tail..], "{layout:?}: the end is kept");
        let text = tok.decode(&ids, false).unwrap();
        assert!(
            text.contains("the old. What is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital"),
            "{layout:?}: {text}"
        );
        // Every window holds whole conversations: the long one cut, the fixture's (51, 64 and 65 tokens) as
        // they are; packed, the first two share a window.
        let (_, trained) = corpus.read(0, seq_len).unwrap();
        let fitted: Vec<(Vec<u32>, Vec<bool>)> = std::iter::once((ids.clone(), trained))
            .chain(cases.iter().map(|g| (g.ids.clone(), g.mask.clone())))
            .collect();
        assert_whole_conversations(&corpus, seq_len, &fitted);
        let windows = if layout == ChatLayout::Pack { 3 } else { 4 };
        assert_eq!(corpus.windows(seq_len), windows, "{layout:?}");
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
    assert!(out.contains("the assistant's tokens train (tokenised now into the cache"), "{out}");
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
    let out = run_ok(t, &again);
    assert!(out.contains("the assistant's tokens train (read from the cache"), "{out}");
    assert_eq!(losses(&metrics2), l);
}

#[test]
fn a_chat_run_whose_first_conversation_is_longer_than_the_window_trains_to_the_end() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = chat_model(t);
    let data = t.join("chat.jsonl");
    let rest = std::fs::read_to_string(fixture().join("conversations.jsonl")).unwrap();
    std::fs::write(&data, format!("{}\n{}", long_conversation(300), rest.repeat(2))).unwrap();
    for layout in ["truncate", "pack"] {
        let metrics = t.join(format!("{layout}.jsonl"));
        let args = [
            "--model",
            s(&model),
            "--data",
            s(&data),
            "--chat-layout",
            layout,
            "--seq-len",
            "128",
            "--steps",
            "4",
            "--lr",
            "1e-3",
            "--warmup",
            "1",
            "--metrics",
            s(&metrics),
        ];
        let out = run_ok(t, &args);
        let l = losses(&metrics);
        assert_eq!(l.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 2, 3, 4], "{layout}: every step trains\n{out}");
        assert!(l.iter().all(|x| x.1.is_finite() && x.1 > 0.0), "{layout}: {l:?}");
    }
}

#[test]
fn processes_started_at_once_share_one_tokenising_of_a_plain_text_corpus() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = chat_model(t);
    // A few MB of paragraphs: long enough to tokenise that the processes overlap.
    let data = t.join("corpus.txt");
    let para = "The capital of France is Paris.\nWhat is the capital of France?\n\n";
    std::fs::write(&data, para.repeat(60_000)).unwrap();
    let runs: Vec<_> = (0..3)
        .map(|k| {
            let (metrics, save) = (t.join(format!("m{k}.jsonl")), t.join(format!("run{k}")));
            let args = [
                "--model",
                s(&model),
                "--data",
                s(&data),
                "--seq-len",
                "64",
                "--steps",
                "2",
                "--metrics",
                s(&metrics),
                "--save",
                s(&save),
            ];
            let mut c = command(t, &args);
            c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
            (c.spawn().unwrap(), metrics)
        })
        .collect();
    let mut all = Vec::new();
    for (child, metrics) in runs {
        let out = child.wait_with_output().unwrap();
        let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
        all.push(losses(&metrics));
    }
    assert!(all.iter().all(|l| l.len() == 2 && *l == all[0]), "the same data trains the same: {all:?}");
    let mut left: Vec<String> = std::fs::read_dir(t)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with(".corpus.txt."))
        .collect();
    left.sort();
    assert_eq!(left.len(), 3, "one cache, its document starts and its index, no lock or partial file: {left:?}");
    for end in [".index", ".starts", ".tokens"] {
        assert_eq!(left.iter().filter(|n| n.ends_with(end)).count(), 1, "{left:?}");
    }
}
