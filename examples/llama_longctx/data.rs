//! Training data: the synthetic passkey-retrieval generator (a number hidden in long filler, asked for at
//! the end), JSONL / plain-text loaders tokenised with the model's tokenizer, `ids:FILE` token-id files, and
//! packing into sequences of `--seq-len` tokens. Every stream has a position (and the passkey stream a
//! random state) that checkpoints save, so a resumed run sees exactly the data it would have seen.

use std::path::Path;

use anyhow::{bail, Context, Result};
use autosp::models::rng::SplitMix64 as Rng;
use autosp::models::tokenizer::encode;
use autosp::models::Tokenizer;

use crate::task::Needles;

/// One training or probe sequence: `ids` of exactly `seq_len` tokens; `answers`: the positions of the tokens
/// a synthetic task scores (the passkey's digits, the needles' answers; empty for text data).
#[derive(Clone, Debug)]
pub struct Sample {
    pub ids: Vec<u32>,
    pub answers: Vec<usize>,
}

impl Sample {
    /// Labels that train on the answers only: each answer's token at its position, -100 (ignored) elsewhere.
    pub fn answer_labels(&self) -> Vec<i64> {
        let mut labels = vec![-100i64; self.ids.len()];
        for &a in &self.answers {
            labels[a] = i64::from(self.ids[a]);
        }
        labels
    }
}

/// Passkey digits per key.
const DIGITS: usize = 5;

/// The shortest passkey sequence (besides what the fixed text needs).
const MIN_PASSKEY_LEN: usize = 64;

/// How passkey text is spelled: with fixed token ids (a tiny model without a tokenizer), or as English
/// text through the model's tokenizer.
#[derive(Clone)]
pub enum PasskeyVocab {
    /// `1` BOS, `2` EOS, `3` "the pass key is", `4` "what is", `5` ".", `10..20` the digits 0-9, `20..vocab`
    /// filler words.
    Ids { vocab: usize },
    /// English text through the tokenizer (the standard passkey prompt).
    Text(Box<Tokenizer>),
}

/// Synthetic passkey retrieval: filler (a phrase of random filler words repeated, as the standard passkey
/// test repeats "The grass is green. The sky is blue..."), a key of five digits hidden at a random depth,
/// more filler, and at the end the question followed by the answer. Models learn it by copying from the
/// earlier occurrence (induction), the skill long-context retrieval needs.
#[derive(Clone)]
pub struct Passkey {
    vocab: PasskeyVocab,
    seq_len: usize,
    pub rng: Rng,
}

impl Passkey {
    /// A generator of `seq_len`-token samples. Refuses a `seq_len` shorter than the fixed text of a sample
    /// (instructions, key, question, answer) as the tokenizer spells it, naming the smallest that works.
    pub fn new(vocab: PasskeyVocab, seq_len: usize, seed: u64) -> Result<Self> {
        if let PasskeyVocab::Ids { vocab } = vocab {
            if vocab < 40 {
                bail!("the passkey task needs a vocabulary of at least 40 tokens; the model has {vocab}");
            }
        }
        let g = Self { vocab, seq_len, rng: Rng::new(seed ^ 0x005E_ED0F_9A55_CE11) };
        // Keys of one repeated digit stand for all keys (a tokenizer that merges digits could still spell
        // some key longer: `assemble` refuses that sample rather than cut it).
        let mut fixed = 0;
        for d in 0..10 {
            fixed = fixed.max(g.parts(&[d; DIGITS])?.fixed_len());
        }
        let smallest = fixed.max(MIN_PASSKEY_LEN);
        if seq_len < smallest {
            bail!("{}", too_short(seq_len, fixed, smallest));
        }
        Ok(g)
    }

    /// The next sample (advances the random state).
    pub fn sample(&mut self) -> Result<Sample> {
        let key: Vec<usize> = (0..DIGITS).map(|_| self.rng.below(0..10)).collect();
        let depth = self.rng.below(10..80);
        assemble(self.parts(&key)?, self.seq_len, depth)
    }

