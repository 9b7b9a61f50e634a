//! Training data from files: where it comes from ([`DataSource`], as `--data` spells it), token-id files,
//! JSONL and plain-text documents, tokenisation with the model's tokenizer (each document as transformers'
//! `tokenizer(text)` makes it, BOS where the tokenizer adds one, then EOS), and packing into sequences of
//! `seq_len` tokens. [`super::Stream`] hands the sequences out with a position a
//! checkpoint can save.

use std::path::{Path, PathBuf};

use autosp_models::tokenizer::encode_document;
use autosp_models::Tokenizer;

use super::error::{IoContext, Result, TrainError};

/// Where the training data comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSource {
    /// Synthetic passkey retrieval ([`super::synthetic::Passkey`]).
    Passkey,
    /// Synthetic multi-needle retrieval across the shards ([`super::synthetic::Needles`]).
    Needles,
    /// Whitespace-separated token ids ([`read_ids`]).
    Ids(PathBuf),
    /// A JSONL file with a "text" field, or plain text (decided by the extension `.jsonl`/`.json`;
    /// [`read_documents`]).
    Text(PathBuf),
}

impl DataSource {
    /// Parses `--data`: `passkey`, `needles`, `ids:FILE`, or a text/JSONL file.
    pub fn parse(s: &str) -> Self {
        if s == "passkey" {
            DataSource::Passkey
        } else if s == "needles" {
            DataSource::Needles
        } else if let Some(f) = s.strip_prefix("ids:") {
            DataSource::Ids(PathBuf::from(f))
        } else {
            DataSource::Text(PathBuf::from(s))
        }
    }

    /// The token ids of a file source: `Ids` read as they are (each below `vocab`); `Text` read as documents and
    /// tokenised with `tokenizer` ([`tokenize`], `eos` after each). `option` names the setting and `model` the
    /// model (`` `owner/name` ``, `the model`) in errors. `None` for the synthetic sources.
    pub fn file_ids(
        &self,
        option: &str,
        model: &str,
        vocab: usize,
        tokenizer: Option<&Tokenizer>,
        eos: Option<u32>,
    ) -> Result<Option<Vec<u32>>> {
        match self {
            DataSource::Passkey | DataSource::Needles => Ok(None),
            DataSource::Ids(f) => read_ids(f, vocab).map(Some),
            DataSource::Text(f) => {
                let docs = read_documents(f)?;
                let tok = tokenizer.ok_or_else(|| {
                    TrainError::Config(format!(
                        "{option} {}: text needs the model's tokenizer, and {model} has no tokenizer.json; give token \
                         ids with {option} ids:FILE",
                        f.display()
                    ))
                })?;
                tokenize(tok, &docs, eos).map(Some)
            }
        }
    }
}

/// Whitespace-separated token ids from `path`, each below `vocab`.
pub fn read_ids(path: &Path, vocab: usize) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).io(|| format!("reading token ids from {}", path.display()))?;
    let mut ids = Vec::new();
    for (i, word) in text.split_whitespace().enumerate() {
        let id: u32 = word.parse().map_err(|_| {
            TrainError::Data(format!(
                "{}: token {i} is `{word}`, not a token id: the file must hold whitespace-separated integers from 0 \
                 to {} (the model's vocabulary)",
                path.display(),
                vocab.saturating_sub(1)
            ))
        })?;
        if id as usize >= vocab {
            return Err(TrainError::Data(format!(
                "{}: token {i} is id {id}, outside the model's vocabulary of {vocab} (ids 0 to {}): the ids were \
                 made with another tokenizer; tokenise the text with this model's tokenizer",
                path.display(),
                vocab.saturating_sub(1)
            )));
        }
        ids.push(id);
    }
    if ids.is_empty() {
        return Err(TrainError::Data(format!(
            "{}: no token ids (the file is empty): give whitespace-separated token ids",
            path.display()
        )));
    }
    Ok(ids)
}

/// Writes each of `lines` as whitespace-separated ids on a line of its own (the format [`read_ids`] reads, as
/// one run of ids).
pub fn write_ids<'a>(path: &Path, lines: impl IntoIterator<Item = &'a [u32]>) -> Result<()> {
    let text: String =
        lines.into_iter().map(|ids| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ") + "\n").collect();
    std::fs::write(path, text).io(|| format!("writing {}", path.display()))
}

/// The documents of a JSONL file (a "text" string on every non-empty line) or of a plain text file (the
/// whole file), by extension: `.jsonl` and `.json` are JSONL.
pub fn read_documents(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).io(|| format!("reading training data {}", path.display()))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    if text.trim().is_empty() {
        return Err(TrainError::Data(format!(
            "training data {} is empty: give a file with text (or --data passkey)",
            path.display()
        )));
    }
    if ext != "jsonl" && ext != "json" {
        return Ok(vec![text]);
    }
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            TrainError::Data(format!(
                "{} line {}: not JSON ({e}); a JSONL data file holds one JSON object with a \"text\" string per \
                 line (use a .txt extension for plain text)",
                path.display(),
                i + 1
            ))
        })?;
        match v.get("text").and_then(|t| t.as_str()) {
            Some(t) => docs.push(t.to_string()),
            None => {
                return Err(TrainError::Data(format!(
                    "{} line {}: no \"text\" string field in {}",
                    path.display(),
                    i + 1,
                    short(line)
                )))
            }
        }
    }
    Ok(docs)
}

