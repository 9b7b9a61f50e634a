//! [`Stream`]: the training sequences a run draws, in order, with a [`Position`] that checkpoints save so a
//! resumed run sees exactly the data it would have seen. [`Sample`] is one sequence with the positions a
//! synthetic task scores and, packed by documents, its document boundaries.

use autosp_core::ops::Documents;
use autosp_models::rng::SplitMix64 as Rng;

use super::error::Result;
use super::packing::{ignore_boundary_labels, Packing};
use super::synthetic::{Needles, Passkey};

/// One training or probe sequence: `ids` of exactly `seq_len` tokens; `answers`: the positions of the tokens
/// a synthetic task scores (the passkey's digits, the needles' answers; empty for text data); `documents`:
/// its document boundaries under `--packing documents` ([`Packing`]).
#[derive(Clone, Debug)]
pub struct Sample {
    /// The token ids.
    pub ids: Vec<u32>,
    /// Positions into `ids` of the answer tokens, ascending.
    pub answers: Vec<usize>,
    /// The documents `ids` is packed from (cumulative lengths and the first token's position); `None`: one
    /// sequence, document-blind (`--packing stream`, synthetic data).
    pub documents: Option<Documents>,
}

impl Sample {
    /// The labels a training step takes for this sample: its answers' (`answers_only`) or every token's, with
    /// the first token of each document but the first ignored when it has documents, so that no document is
    /// trained on the one before it.
    pub fn labels(&self, answers_only: bool) -> Vec<i64> {
        let mut labels = match answers_only {
            true => self.answer_labels(),
            false => self.ids.iter().map(|&id| i64::from(id)).collect(),
        };
        if let Some(d) = &self.documents {
            ignore_boundary_labels(&mut labels, d);
        }
        labels
    }

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
        /// Whether windows carry their documents (read from the cache's document starts).
        packing: Packing,
        /// The index of the next one (modulo the count).
        next: usize,
    },
    /// Packed sequences, in order, cycling.
    Packed {
        /// The sequences ([`super::data::pack`]).
        seqs: Vec<Vec<u32>>,
        /// Each sequence's documents (`--packing documents`); `None`: document-blind.
        documents: Option<Vec<Documents>>,
        /// The index of the next one (modulo the count).
        next: usize,
    },
}

/// Where a stream is: what checkpoints save. It counts global samples: every rank draws every replica's
/// sequences of a micro-batch (the compiled step takes its own), so the position is the same on every rank and
/// a run resumed on another `--dp` goes on from the same sample of the same stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// Sequences drawn so far, over every replica.
    pub drawn: u64,
    /// The synthetic generator's random state (0 for packed data).
    pub rng: u64,
}

impl Stream {
    /// Packed token sequences, from the first ([`super::data::pack`] cuts them), document-blind.
    pub fn packed(seqs: Vec<Vec<u32>>) -> Self {
        Stream::Packed { seqs, documents: None, next: 0 }
    }

    /// Packed token sequences with their documents (one [`Documents`] per sequence, of its length), from the
    /// first ([`super::data::pack_documents`] makes them).
    pub fn packed_documents(seqs: Vec<(Vec<u32>, Documents)>) -> Self {
        let (seqs, documents) = seqs.into_iter().unzip();
        Stream::Packed { seqs, documents: Some(documents), next: 0 }
    }

    /// How the stream's windows are packed from documents; `None` for the synthetic tasks (a sample each).
    pub fn packing(&self) -> Option<Packing> {
        match self {
            Stream::Passkey(_) | Stream::Needles(_) => None,
            Stream::Corpus { packing, .. } => Some(*packing),
            Stream::Packed { documents, .. } => {
                Some(if documents.is_some() { Packing::Documents } else { Packing::Stream })
            }
        }
    }

    /// The lines that say how the windows are packed (none for the synthetic tasks), with a warning when a
    /// document split across windows takes its positions past `max_positions` (the model's
    /// `max_position_embeddings`).
    pub fn describe_packing(&self, max_positions: usize) -> Result<Vec<String>> {
        let longest = match (self, self.packing()) {
            (_, None) => return Ok(Vec::new()),
            (_, Some(Packing::Stream)) => {
                return Ok(vec!["packing: stream (document-blind: each window is one sequence, every token sees the \
                                whole window before it; --packing documents keeps attention within documents)"
                    .into()])
            }
            (Stream::Corpus { corpus, .. }, _) => corpus.longest_document()? as usize,
            (Stream::Packed { documents, .. }, _) => {
                documents.iter().flatten().map(Documents::position_extent).max().unwrap_or(0)
            }
            _ => 0,
        };
        let mut lines = vec![format!(
            "packing: documents (each token attends only to its own document, positions restart at each \
             document, no document's first token is trained on the one before; a document longer than the room \
             left in a window goes on in the next with its positions continuing); the longest document spans \
             {longest} positions"
        )];
        if longest > max_positions {
            lines.push(format!(
                "warning: --packing documents: the longest document spans {longest} positions, past the model's \
                 max_position_embeddings {max_positions}; extend the window (--rope-scaling), cut the long \
                 documents, or train with --packing stream"
            ));
        }
        Ok(lines)
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
            Stream::Corpus { corpus, seq_len, packing, next } => {
                let index = *next % corpus.windows(*seq_len).max(1);
                let (ids, answers) = corpus.window(index, *seq_len)?;
                let documents = match packing {
                    Packing::Documents => Some(corpus.documents((index * *seq_len) as u64, *seq_len)?),
                    Packing::Stream => None,
                };
                *next += 1;
                Ok(Sample { ids, answers, documents })
            }
            Stream::Packed { seqs, documents, next } => {
                let k = *next % seqs.len();
                *next += 1;
                Ok(Sample {
                    ids: seqs[k].clone(),
                    answers: Vec::new(),
                    documents: documents.as_ref().map(|d| d[k].clone()),
                })
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
