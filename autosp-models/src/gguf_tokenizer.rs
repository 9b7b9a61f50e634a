//! The tokenizer of a GGUF file, from its `tokenizer.ggml.*` metadata (tokens, merges, token types,
//! bos/eos), built as transformers builds it from the same file:
//! - `tokenizer.ggml.model = gpt2` (byte-level BPE): vocabulary, merges and special tokens from candle's
//!   `TokenizerFromGguf`, the pre-tokenizer then set to what the HF tokenizer.json of that
//!   `tokenizer.ggml.pre` family uses (candle's default adds a prefix space that GPT-2 style tokenizers such as
//!   SmolLM2's do not);
//! - `tokenizer.ggml.model = llama` (SentencePiece) in a Gemma file: Gemma's BPE with byte fallback
//!   ([`gemma_tokenizer`]), the merges (which the file does not store) recovered from the vocabulary.

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use std::collections::HashMap;
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// Builds the tokenizer of GGUF `ct` (read from `path`, named in errors). Supports `tokenizer.ggml.model
/// = gpt2` (byte-level BPE) with pre-tokenizer families gpt2, smollm, llama3 / smaug-bpe, qwen2, and
/// `tokenizer.ggml.model = llama` (SentencePiece) in gemma3 files.
pub fn tokenizer_from_gguf(ct: &Content, path: &Path) -> Result<Tokenizer> {
    let err =
        |message: String| Error::Tokenizer { source_name: format!("{} (tokenizer.ggml.*)", path.display()), message };
    let string = |key: &str| ct.metadata.get(key).and_then(|v| v.to_string().ok()).cloned();
    if string("tokenizer.ggml.model").as_deref() == Some("llama") {
        return match string("general.architecture").as_deref() {
            Some("gemma3") => gemma_tokenizer(ct).map_err(err),
            other => Err(err(format!(
                "a SentencePiece tokenizer (tokenizer.ggml.model = llama) is read for gemma3 files only, not \
                 `{}`; use the model's tokenizer.json",
                other.unwrap_or("?")
            ))),
        };
    }
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

/// Gemma's tokenizer from a GGUF file, as transformers' `gemma_tokenizer` builds it (its `GemmaTokenizer`):
/// BPE over the file's tokens with byte fallback and `<unk>` fused, spaces normalised to `▁` (no prefix
/// space), decoded back with `▁` -> space, byte fallback and fuse. The file stores no merges; they are
/// recovered from the vocabulary (transformers' `generate_merges`): every split of a token into two tokens
/// of the vocabulary is a merge, ranked by the merged token's position in the file (earlier first, Gemma's
/// scores do not follow its merge order), then by longer left and right parts. A token of spaces alone is
/// spelled with `▁` (the file stores real spaces). Control tokens (type 3) are added as special tokens,
/// user-defined ones (type 4) as added tokens; `tokenizer.ggml.add_bos_token` (default true) puts BOS first.
fn gemma_tokenizer(ct: &Content) -> std::result::Result<Tokenizer, String> {
    let md = |key: &str| ct.metadata.get(key);
    let tokens: Vec<String> = md("tokenizer.ggml.tokens")
        .and_then(|v| v.to_vec().ok())
        .ok_or("tokenizer.ggml.tokens is missing")?
        .iter()
        .map(|t| t.to_string().cloned().map_err(|e| e.to_string()))
        .map(|t| {
            t.map(|t| if t.contains(' ') && t.trim().is_empty() { "\u{2581}".repeat(t.chars().count()) } else { t })
        })
        .collect::<std::result::Result<_, _>>()?;
    let types: Vec<i64> = match md("tokenizer.ggml.token_type").and_then(|v| v.to_vec().ok()) {
        Some(v) => v
            .iter()
            .map(|t| t.to_i32().map(i64::from).map_err(|e| e.to_string()))
            .collect::<std::result::Result<_, _>>()?,
        None => vec![],
    };
    let id = |key: &str| md(key).and_then(|v| v.to_u32().ok());
    let text = |key: &str, default: &str| {
        id(key).and_then(|i| tokens.get(i as usize)).cloned().unwrap_or_else(|| default.to_string())
    };

    // Token -> its (last) index, as a Python dict built in file order keeps it.
    let mut index: HashMap<&str, u32> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        index.insert(t.as_str(), i as u32);
    }
    let mut merges: Vec<(&str, &str, u32)> = Vec::new();
    let mut seen = std::collections::HashSet::with_capacity(tokens.len());
    for t in &tokens {
        if !seen.insert(t.as_str()) {
            continue;
        }
        let rank = index[t.as_str()];
        let mut local: Vec<(&str, &str, u32)> = t
            .char_indices()
            .skip(1)
            .map(|(at, _)| t.split_at(at))
            .filter(|(l, r)| index.contains_key(l) && index.contains_key(r))
            .map(|(l, r)| (l, r, rank))
            .collect();
        local.sort_by_key(|(l, r, _)| (index[l], index[r]));
        merges.extend(local);
    }
    // Python's stable sort of (-position, len(left), len(right)), reversed: earliest merged token first,
    // then the longer left part, then the longer right part.
    merges.sort_by_key(|(l, r, rank)| {
        (*rank, std::cmp::Reverse(l.chars().count()), std::cmp::Reverse(r.chars().count()))
    });
    let merges: Vec<(String, String)> = merges.into_iter().map(|(l, r, _)| (l.to_string(), r.to_string())).collect();
    let vocab: Vocab = index.iter().map(|(t, i)| (t.to_string(), *i)).collect();

    let unk = "<unk>".to_string();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token(unk)
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| format!("building Gemma's BPE: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    let e = |e: tokenizers::Error| e.to_string();
    tok.with_normalizer(Some(Replace::new(" ", "\u{2581}").map_err(e)?)).map_err(e)?;
    let split = Split::new(SplitPattern::String(" ".into()), SplitDelimiterBehavior::MergedWithPrevious, false);
    tok.with_pre_tokenizer(Some(split.map_err(e)?));
    tok.with_decoder(Some(DecoderSequence::new(vec![
        DecoderWrapper::Replace(Replace::new("\u{2581}", " ").map_err(e)?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ])));
    let of_type = |want: i64, special: bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(&types)
            .filter(|(_, ty)| **ty == want)
            .map(|(t, _)| AddedToken::from(t.clone(), special).normalized(false))
            .collect()
    };
    tok.add_special_tokens(of_type(3, true)).map_err(e)?;
    tok.add_tokens(of_type(4, false)).map_err(e)?;
    let add_bos = match md("tokenizer.ggml.add_bos_token") {
        Some(v) => v.to_bool().map_err(|e| e.to_string())?,
        None => true,
    };
    if let (true, Some(bos_id)) = (add_bos, id("tokenizer.ggml.bos_token_id")) {
        let bos = text("tokenizer.ggml.bos_token_id", "<bos>");
        let post = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .and_then(|b| b.try_pair(format!("{bos} $A {bos}:1 $B:1")))
            .map_err(|e| e.to_string())?
            .special_tokens(vec![(bos, bos_id)])
            .build()
            .map_err(|e| e.to_string())?;
        tok.with_post_processor(Some(post));
    }
    Ok(tok)
}
