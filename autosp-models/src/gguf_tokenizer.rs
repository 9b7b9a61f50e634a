//! The tokenizer of a GGUF file, from its `tokenizer.ggml.*` metadata (tokens, merges, token types,
//! bos/eos). Vocabulary, merges and special tokens come from candle's `TokenizerFromGguf`; the
//! pre-tokenizer is then set to what the HF tokenizer.json of that `tokenizer.ggml.pre` family uses
//! (candle's default adds a prefix space that GPT-2 style tokenizers such as SmolLM2's do not).

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use std::path::Path;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{PreTokenizerWrapper, Tokenizer};

/// Builds the tokenizer of GGUF `ct` (read from `path`, named in errors). Supports `tokenizer.ggml.model
/// = gpt2` (byte-level BPE) with pre-tokenizer families gpt2, smollm, llama3 / smaug-bpe, qwen2.
pub fn tokenizer_from_gguf(ct: &Content, path: &Path) -> Result<Tokenizer> {
    let err =
        |message: String| Error::Tokenizer { source_name: format!("{} (tokenizer.ggml.*)", path.display()), message };
    let pre = ct
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_else(|| "gpt2".to_string());
    let mut tok = Tokenizer::from_gguf(ct).map_err(|e| err(e.to_string()))?;
    let byte_level = || -> PreTokenizerWrapper { ByteLevel::new(false, true, true).into() };
    match pre.as_str() {
        // GPT-2: the byte-level regex, no prefix space.
        "gpt2" | "default" => {
            tok.with_pre_tokenizer(Some(byte_level()));
        }
        // SmolLM: digits split one by one, then GPT-2 byte level (HF: Digits + ByteLevel).
        "smollm" => {
            let seq = Sequence::new(vec![Digits::new(true).into(), byte_level()]);
            tok.with_pre_tokenizer(Some(seq));
        }
        // candle builds these families as their tokenizer.json does.
        "llama3" | "smaug-bpe" | "qwen2" | "lfm2" => {}
        other => {
            return Err(err(format!(
                "tokenizer.ggml.pre = `{other}` is not supported (supported: gpt2, smollm, llama3, \
                 smaug-bpe, qwen2); use the model's tokenizer.json"
            )))
        }
    }
    Ok(tok)
}
