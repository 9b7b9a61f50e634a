//! A tokenised training corpus on disk: a text or JSONL file of any size tokenised once, streamed document by
//! document into a cache file beside it, and read back one window at a time, so no rank holds the corpus whole
//! and a second run (or every MPI process but the one that tokenises) skips the tokenising.
//!
//! The cache is `.{data file name}.autosp-{key}.tokens` next to the data: one little-endian u32 per token, bit
//! 31 set on the tokens that train (chat data: the assistant's; plain text: all); beside it
//! `.{data file name}.autosp-{key}.starts` records where each document starts (`starts.rs`), which
//! `--packing documents` gives every window ([`Corpus::documents`]). `key` is FNV-1a over the
//! format version, the data file's bytes, the tokenizer, the chat template, the model's EOS and the chat
//! layout, so any change makes a new cache. An index beside it records the data's size, modification time and
//! a hash of its first and last MiB, so an unchanged file is not hashed whole again; one process hashes and
//! tokenises under a lock while the others wait (`cache.rs`). It is written aside and renamed into place.
//!
//! Data: a JSONL file of `{"text": ..}` lines (documents, each tokenised as transformers' `tokenizer(text)`
//! then EOS, packed), of `{"messages": [..]}` lines (conversations, rendered with the model's chat template;
//! only the assistant's tokens train), or any other file as plain text: documents separated by blank lines,
//! each tokenised like a `"text"` line (one longer than 1 MiB in pieces cut at a line end). Conversations fill
//! the `seq_len` windows by the [`ChatLayout`]; one longer than a window keeps its end (`layout.rs`).

mod cache;
mod layout;
mod plain;
mod source;
mod starts;
mod tokenise;

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use autosp_core::ops::Documents;
use autosp_models::{ChatTemplate, Tokenizer};

use super::error::{IoContext, Result, TrainError};
use super::fingerprint::{fingerprint, fnv1a, Stamp, FNV_OFFSET};
use cache::CacheFiles;
pub use layout::ChatLayout;
use layout::TRAINED;
use source::{for_each_doc, kind_of, Kind};

/// The cache format's version (part of the key): v2 lays conversations out so that none straddles a window and
/// a long one keeps its answer, and splits plain text into documents; v3 writes the document starts beside
/// the tokens.
const FORMAT: &str = "autosp-corpus-v3";

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
    /// Put after each document (and pads conversations' windows).
    pub eos: Option<u32>,
    /// How conversations fill windows.
    pub layout: ChatLayout,
    /// The window length (conversations are laid out in windows of it).
    pub seq_len: usize,
}

/// The key of everything but the data that makes the cache: the format, the tokenizer, the EOS and, for
/// conversations, the template, the layout and the window length.
fn settings_key(kind: Kind, t: &Tokenising<'_>) -> u64 {
    let mut key = fnv1a(FNV_OFFSET, FORMAT.as_bytes());
    key = fnv1a(key, t.tokenizer_json.as_bytes());
    if kind == Kind::Chat {
        key = fnv1a(key, format!("{:?}", t.template).as_bytes());
        key = fnv1a(key, format!("{:?} {}", t.layout, t.seq_len).as_bytes());
    }
    fnv1a(key, format!("{:?}", t.eos).as_bytes())
}

impl Corpus {
    /// Reads `data` through without tokenising, failing as [`prepare`](Self::prepare) would on an empty file,
    /// a line that is not JSON or lacks its field (to report bad data before a missing tokenizer).
    pub fn check(data: &Path) -> Result<()> {
        for_each_doc(data, kind_of(data)?, |_| Ok(()))
    }