    /// The pieces of the sample hiding `key` (digits 0-9).
    fn parts(&self, key: &[usize]) -> Result<Parts> {
        match &self.vocab {
            PasskeyVocab::Ids { vocab } => {
                let vocab = *vocab;
                // One fixed filler phrase, the same in every sample (as the standard test repeats one text).
                let mut words = Rng::new(0x00F1_11E4);
                let phrase: Vec<u32> = (0..24).map(|_| words.below(20..vocab) as u32).collect();
                let digits: Vec<u32> = key.iter().map(|&d| 10 + d as u32).collect();
                let needle: Vec<u32> = [vec![3], digits.clone(), vec![5]].concat();
                let question: Vec<u32> = vec![4, 3];
                Ok(Parts { start: vec![1], phrase, needle, question, answer: digits, end: vec![2] })
            }
            PasskeyVocab::Text(tok) => {
                let key_text: String = key.iter().map(|d| char::from(b'0' + *d as u8)).collect();
                let enc = |s: &str| encode(tok, s).map_err(anyhow::Error::from);
                Ok(Parts {
                    start: enc("There is important information hidden inside a lot of irrelevant text. Find it and \
                         memorize it. ")?,
                    phrase: enc(
                        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ",
                    )?,
                    needle: enc(&format!("The pass key is {key_text}. Remember it. {key_text} is the pass key. "))?,
                    question: enc("What is the pass key? The pass key is")?,
                    answer: enc(&format!(" {key_text}"))?,
                    end: enc(".")?,
                })
            }
        }
    }
}

/// The error for a `--seq-len` below what the passkey sample needs.
fn too_short(seq_len: usize, fixed: usize, smallest: usize) -> String {
    format!(
        "--seq-len {seq_len} is too short for the passkey task: a sample's fixed text (instructions, key, question \
         and answer) takes {fixed} tokens with this model's tokenizer, and a sample is at least {MIN_PASSKEY_LEN} \
         tokens; the smallest --seq-len that works is {smallest}"
    )
}

/// A passkey sample's token pieces: `start`, the filler `phrase` (repeated), the `needle` holding the key,
/// the `question`, the `answer` and the `end`.
struct Parts {
    start: Vec<u32>,
    phrase: Vec<u32>,
    needle: Vec<u32>,
    question: Vec<u32>,
    answer: Vec<u32>,
    end: Vec<u32>,
}

impl Parts {
    /// Tokens of everything but the filler.
    fn fixed_len(&self) -> usize {
        self.start.len() + self.needle.len() + self.question.len() + self.answer.len() + self.end.len()
    }
}

/// `start`, filler, `needle` at `depth` percent of the filler, filler, `question`, `answer`, `end`, filled to
/// exactly `seq_len` tokens (the filler absorbs the difference). Refuses (never cuts) when the fixed pieces
/// alone are longer than `seq_len`.
fn assemble(p: Parts, seq_len: usize, depth: usize) -> Result<Sample> {
    let fixed = p.fixed_len();
    if fixed > seq_len {
        bail!("{}", too_short(seq_len, fixed, fixed.max(MIN_PASSKEY_LEN)));
    }
    let filler_len = seq_len - fixed;
    let filler: Vec<u32> = p.phrase.iter().copied().cycle().take(filler_len).collect();
    let cut = filler_len * depth / 100;
    let mut ids = p.start;
    ids.extend_from_slice(&filler[..cut]);
    ids.extend_from_slice(&p.needle);
    ids.extend_from_slice(&filler[cut..]);
    ids.extend_from_slice(&p.question);
    let a = ids.len();
    ids.extend_from_slice(&p.answer);
    let answer_range = a..ids.len();
    ids.extend_from_slice(&p.end);
    debug_assert_eq!(ids.len(), seq_len);
    Ok(Sample { ids, answers: answer_range.collect() })
}

