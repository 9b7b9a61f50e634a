//! A tokenised training corpus on disk: a text or JSONL file tokenised once, streamed document by document
//! into a cache file beside it, and read back one sequence at a time, so no rank holds the corpus whole and
//! a second run (or every MPI process after the first) skips the tokenising.
//!
//! The cache is `.{data file name}.autosp-{key}.tokens` next to the data: one little-endian u32 per token, bit
//! 31 set on the tokens that train (chat data: the assistant's; plain text: all). `key` is FNV-1a over the
//! format version, the data file's bytes, the tokenizer, the chat template, the model's EOS and the chat
//! layout, so any change makes a new cache. It is written aside and renamed into place (processes that race
//! write the same bytes).
//!
//! Data: a JSONL file of `{"text": ..}` lines (documents, each tokenised as transformers' `tokenizer(text)`
//! then EOS, packed), of `{"messages": [..]}` lines (conversations, rendered with the model's chat template;
//! only the assistant's tokens train), or any other file as one plain-text document. Conversations are packed
//! one after another into `seq_len` windows ([`ChatLayout::Pack`]), or each starts a window of its own,
//! cut at `seq_len` and padded with untrained EOS tokens ([`ChatLayout::Truncate`]).

use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use autosp_models::tokenizer::encode_document;
use autosp_models::{ChatTemplate, Tokenizer};

use super::error::{IoContext, Result, TrainError};
use super::fingerprint::{fingerprint, fnv1a, FNV_OFFSET};

/// The cache format's version (part of the key).
const FORMAT: &str = "autosp-corpus-v1";
/// The bit of a cached token that says it trains.
const TRAINED: u32 = 1 << 31;

/// How conversations fill the training windows (`--chat-layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatLayout {
    /// One after another, cut into `seq_len` windows (a conversation may span two).
    Pack,
    /// One per window: cut at `seq_len`, padded with untrained EOS tokens.
    Truncate,
}

impl std::str::FromStr for ChatLayout {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "pack" => Ok(ChatLayout::Pack),
            "truncate" => Ok(ChatLayout::Truncate),
            _ => Err(format!("`{s}` is not a chat layout: use pack or truncate")),
        }
    }
}

/// What a data file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Plain text, one document.
    Plain,
    /// JSONL documents (`"text"`).
    Documents,
    /// JSONL conversations (`"messages"`).
    Chat,
}

/// A tokenised corpus in its cache file.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// The cache file.
    pub path: PathBuf,
    /// Tokens in it.
    pub tokens: u64,
    /// Whether it is conversations (only some tokens train).
    pub chat: bool,
    /// Whether this call tokenised it (`false`: the cache was there).
    pub fresh: bool,
}

/// What tokenising needs: the tokenizer (and its `tokenizer.json` text, part of the key), the chat template,
/// the model's EOS, the chat layout and the window length.
pub struct Tokenising<'a> {
    /// The tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Its serialised form (the cache key).
    pub tokenizer_json: &'a str,
    /// The model's chat template, for conversations.
    pub template: Option<&'a ChatTemplate>,
    /// Put after each document (and pads truncated conversations).
    pub eos: Option<u32>,
    /// How conversations fill windows.
    pub layout: ChatLayout,
    /// The window length (truncated conversations' length).
    pub seq_len: usize,
}