    /// The corpus of `data`, from its cache when one matches, else tokenised into it now. Many processes may
    /// call this at once (MPI ranks): one tokenises, the others wait for its cache (saying so on stderr every
    /// few seconds) and read it; a long tokenising says its progress on stderr.
    pub fn prepare(data: &Path, t: &Tokenising<'_>) -> Result<Self> {
        let kind = kind_of(data)?;
        if kind == Kind::Chat && t.template.is_none() {
            return Err(TrainError::Config(format!(
                "{} holds conversations (\"messages\"), and the model has no chat template (tokenizer_config.json's \
                 chat_template): give a model with one, or the data as {{\"text\": ..}} lines",
                data.display()
            )));
        }
        let chat = kind == Kind::Chat;
        let settings = settings_key(kind, t);
        let files = CacheFiles::new(data, settings);
        if let Some(c) = files.current()? {
            return Ok(Self { path: c.path, tokens: c.tokens, chat, fresh: false });
        }
        let mut lock = files.lock_for_tokenising()?;
        // Another process may have made it while this one waited.
        if let Some(c) = files.current()? {
            return Ok(Self { path: c.path, tokens: c.tokens, chat, fresh: false });
        }
        // The stamp before the hash: a change while hashing leaves a stamp that no longer matches.
        let stamp = Stamp::of(data)?;
        let (_, hash) = fingerprint(data)?;
        let key = fnv1a(settings, hash.as_bytes());
        let path = files.cache(key);
        if let Ok(meta) = std::fs::metadata(&path) {
            let tokens = meta.len() / 4;
            if starts::is_whole(&path, tokens) {
                files.record(&stamp, &hash, &path, tokens)?;
                return Ok(Self { tokens, path, chat, fresh: false });
            }
        }
        let tmp = files.partial();
        let tmp_starts = PathBuf::from(format!("{}.starts", tmp.display()));
        let written =
            tokenise::write_cache(data, kind, t, (&tmp, &tmp_starts), |done| lock.progress(done, stamp.bytes));
        let tokens = match written {
            Ok(n) => n,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                let _ = std::fs::remove_file(&tmp_starts);
                return Err(e);
            }
        };
        // The starts first: a cache in place has its starts.
        let starts_path = starts::path_of(&path);
        std::fs::rename(&tmp_starts, &starts_path)
            .io(|| format!("putting the document starts {} in place", starts_path.display()))?;
        std::fs::rename(&tmp, &path).io(|| format!("putting the token cache {} in place", path.display()))?;
        files.record(&stamp, &hash, &path, tokens)?;
        lock.done(tokens, stamp.bytes);
        Ok(Self { path, tokens, chat, fresh: true })
    }

    /// The number of whole `seq_len` windows.
    pub fn windows(&self, seq_len: usize) -> usize {
        (self.tokens / seq_len as u64) as usize
    }

    /// A line for the run's description: the tokens, the windows of `seq_len`, what trains and whether the
    /// cache was made now or read.
    pub fn describe(&self, seq_len: usize) -> String {
        format!(
            "data: {} tokens in {} windows of {seq_len}{} ({} {})",
            self.tokens,
            self.windows(seq_len),
            if self.chat { ", the assistant's tokens train" } else { "" },
            if self.fresh { "tokenised now into the cache" } else { "read from the cache" },
            self.path.display()
        )
    }

    /// Window `index` (`seq_len` tokens from token `index · seq_len`): its ids and the positions of its tokens
    /// that train (chat data; none for text, which trains on every token).
    pub fn window(&self, index: usize, seq_len: usize) -> Result<(Vec<u32>, Vec<usize>)> {
        let (ids, trained) = self.read(index as u64 * seq_len as u64, seq_len)?;
        let answers = if self.chat { (0..ids.len()).filter(|&i| trained[i]).collect() } else { Vec::new() };
        Ok((ids, answers))
    }

    /// The documents of the `len` tokens from token `start` ([`crate::train::packing::documents_in`]): where
    /// each document the cache recorded starts inside them, and the position in its document of the first
    /// token (a document split across windows goes on there).
    pub fn documents(&self, start: u64, len: usize) -> Result<Documents> {
        let s = starts::read_range(&self.path, start, start + len as u64)?;
        super::packing::documents_in(&s, start, len).map_err(|e| {
            TrainError::Data(format!(
                "the document starts of {} do not fit tokens {start}..{}: {e}; delete the cache to remake it",
                self.path.display(),
                start + len as u64
            ))
        })
    }

    /// Where the documents that tokens `from..to` belong to start: the last start at or before `from`, then
    /// every start before `to` (ascending token offsets into the cache).
    pub fn starts(&self, from: u64, to: u64) -> Result<Vec<u64>> {
        starts::read_range(&self.path, from, to)
    }

    /// The longest document in tokens (one pass over the starts).
    pub fn longest_document(&self) -> Result<u64> {
        starts::longest(&self.path, self.tokens)
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
        // Plain text is documents separated by blank lines; a JSONL line without "text" is refused naming the
        // line.
        let txt = dir.path().join("d.txt");
        std::fs::write(&txt, "{not json} a\n \n\nb\na\n").unwrap();
        assert_eq!(Corpus::prepare(&txt, &t).unwrap().read(0, 20).unwrap().0, vec![1, 0, 0, 0, 0, 3, 2, 1, 4, 3, 2]);
        std::fs::write(&txt, b"a\n\nb \xff").unwrap();
        let e = Corpus::prepare(&txt, &t).unwrap_err().to_string();
        assert!(e.contains("byte 5 is not UTF-8"), "{e}");
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

    /// The cache records where documents start; windows read them back (a document split across windows goes
    /// on at the next one's first position), a stream resumed mid-corpus draws the same windows with the same
    /// documents, and a cache whose starts are missing is remade.
    #[test]
    fn document_starts_survive_the_cache_and_a_resume() {
        use crate::train::{Packing, Position, Stream};
        let dir = tempfile::tempdir().unwrap();
        let tok = with_bos();
        let data = dir.path().join("d.jsonl");
        std::fs::write(&data, "{\"text\": \"a b\"}\n{\"text\": \"b\"}\n{\"text\": \"a a b\"}\n").unwrap();
        let t = tokenising(&tok, "tokenizer");
        let c = Corpus::prepare(&data, &t).unwrap();
        // [1 3 4 2] [1 4 2] [1 3 3 4 2]: documents start at 0, 4 and 7.
        assert_eq!(c.read(0, 12).unwrap().0, vec![1, 3, 4, 2, 1, 4, 2, 1, 3, 3, 4, 2]);
        assert_eq!(c.starts(0, 12).unwrap(), vec![0, 4, 7]);
        assert_eq!(c.longest_document().unwrap(), 5);
        let docs = |k: u64| {
            let d = c.documents(3 * k, 3).unwrap();
            (d.cu_seqlens().to_vec(), d.first_position())
        };
        assert_eq!(docs(0), (vec![0, 3], 0));
        assert_eq!(docs(1), (vec![0, 1, 3], 3));
        assert_eq!(docs(2), (vec![0, 1, 3], 2));
        assert_eq!(docs(3), (vec![0, 3], 2));
        let corpus = std::sync::Arc::new(c.clone());
        let stream = Stream::Corpus { corpus, seq_len: 3, packing: Packing::Documents, next: 0 };
        let mut whole = stream.clone();
        let drawn: Vec<_> = (0..6).map(|_| whole.next(3).unwrap()).collect();
        assert_eq!(drawn[1].labels(false), vec![2, -100, 4]);
        assert_eq!(drawn[4].documents, drawn[0].documents, "the stream cycles");
        let mut resumed = stream.clone();
        resumed.seek(Position { drawn: 2, rng: 0 });
        for s in &drawn[2..] {
            let r = resumed.next(3).unwrap();
            assert_eq!((&r.ids, &r.documents), (&s.ids, &s.documents));
        }
        // Stream packing: the same windows, no documents.
        let mut blind =
            Stream::Corpus { corpus: std::sync::Arc::new(c.clone()), seq_len: 3, packing: Packing::Stream, next: 0 };
        let b = blind.next(3).unwrap();
        assert_eq!((b.ids, b.documents), (drawn[0].ids.clone(), None));
        // A cache without its starts (an older format's, or cut short) is remade.
        std::fs::remove_file(starts::path_of(&c.path)).unwrap();
        let again = Corpus::prepare(&data, &t).unwrap();
        assert!(again.fresh && again.path == c.path);
        assert_eq!(again.starts(0, 12).unwrap(), vec![0, 4, 7]);
    }

    /// The names of the files in `dir` holding `part`.
    fn named(dir: &Path, part: &str) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.contains(part))
            .collect();
        v.sort();
        v
    }

    /// An unchanged file (same size, time and end MiBs) is trusted without hashing it whole: a change in its
    /// middle that keeps those goes unseen, by design. A touched file is hashed whole and, its bytes being the
    /// same, keeps its cache; a file changed at an end makes a new one. Long documents are cut into pieces
    /// without losing a token.
    #[test]
    fn the_index_decides_cheaply_and_the_whole_hash_decides_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let tok = with_bos();
        let t = tokenising(&tok, "tokenizer");
        let data = dir.path().join("big.txt");
        // 3 MiB of one document (lines of a long unknown word, `a` and `b`: few tokens, little memory for the
        // tests beside this one that measure the heap): cut in pieces, the same tokens as one document.
        let line = format!("{} a b\n", "x".repeat(60));
        let mut bytes = line.repeat((3 << 20) / line.len()).into_bytes();
        std::fs::write(&data, &bytes).unwrap();
        let set_time = |secs: u64| {
            let f = std::fs::File::options().write(true).open(&data).unwrap();
            f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)).unwrap();
        };
        set_time(1_000_000);
        let c = Corpus::prepare(&data, &t).unwrap();
        let words = bytes.len() / line.len() * 3;
        assert!(c.fresh && c.tokens == words as u64 + 2, "{} tokens for {words} words", c.tokens);
        let (ids, _) = c.read(0, 8).unwrap();
        assert_eq!(ids, [1, 0, 3, 4, 0, 3, 4, 0]);
        assert_eq!(c.read(c.tokens - 2, 2).unwrap().0, [4, 2]);
        // One document, whatever the pieces.
        assert_eq!((c.starts(0, c.tokens).unwrap(), c.longest_document().unwrap()), (vec![0], c.tokens));
        assert_eq!(named(dir.path(), ".index").len(), 1);
        assert!(named(dir.path(), ".lock").is_empty(), "the lock file goes with its holder");
        // A byte in the middle changed, size and time kept: the index is trusted.
        let middle = 3 << 19;
        bytes[middle] = if bytes[middle] == b'y' { b'z' } else { b'y' };
        std::fs::write(&data, &bytes).unwrap();
        set_time(1_000_000);
        let same = Corpus::prepare(&data, &t).unwrap();
        assert!(!same.fresh && same.path == c.path);
        // Touched: hashed whole, and its bytes (now another hash) make a new cache.
        set_time(2_000_000);
        let rehashed = Corpus::prepare(&data, &t).unwrap();
        assert!(rehashed.fresh && rehashed.path != c.path);
        // Touched again with the same bytes: hashed whole, the same cache, the index brought up to date.
        set_time(3_000_000);
        let touched = Corpus::prepare(&data, &t).unwrap();
        assert!(!touched.fresh && touched.path == rehashed.path);
        let index = std::fs::read_to_string(dir.path().join(&named(dir.path(), ".index")[0])).unwrap();
        assert!(index.contains("\"3000000000000000\""), "{index}");
        // The first bytes' cache stays beside (it is current again if they come back).
        assert_eq!(named(dir.path(), ".tokens").len(), 2);
    }

    /// Processes (here threads: `flock` locks belong to open files) that prepare at once wait for the one
    /// that tokenises and read its cache; one whose lock holder goes away without a cache tokenises itself.
    #[test]
    fn one_tokenises_while_the_others_wait() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("d.txt");
        std::fs::write(&data, "a b\n\n".repeat(40_000)).unwrap();
        let tok = with_bos();
        let results: Vec<Corpus> = std::thread::scope(|s| {
            let workers: Vec<_> =
                (0..4).map(|_| s.spawn(|| Corpus::prepare(&data, &tokenising(&tok, "tok")).unwrap())).collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        assert_eq!(results.iter().filter(|c| c.fresh).count(), 1, "{results:?}");
        assert!(results.iter().all(|c| c.path == results[0].path && c.tokens == 160_000));

        // The lock held by a "process" that dies (drops it) with no cache made: the waiter makes it.
        let t = tokenising(&tok, "another tokenizer");
        let files = CacheFiles::new(&data, settings_key(Kind::Plain, &t));
        let held = files.lock_for_tokenising().unwrap();
        // What it had half written when it died.
        let stale = files.partial();
        std::fs::write(&stale, "half").unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let c = Corpus::prepare(&data, &t).unwrap();
                done.store(true, std::sync::atomic::Ordering::SeqCst);
                c
            });
            std::thread::sleep(std::time::Duration::from_millis(400));
            assert!(!done.load(std::sync::atomic::Ordering::SeqCst), "prepare must wait for the lock");
            drop(held);
            let c = waiter.join().unwrap();
            assert!(c.fresh && c.tokens == 160_000);
            assert!(!stale.exists(), "the dead holder's partial file is removed");
        });
    }
}