/// Whitespace-separated token ids from `path`, each below `vocab`.
pub fn read_ids(path: &Path, vocab: usize) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading token ids from {}", path.display()))?;
    let mut ids = Vec::new();
    for (i, word) in text.split_whitespace().enumerate() {
        let id: u32 = word.parse().map_err(|_| {
            anyhow::anyhow!(
                "{}: token {i} is `{word}`, not a token id: the file must hold whitespace-separated integers from 0 \
                 to {} (the model's vocabulary)",
                path.display(),
                vocab.saturating_sub(1)
            )
        })?;
        if id as usize >= vocab {
            bail!(
                "{}: token {i} is id {id}, outside the model's vocabulary of {vocab} (ids 0 to {}): the ids were \
                 made with another tokenizer; tokenise the text with this model's tokenizer",
                path.display(),
                vocab.saturating_sub(1)
            );
        }
        ids.push(id);
    }
    if ids.is_empty() {
        bail!("{}: no token ids (the file is empty): give whitespace-separated token ids", path.display());
    }
    Ok(ids)
}

/// The documents of a JSONL file (a "text" string on every non-empty line) or of a plain text file (the
/// whole file), by extension: `.jsonl` and `.json` are JSONL.
pub fn read_documents(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading training data {}", path.display()))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    if text.trim().is_empty() {
        bail!("training data {} is empty: give a file with text (or --data passkey)", path.display());
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
            anyhow::anyhow!(
                "{} line {}: not JSON ({e}); a JSONL data file holds one JSON object with a \"text\" string per \
                 line (use a .txt extension for plain text)",
                path.display(),
                i + 1
            )
        })?;
        match v.get("text").and_then(|t| t.as_str()) {
            Some(t) => docs.push(t.to_string()),
            None => bail!("{} line {}: no \"text\" string field in {}", path.display(), i + 1, short(line)),
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

/// Tokenises `docs` and joins them, with `eos` after each document when the model has one.
pub fn tokenize(tok: &Tokenizer, docs: &[String], eos: Option<u32>) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for d in docs {
        ids.extend(encode(tok, d)?);
        ids.extend(eos);
    }
    Ok(ids)
}

/// Cuts `ids` into sequences of `seq_len` tokens (the remainder is dropped); at least one must fit.
pub fn pack(ids: &[u32], seq_len: usize, source: &str) -> Result<Vec<Vec<u32>>> {
    if ids.len() < seq_len {
        bail!(
            "--seq-len {seq_len} is longer than the {} tokens available in {source}: lower --seq-len or give more data",
            ids.len()
        );
    }
    Ok(ids.chunks_exact(seq_len).map(<[u32]>::to_vec).collect())
}

/// A stream of training sequences with a saveable position.
#[derive(Clone)]
pub enum Stream {
    /// Fresh passkey samples.
    Passkey(Passkey),
    /// Fresh needles samples (trained on their answers only), of the curriculum's length.
    Needles(Needles),
    /// Packed sequences, in order, cycling.
    Packed { seqs: Vec<Vec<u32>>, next: usize },
}

/// Where a stream is: what checkpoints save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// Sequences drawn so far.
    pub drawn: u64,
    /// The passkey generator's random state (0 for packed data).
    pub rng: u64,
}

impl Stream {
    /// Whether training scores only each sample's answers (the needles task) rather than every token.
    pub fn answers_only(&self) -> bool {
        matches!(self, Stream::Needles(_))
    }

    /// The next training sequence, of `len` tokens (only the needles task takes other lengths than
    /// `--seq-len`).
    pub fn next(&mut self, len: usize) -> Result<Sample> {
        match self {
            Stream::Passkey(p) => p.sample(),
            Stream::Needles(g) => g.sample(len),
            Stream::Packed { seqs, next } => {
                let s = &seqs[*next % seqs.len()];
                *next += 1;
                Ok(Sample { ids: s.clone(), answers: Vec::new() })
            }
        }
    }

    /// Sequences drawn and random state.
    pub fn position(&self, drawn: u64) -> Position {
        match self {
            Stream::Passkey(p) => Position { drawn, rng: p.rng.state() },
            Stream::Needles(g) => Position { drawn, rng: g.rng.state() },
            Stream::Packed { .. } => Position { drawn, rng: 0 },
        }
    }

    /// Moves the stream to `pos` (resuming).
    pub fn seek(&mut self, pos: Position) {
        match self {
            Stream::Passkey(p) => p.rng = Rng::new(pos.rng),
            Stream::Needles(g) => g.rng = Rng::new(pos.rng),
            Stream::Packed { next, .. } => *next = pos.drawn as usize,
        }
    }
}
