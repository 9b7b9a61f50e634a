//! Training data from files: where it comes from ([`DataSource`], as `--data` spells it), token-id files,
//! and packing ids into sequences of `seq_len` tokens. Text, JSONL documents and conversations are tokenised
//! into a cache on disk by [`super::corpus`]. [`super::Stream`] hands the sequences out with a position a
//! checkpoint can save.

use std::path::{Path, PathBuf};

use autosp_core::ops::Documents;

use super::error::{IoContext, Result, TrainError};
use super::packing::{documents_in, Packing};

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

    /// The packing of a run on this data given `--packing` (`given`): the one given, else documents for text,
    /// JSONL and chat files and stream for `ids:` files (used as they are unless asked); `None` for the
    /// synthetic tasks, whose samples have no documents: `--packing` with them is refused.
    pub fn packing(&self, given: Option<Packing>) -> Result<Option<Packing>> {
        match (self, given) {
            (DataSource::Passkey | DataSource::Needles, Some(p)) => Err(TrainError::Config(format!(
                "--packing {p} packs documents of a data file into windows, and --data {} is synthetic (each sample \
                 is one sequence of its own): leave --packing out, or give a text, JSONL or ids: file as --data",
                if *self == DataSource::Passkey { "passkey" } else { "needles" }
            ))),
            (DataSource::Passkey | DataSource::Needles, None) => Ok(None),
            (DataSource::Ids(_), None) => Ok(Some(Packing::Stream)),
            (DataSource::Text(_), None) => Ok(Some(Packing::Documents)),
            (_, Some(p)) => Ok(Some(p)),
        }
    }
}

/// Whitespace-separated token ids from `path`, each below `vocab`.
pub fn read_ids(path: &Path, vocab: usize) -> Result<Vec<u32>> {
    Ok(read_id_documents(path, vocab)?.0)
}

/// Whitespace-separated token ids from `path`, each below `vocab`, as [`read_ids`] reads them, and where each
/// line that holds ids starts in them (a line is a document for `--packing documents`): ascending, the first 0.
pub fn read_id_documents(path: &Path, vocab: usize) -> Result<(Vec<u32>, Vec<u64>)> {
    let text = std::fs::read_to_string(path).io(|| format!("reading token ids from {}", path.display()))?;
    let mut ids = Vec::new();
    let mut starts = Vec::new();
    let words = text.lines().flat_map(|line| line.split_whitespace().enumerate().map(|(k, w)| (k == 0, w)));
    for (i, (first, word)) in words.enumerate() {
        if first {
            starts.push(i as u64);
        }
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
    Ok((ids, starts))
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

/// Cuts `ids`, whose documents start at `starts` (ascending offsets, [`read_id_documents`]), into sequences of
/// `seq_len` tokens as [`pack`] does, each with its documents: a document that does not fit in the room left
/// goes on in the next sequence, its positions continuing ([`super::packing`]).
pub fn pack_documents(ids: &[u32], starts: &[u64], seq_len: usize, source: &str) -> Result<Vec<(Vec<u32>, Documents)>> {
    let seqs = pack(ids, seq_len, source)?;
    seqs.into_iter()
        .enumerate()
        .map(|(k, seq)| {
            let d = documents_in(starts, (k * seq_len) as u64, seq_len)
                .map_err(|e| TrainError::Data(format!("{source}: document starts {e}")))?;
            Ok((seq, d))
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use autosp_models::Tokenizer;

    #[test]
    fn packing_defaults_by_data_and_the_synthetic_tasks_take_none() {
        let text = DataSource::Text("a.jsonl".into());
        assert_eq!(text.packing(None).unwrap(), Some(Packing::Documents));
        assert_eq!(DataSource::Ids("f".into()).packing(None).unwrap(), Some(Packing::Stream));
        assert_eq!(DataSource::Ids("f".into()).packing(Some(Packing::Documents)).unwrap(), Some(Packing::Documents));
        assert_eq!(DataSource::Needles.packing(None).unwrap(), None);
        let e = DataSource::Passkey.packing(Some(Packing::Stream)).unwrap_err().to_string();
        assert!(e.contains("--packing stream") && e.contains("--data passkey is synthetic"), "{e}");
    }

    #[test]
    fn ids_are_read_and_packed() {
        let dir = tempfile::tempdir().unwrap();
        let ids = dir.path().join("ids.txt");
        std::fs::write(&ids, "1 2\n3 4 5").unwrap();
        assert_eq!(read_ids(&ids, 6).unwrap(), vec![1, 2, 3, 4, 5]);
        // Each line that holds ids is a document.
        std::fs::write(&ids, "1 2\n\n  \n3 4 5\n 0\n").unwrap();
        assert_eq!(read_id_documents(&ids, 6).unwrap(), (vec![1, 2, 3, 4, 5, 0], vec![0, 2, 5]));
        std::fs::write(&ids, "1 2\n3 4 5").unwrap();
        let e = read_ids(&ids, 5).unwrap_err().to_string();
        assert!(e.contains("token 4 is id 5, outside the model's vocabulary of 5"), "{e}");
        assert_eq!(pack(&[1, 2, 3, 4, 5], 2, "x").unwrap(), vec![vec![1, 2], vec![3, 4]]);
        let e = pack(&[1, 2, 3], 4, "x").unwrap_err().to_string();
        assert!(e.contains("--seq-len 4 is longer than the 3 tokens available in x"), "{e}");
        // Lines as documents: [1 2 3] [4] [5 6 7 8 9] in windows of 3; the third goes on across windows.
        let packed = pack_documents(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[0, 3, 4], 3, "x").unwrap();
        let cut: Vec<_> =
            packed.iter().map(|(s, d)| (s.clone(), d.cu_seqlens().to_vec(), d.first_position())).collect();
        assert_eq!(
            cut,
            vec![(vec![1, 2, 3], vec![0, 3], 0), (vec![4, 5, 6], vec![0, 1, 3], 0), (vec![7, 8, 9], vec![0, 3], 2)]
        );
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
