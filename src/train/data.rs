//! Training data from files: where it comes from ([`DataSource`], as `--data` spells it), token-id files,
//! and packing ids into sequences of `seq_len` tokens. Text, JSONL documents and conversations are tokenised
//! into a cache on disk by [`super::corpus`]. [`super::Stream`] hands the sequences out with a position a
//! checkpoint can save.

use std::path::{Path, PathBuf};

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
    /// A JSONL file of documents (`"text"`) or conversations (`"messages"`), or plain text (decided by the
    /// extension `.jsonl`/`.json`; [`super::corpus`]).
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
    use autosp_models::Tokenizer;

    #[test]
    fn ids_are_read_and_packed() {
        let dir = tempfile::tempdir().unwrap();
        let ids = dir.path().join("ids.txt");
        std::fs::write(&ids, "1 2\n3 4 5").unwrap();
        assert_eq!(read_ids(&ids, 6).unwrap(), vec![1, 2, 3, 4, 5]);
        let e = read_ids(&ids, 5).unwrap_err().to_string();
        assert!(e.contains("token 4 is id 5, outside the model's vocabulary of 5"), "{e}");
        assert_eq!(pack(&[1, 2, 3, 4, 5], 2, "x").unwrap(), vec![vec![1, 2], vec![3, 4]]);
        let e = pack(&[1, 2, 3], 4, "x").unwrap_err().to_string();
        assert!(e.contains("--seq-len 4 is longer than the 3 tokens available in x"), "{e}");
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
}