fn short(s: &str) -> String {
    if s.len() > 60 {
        format!("{}...", &s[..s.char_indices().take_while(|(i, _)| *i < 60).last().map_or(0, |(i, _)| i)])
    } else {
        s.to_string()
    }
}

/// Tokenises `docs` and joins them: each document with the special tokens the tokenizer's post-processor adds
/// (as transformers' `tokenizer(text)`: Llama 3's and Gemma's BOS; nothing for Qwen or SmolLM2), then `eos`
/// when the model has one and the tokenizer did not end the document with it, so packed documents are
/// separated by EOS.
pub fn tokenize(tok: &Tokenizer, docs: &[String], eos: Option<u32>) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for d in docs {
        let doc = encode_document(tok, d)?;
        let ended = doc.last().is_some_and(|&t| Some(t) == eos);
        ids.extend(doc);
        if !ended {
            ids.extend(eos);
        }
    }
    Ok(ids)
}

/// Cuts `ids` into sequences of `seq_len` tokens (the remainder is dropped); at least one must fit. `source`
/// names the data in the error.
pub fn pack(ids: &[u32], seq_len: usize, source: &str) -> Result<Vec<Vec<u32>>> {
    if ids.len() < seq_len {
        return Err(TrainError::Data(format!(
            "--seq-len {seq_len} is longer than the {} tokens available in {source}: lower --seq-len or give more data",
            ids.len()
        )));
    }
    Ok(ids.chunks_exact(seq_len).map(<[u32]>::to_vec).collect())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn ids_and_documents_are_read_and_packed() {
        let dir = tempfile::tempdir().unwrap();
        let ids = dir.path().join("ids.txt");
        std::fs::write(&ids, "1 2\n3 4 5").unwrap();
        assert_eq!(read_ids(&ids, 6).unwrap(), vec![1, 2, 3, 4, 5]);
        let e = read_ids(&ids, 5).unwrap_err().to_string();
        assert!(e.contains("token 4 is id 5, outside the model's vocabulary of 5"), "{e}");
        assert_eq!(pack(&[1, 2, 3, 4, 5], 2, "x").unwrap(), vec![vec![1, 2], vec![3, 4]]);
        let e = pack(&[1, 2, 3], 4, "x").unwrap_err().to_string();
        assert!(e.contains("--seq-len 4 is longer than the 3 tokens available in x"), "{e}");
        let jsonl = dir.path().join("d.jsonl");
        std::fs::write(&jsonl, "{\"text\": \"a\"}\n\n{\"text\": \"b c\"}\n").unwrap();
        assert_eq!(read_documents(&jsonl).unwrap(), vec!["a".to_string(), "b c".to_string()]);
        std::fs::write(&jsonl, "{\"text\": \"a\"}\n{\"body\": 1}\n").unwrap();
        let e = read_documents(&jsonl).unwrap_err().to_string();
        assert!(e.contains("line 2: no \"text\" string field"), "{e}");
        let txt = dir.path().join("d.txt");
        std::fs::write(&txt, "{not json} plain text").unwrap();
        assert_eq!(read_documents(&txt).unwrap(), vec!["{not json} plain text".to_string()]);
        assert_eq!(DataSource::parse("ids:f"), DataSource::Ids("f".into()));
        assert_eq!(DataSource::parse("needles"), DataSource::Needles);
        assert_eq!(DataSource::parse("a.jsonl"), DataSource::Text("a.jsonl".into()));
    }

    /// A word-level tokenizer whose post-processor puts `<s>` (id 1) before each text, as Llama 3's does (other
    /// words than `a` and `b` are `<unk>`, 0).
    pub(crate) fn with_bos() -> Tokenizer {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null,
          "added_tokens": [{"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
                            "normalized": false, "special": true}],
          "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
          "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
          "decoder": null,
          "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}, "unk_token": "<unk>"}}"#;
        json.parse().unwrap()
    }

    #[test]
    fn documents_get_the_tokenizers_bos_and_an_eos_between_them() {
        let docs = vec!["a b".to_string(), "b".to_string()];
        assert_eq!(tokenize(&with_bos(), &docs, Some(2)).unwrap(), vec![1, 3, 4, 2, 1, 4, 2]);
        // No EOS in the model: documents run on (nothing is invented).
        assert_eq!(tokenize(&with_bos(), &docs, None).unwrap(), vec![1, 3, 4, 1, 4]);
    }
}
