//! `llama_longctx --prompt`: generation from the command line (the example binary, offline, on the demo
//! model, which has no tokenizer: prompts as `ids:`). The closing JSON line's tokens are the same at `--sp 1`,
//! `--sp 2` (Ulysses) and `--sp 4` (Ring), every rank holding part of the cache; bad prompts are clear
//! errors: a file that is not UTF-8, text without a tokenizer, `--chat` without a template, an id outside the
//! vocabulary, a prompt that leaves no room for the new tokens.

mod longctx_cli;

use longctx_cli::{run_err, run_ok};

/// The closing JSON line of a run's stdout.
fn closing(stdout: &str) -> serde_json::Value {
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).expect("a closing JSON line");
    serde_json::from_str(line).unwrap()
}

fn prompt() -> String {
    format!("ids:{}", (0..45).map(|i| ((i * 31 + 7) % 100 + 3).to_string()).collect::<Vec<_>>().join(","))
}

#[test]
fn generated_tokens_are_the_same_at_sp_1_2_and_4() {
    let tmp = tempfile::tempdir().unwrap();
    let p = prompt();
    let base = ["--prompt", p.as_str(), "--max-new-tokens", "12", "--temperature", "0"];
    let one = closing(&run_ok(tmp.path(), &[&base[..], &["--sp", "1"]].concat()));
    let tokens = one["tokens"].as_array().unwrap().clone();
    assert!(!tokens.is_empty() && tokens.len() <= 12);
    assert_eq!(one["prompt_tokens"], 45);
    for extra in [&["--sp", "2", "--strategy", "ulysses"][..], &["--sp", "4", "--strategy", "ring"]] {
        let out = run_ok(tmp.path(), &[&base[..], extra].concat());
        let j = closing(&out);
        assert_eq!(j["tokens"].as_array().unwrap(), &tokens, "{extra:?}");
        // Every rank holds a part of the cache, none the whole of it.
        let per_rank = j["kv_cache_bytes_per_rank"].as_array().unwrap();
        assert_eq!(per_rank.len(), extra[1].parse::<usize>().unwrap());
        assert!(j["kv_rows"].as_array().unwrap().iter().all(|r| r.as_u64().unwrap() < 45));
        assert!(out.contains("prefill") && out.contains("tok/s"), "the summary line: {out}");
    }
}

#[test]
fn bad_prompts_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("latin1.txt");
    std::fs::write(&file, b"caf\xe9 au lait").unwrap();
    let err = run_err(tmp.path(), &["--prompt", file.to_str().unwrap()]);
    assert!(err.contains("is not UTF-8") && err.contains("offset 3"), "{err}");
    let err = run_err(tmp.path(), &["--prompt", "hello there"]);
    assert!(err.contains("no tokenizer") && err.contains("ids:"), "{err}");
    let err = run_err(tmp.path(), &["--prompt", "ids:"]);
    assert!(err.contains("the prompt is empty"), "{err}");
    let err = run_err(tmp.path(), &["--prompt", "ids:1,2,99999"]);
    assert!(err.contains("outside the model's vocabulary"), "{err}");
    let err = run_err(tmp.path(), &["--prompt", "ids:1,2,3", "--max-new-tokens", "100000000"]);
    assert!(err.contains("max_position_embeddings") && err.contains("--max-new-tokens"), "{err}");
}
