//! The documents of a data file, read a line (JSONL) or a paragraph (plain text) at a time: what a file holds
//! ([`Kind`]), and each document or conversation in order with where it starts ([`for_each_doc`]).

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde_json::Value;

use super::plain::{Paragraphs, ReadError, DOCUMENT_CAP};
use crate::train::error::{IoContext, Result, TrainError};

/// What a data file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Plain text: documents separated by blank lines.
    Plain,
    /// JSONL documents (`"text"`).
    Documents,
    /// JSONL conversations (`"messages"`).
    Chat,
}

/// One document (or a piece of one) or conversation of a data file.
pub(super) enum Doc {
    /// Text: a document, or a piece of one (plain text cuts documents longer than a cap).
    Text {
        /// The text.
        text: String,
        /// Whether it starts its document (it gets the tokenizer's special tokens).
        first: bool,
        /// Whether it ends its document (EOS follows it).
        last: bool,
    },
    /// A conversation's messages.
    Chat(Vec<Value>),
}

/// A [`Doc`] with where it is.
pub(super) struct Item {
    /// The document.
    pub doc: Doc,
    /// The 1-based line of the file it starts on.
    pub line: usize,
    /// Bytes of the file read through when it was handed on.
    pub read: u64,
}

/// What `path` holds (by its extension and first line); an empty (or blank) file is refused.
pub(super) fn kind_of(path: &Path) -> Result<Kind> {
    let f = std::fs::File::open(path).io(|| format!("reading training data {}", path.display()))?;
    let blank = BufReader::new(f).bytes().all(|b| b.is_ok_and(|b| b.is_ascii_whitespace()));
    if blank {
        return Err(TrainError::Data(format!(
            "training data {} is empty: give a file with text (or --data passkey)",
            path.display()
        )));
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    if ext != "jsonl" && ext != "json" {
        return Ok(Kind::Plain);
    }
    let f = std::fs::File::open(path).io(|| format!("reading training data {}", path.display()))?;
    for line in BufReader::new(f).lines() {
        let line = line.io(|| format!("reading training data {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line).map_err(|e| {
            TrainError::Data(format!(
                "{} line 1: not JSON ({e}); a JSONL data file holds one JSON object with a \"text\" string or a \
                 \"messages\" list per line (use a .txt extension for plain text)",
                path.display()
            ))
        })?;
        return Ok(if v.get("messages").is_some() { Kind::Chat } else { Kind::Documents });
    }
    Ok(Kind::Documents)
}

/// Calls `each` on every document (or conversation) of `data`, in order, holding one at a time (plain text: a
/// paragraph, at most [`DOCUMENT_CAP`] bytes of it); fails naming the line of one that is not JSON or lacks
/// its field, or of text that is not UTF-8.
pub(super) fn for_each_doc(data: &Path, kind: Kind, mut each: impl FnMut(Item) -> Result<()>) -> Result<()> {
    let f = std::fs::File::open(data).io(|| format!("reading training data {}", data.display()))?;
    let reader = BufReader::with_capacity(1 << 16, f);
    if kind == Kind::Plain {
        let mut docs = Paragraphs::new(reader, DOCUMENT_CAP);
        loop {
            let piece = match docs.next_piece() {
                Ok(Some(p)) => p,
                Ok(None) => return Ok(()),
                Err(ReadError::Io(e)) => {
                    return Err(TrainError::io(format!("reading training data {}", data.display()), e))
                }
                Err(ReadError::NotUtf8(at)) => {
                    return Err(TrainError::Data(format!(
                        "{}: byte {at} is not UTF-8 text; plain-text data must be UTF-8 (convert it, e.g. with iconv)",
                        data.display()
                    )))
                }
            };
            let doc = Doc::Text { text: piece.text, first: piece.first, last: piece.last };
            each(Item { doc, line: piece.line, read: piece.read })?;
        }
    }
    let mut reader = reader;
    let (mut line, mut read, mut number) = (String::new(), 0u64, 0usize);
    loop {
        line.clear();
        let n = reader.read_line(&mut line).io(|| format!("reading training data {}", data.display()))?;
        if n == 0 {
            return Ok(());
        }
        read += n as u64;
        number += 1;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {number}", data.display());
        let v: Value = serde_json::from_str(&line).map_err(|e| {
            TrainError::Data(format!(
                "{}: not JSON ({e}); a JSONL data file holds one JSON object with a \"text\" string or a \
                 \"messages\" list per line (use a .txt extension for plain text)",
                at()
            ))
        })?;
        let doc = match kind {
            Kind::Chat => match v.get("messages").and_then(Value::as_array) {
                Some(m) => Doc::Chat(m.clone()),
                None => {
                    return Err(TrainError::Data(format!(
                        "{}: no \"messages\" list (the file's first line has one)",
                        at()
                    )))
                }
            },
            _ => match v.get("text").and_then(Value::as_str) {
                Some(t) => Doc::Text { text: t.to_string(), first: true, last: true },
                None => {
                    return Err(TrainError::Data(format!(
                        "{}: no \"text\" string field (the file's first line has one)",
                        at()
                    )))
                }
            },
        };
        each(Item { doc, line: number, read })?;
    }
}