/// What `path` holds (by its extension and first line); an empty (or blank) file is refused.
fn kind_of(path: &Path) -> Result<Kind> {
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
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
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

impl Corpus {
    /// Reads `data` through without tokenising, failing as [`prepare`](Self::prepare) would on an empty file,
    /// a line that is not JSON or lacks its field (to report bad data before a missing tokenizer).
    pub fn check(data: &Path) -> Result<()> {
        for_each_doc(data, kind_of(data)?, |_| Ok(()))
    }

    /// The corpus of `data`, from its cache when one matches, else tokenised into it now.
    pub fn prepare(data: &Path, t: &Tokenising<'_>) -> Result<Self> {
        let kind = kind_of(data)?;
        if kind == Kind::Chat && t.template.is_none() {
            return Err(TrainError::Config(format!(
                "{} holds conversations (\"messages\"), and the model has no chat template (tokenizer_config.json's \
                 chat_template): give a model with one, or the data as {{\"text\": ..}} lines",
                data.display()
            )));
        }
        let (_, file_hash) = fingerprint(data)?;
        let mut key = fnv1a(FNV_OFFSET, FORMAT.as_bytes());
        key = fnv1a(key, file_hash.as_bytes());
        key = fnv1a(key, t.tokenizer_json.as_bytes());
        if kind == Kind::Chat {
            key = fnv1a(key, format!("{:?}", t.template).as_bytes());
            key = fnv1a(key, format!("{:?} {}", t.layout, t.seq_len).as_bytes());
        }
        key = fnv1a(key, format!("{:?}", t.eos).as_bytes());
        let name = data.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
        let dir = data.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let path = dir.join(format!(".{name}.autosp-{key:016x}.tokens"));
        let chat = kind == Kind::Chat;
        if let Ok(meta) = std::fs::metadata(&path) {
            return Ok(Self { tokens: meta.len() / 4, path, chat, fresh: false });
        }
        let tmp = dir.join(format!(".{name}.autosp-{key:016x}.tokens.partial-{}", std::process::id()));
        let written = write_cache(data, kind, t, &tmp);
        let tokens = match written {
            Ok(n) => n,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        std::fs::rename(&tmp, &path).io(|| format!("putting the token cache {} in place", path.display()))?;
        Ok(Self { path, tokens, chat, fresh: true })
    }

    /// The number of whole `seq_len` windows.
    pub fn windows(&self, seq_len: usize) -> usize {
        (self.tokens / seq_len as u64) as usize
    }

    /// Window `index` (`seq_len` tokens from token `index · seq_len`): its ids and the positions of its tokens
    /// that train (chat data; none for text, which trains on every token).
    pub fn window(&self, index: usize, seq_len: usize) -> Result<(Vec<u32>, Vec<usize>)> {
        let (ids, trained) = self.read(index as u64 * seq_len as u64, seq_len)?;
        let answers = if self.chat { (0..ids.len()).filter(|&i| trained[i]).collect() } else { Vec::new() };
        Ok((ids, answers))
    }

    /// `len` tokens from token `start` (fewer at the end): the ids and whether each trains.
    pub fn read(&self, start: u64, len: usize) -> Result<(Vec<u32>, Vec<bool>)> {
        let mut f =
            std::fs::File::open(&self.path).io(|| format!("reading the token cache {}", self.path.display()))?;
        f.seek(SeekFrom::Start(start * 4)).io(|| format!("reading the token cache {}", self.path.display()))?;
        let n = len.min(self.tokens.saturating_sub(start) as usize);
        let mut buf = vec![0u8; n * 4];
        f.read_exact(&mut buf).io(|| format!("reading the token cache {} (was it changed?)", self.path.display()))?;
        let words: Vec<u32> = buf.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok((words.iter().map(|w| w & !TRAINED).collect(), words.iter().map(|w| w & TRAINED != 0).collect()))
    }
}

/// Tokenises `data` into `tmp`, document by document; returns the token count.
fn write_cache(data: &Path, kind: Kind, t: &Tokenising<'_>, tmp: &Path) -> Result<u64> {
    if kind == Kind::Chat && t.layout == ChatLayout::Truncate && t.eos.is_none() {
        return Err(TrainError::Config(
            "--chat-layout truncate pads conversations with the model's EOS, and the model has none: use pack".into(),
        ));
    }
    let out = std::fs::File::create(tmp).io(|| format!("writing the token cache {}", tmp.display()))?;
    let mut out = BufWriter::new(out);
    let mut count = 0u64;
    let mut put = |ids: &[u32], trained: &[bool]| -> Result<()> {
        for (i, &id) in ids.iter().enumerate() {
            let w = if trained[i] { id | TRAINED } else { id };
            out.write_all(&w.to_le_bytes()).io(|| format!("writing the token cache {}", tmp.display()))?;
        }
        count += ids.len() as u64;
        Ok(())
    };
    tokenise_into(data, kind, t, &mut put)?;
    out.flush().io(|| format!("writing the token cache {}", tmp.display()))?;
    out.into_inner()
        .map_err(|e| TrainError::io(format!("writing the token cache {}", tmp.display()), e.into_error()))?
        .sync_all()
        .io(|| format!("writing the token cache {}", tmp.display()))?;
    if count == 0 {
        return Err(TrainError::Data(format!(
            "training data {} holds no tokens: give a file with text (or --data passkey)",
            data.display()
        )));
    }
    Ok(count)
}

/// One document or conversation of a data file.
enum Doc<'a> {
    /// A document's text.
    Text(&'a str),
    /// A conversation's messages.
    Chat(&'a [serde_json::Value]),
}

/// Calls `each` on every document (or conversation) of `data`, in order; fails naming the line of one that is
/// not JSON or lacks its field.
fn for_each_doc(data: &Path, kind: Kind, mut each: impl FnMut(Doc<'_>) -> Result<()>) -> Result<()> {
    if kind == Kind::Plain {
        let text = std::fs::read_to_string(data).io(|| format!("reading training data {}", data.display()))?;
        return each(Doc::Text(&text));
    }
    let f = std::fs::File::open(data).io(|| format!("reading training data {}", data.display()))?;
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.io(|| format!("reading training data {}", data.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", data.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
            TrainError::Data(format!(
                "{}: not JSON ({e}); a JSONL data file holds one JSON object with a \"text\" string or a \
                     \"messages\" list per line (use a .txt extension for plain text)",
                at()
            ))
        })?;
        let doc = match kind {
            Kind::Chat => Doc::Chat(v.get("messages").and_then(|m| m.as_array()).ok_or_else(|| {
                TrainError::Data(format!("{}: no \"messages\" list (the file's first line has one)", at()))
            })?),
            _ => Doc::Text(v.get("text").and_then(|x| x.as_str()).ok_or_else(|| {
                TrainError::Data(format!("{}: no \"text\" string field (the file's first line has one)", at()))
            })?),
        };
        each(doc).map_err(|e| match e {
            TrainError::Data(m) => TrainError::Data(format!("{}: {m}", at())),
            e => e,
        })?;
    }
    Ok(())
}

/// Hands every document's (or conversation's) tokens to `put`, with whether each trains.
fn tokenise_into(
    data: &Path,
    kind: Kind,
    t: &Tokenising<'_>,
    mut put: impl FnMut(&[u32], &[bool]) -> Result<()>,
) -> Result<()> {
    for_each_doc(data, kind, |doc| match doc {
        Doc::Text(text) => {
            let mut ids = encode_document(t.tokenizer, text)?;
            if let Some(e) = t.eos.filter(|&e| ids.last() != Some(&e)) {
                ids.push(e);
            }
            put(&ids, &vec![true; ids.len()])
        }
        Doc::Chat(messages) => {
            let template = t.template.expect("checked: chat data has a template");
            let (mut ids, mut trained) =
                template.encode(t.tokenizer, messages).map_err(|e| TrainError::Data(e.to_string()))?;
            if t.layout == ChatLayout::Truncate {
                ids.resize(t.seq_len, t.eos.unwrap_or(0));
                trained.resize(t.seq_len, false);
            }
            put(&ids, &trained)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::data::tests::with_bos;

    fn tokenising<'a>(tok: &'a Tokenizer, json: &'a str) -> Tokenising<'a> {
        Tokenising {
            tokenizer: tok,
            tokenizer_json: json,
            template: None,
            eos: Some(2),
            layout: ChatLayout::Pack,
            seq_len: 4,
        }
    }

    #[test]
    fn documents_are_tokenised_once_into_a_cache_beside_the_data_and_read_back_by_window() {
        let dir = tempfile::tempdir().unwrap();
        let tok = with_bos();
        let data = dir.path().join("d.jsonl");
        std::fs::write(&data, "{\"text\": \"a b\"}\n\n{\"text\": \"b\"}\n").unwrap();
        let t = tokenising(&tok, "tokenizer one");
        let c = Corpus::prepare(&data, &t).unwrap();
        // Each document with the tokenizer's BOS, then EOS: [1 3 4 2] [1 4 2].
        assert!(c.fresh && !c.chat);
        assert_eq!(c.tokens, 7);
        assert_eq!(c.read(0, 10).unwrap().0, vec![1, 3, 4, 2, 1, 4, 2]);
        assert_eq!(c.windows(3), 2);
        assert_eq!(c.window(1, 3).unwrap(), (vec![2, 1, 4], vec![]));
        assert!(
            c.path.parent() == Some(dir.path())
                && c.path.file_name().unwrap().to_string_lossy().starts_with(".d.jsonl.autosp-")
        );
        // The second time the cache is read, not made; another tokenizer or changed data make a new one.
        let again = Corpus::prepare(&data, &t).unwrap();
        assert!(!again.fresh && again.path == c.path);
        let other = Corpus::prepare(&data, &tokenising(&tok, "tokenizer two")).unwrap();
        assert!(other.fresh && other.path != c.path);
        std::fs::write(&data, "{\"text\": \"a\"}\n").unwrap();
        let changed = Corpus::prepare(&data, &t).unwrap();
        assert!(changed.fresh && changed.path != c.path && changed.tokens == 3);
        // Plain text is one document; a JSONL line without "text" is refused naming the line.
        let txt = dir.path().join("d.txt");
        std::fs::write(&txt, "{not json} a").unwrap();
        assert_eq!(Corpus::prepare(&txt, &t).unwrap().read(0, 9).unwrap().0, vec![1, 0, 0, 0, 0, 3, 2]);
        std::fs::write(&data, "{\"text\": \"a\"}\n{\"body\": 1}\n").unwrap();
        let e = Corpus::prepare(&data, &t).unwrap_err().to_string();
        assert!(e.contains("line 2: no \"text\" string field"), "{e}");
        // Conversations need a chat template.
        std::fs::write(&data, "{\"messages\": []}\n").unwrap();
        let e = Corpus::prepare(&data, &t).unwrap_err().to_string();
        assert!(e.contains("no chat template"), "{e}");
        // No partial files are left behind.
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| {
                let n = e.unwrap().file_name().to_string_lossy().to_string();
                n.contains("partial").then_some(n)
            })
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
