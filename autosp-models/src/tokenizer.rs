//! Loads a `tokenizer.json` with the `tokenizers` crate (built without onig: byte-level BPE uses its
//! fancy-regex back end).

use crate::error::{Error, Result};
use std::path::Path;
pub use tokenizers::Tokenizer;

/// Reads `tokenizer.json`.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path)
        .map_err(|e| Error::Tokenizer { source_name: path.display().to_string(), message: e.to_string() })
}

/// Token ids of `text`, without special tokens added.
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    encode_with(tok, text, false)
}

/// Token ids of a document as transformers' `tokenizer(text)` makes them: with the special tokens the
/// tokenizer's post-processor adds (Llama 3's and Gemma's BOS; none for Qwen or SmolLM2).
pub fn encode_document(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    encode_with(tok, text, true)
}

fn encode_with(tok: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>> {
    tok.encode(text, special)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| Error::Tokenizer { source_name: "encode".into(), message: e.to_string() })
}

/// Text of `ids`, special tokens skipped.
pub fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String> {
    tok.decode(ids, true).map_err(|e| Error::Tokenizer { source_name: "decode".into(), message: e.to_string() })
}
