//! [`Stream`]: the training sequences a run draws, in order, with a [`Position`] that checkpoints save so a
//! resumed run sees exactly the data it would have seen. [`Sample`] is one sequence with the positions a
//! synthetic task scores.

use autosp_models::rng::SplitMix64 as Rng;

use super::error::Result;
use super::synthetic::{Needles, Passkey};

/// One training or probe sequence: `ids` of exactly `seq_len` tokens; `answers`: the positions of the tokens
/// a synthetic task scores (the passkey's digits, the needles' answers; empty for text data).
#[derive(Clone, Debug)]
pub struct Sample {
    /// The token ids.
    pub ids: Vec<u32>,
    /// Positions into `ids` of the answer tokens, ascending.
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

/// A stream of training sequences with a saveable position.
#[derive(Clone)]
pub enum Stream {
    /// Fresh passkey samples.
    Passkey(Passkey),
    /// Fresh needles samples (trained on their answers only), of the curriculum's length.
    Needles(Needles),
    /// The windows of a tokenised corpus on disk, in order, cycling (read one at a time).
    Corpus {
        /// The corpus ([`super::corpus::Corpus`]).
        corpus: std::sync::Arc<super::corpus::Corpus>,
        /// Tokens per window.
        seq_len: usize,
        /// The index of the next one (modulo the count).
        next: usize,
    },
    /// Packed sequences, in order, cycling.
    Packed {
        /// The sequences ([`super::data::pack`]).
        seqs: Vec<Vec<u32>>,
        /// The index of the next one (modulo the count).
        next: usize,
    },
}

/// Where a stream is: what checkpoints save.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// Sequences drawn so far.
    pub drawn: u64,
    /// The synthetic generator's random state (0 for packed data).
    pub rng: u64,
}

impl Stream {
    /// Packed token sequences, from the first ([`super::data::pack`] cuts them).
    pub fn packed(seqs: Vec<Vec<u32>>) -> Self {
        Stream::Packed { seqs, next: 0 }
    }

    /// Whether training scores only each sample's answers (the needles task) rather than every token.
    pub fn answers_only(&self) -> bool {
        match self {
            Stream::Needles(_) => true,
            Stream::Corpus { corpus, .. } => corpus.chat,
            _ => false,
        }
    }

    /// The next training sequence, of `len` tokens (only the needles task takes other lengths than the
    /// generator's or the packing's).
    pub fn next(&mut self, len: usize) -> Result<Sample> {
        match self {
            Stream::Passkey(p) => p.sample(),
            Stream::Needles(g) => g.sample(len),
            Stream::Corpus { corpus, seq_len, next } => {
                let (ids, answers) = corpus.window(*next % corpus.windows(*seq_len).max(1), *seq_len)?;
                *next += 1;
                Ok(Sample { ids, answers })
            }
            Stream::Packed { seqs, next } => {
                let s = &seqs[*next % seqs.len()];
                *next += 1;
                Ok(Sample { ids: s.clone(), answers: Vec::new() })
            }
        }
    }

    /// The position after `drawn` sequences: that count and the random state.
    pub fn position(&self, drawn: u64) -> Position {
        match self {
            Stream::Passkey(p) => Position { drawn, rng: p.rng.state() },
            Stream::Needles(g) => Position { drawn, rng: g.rng.state() },
            Stream::Packed { .. } | Stream::Corpus { .. } => Position { drawn, rng: 0 },
        }
    }

    /// Moves the stream to `pos` (resuming).
    pub fn seek(&mut self, pos: Position) {
        match self {
            Stream::Passkey(p) => p.rng = Rng::new(pos.rng),
            Stream::Needles(g) => g.rng = Rng::new(pos.rng),
            Stream::Packed { next, .. } | Stream::Corpus { next, .. } => *next = pos.drawn as usize,
        }
    }
}
