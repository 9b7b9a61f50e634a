//! The needles task (`llama_longctx`'s default, `--data needles`): multi-needle retrieval that only long context solves. Each sequence
//! draws one "needle" for each of C classes (one of the class's [`VALUES`] tokens), states the needles in
//! its first eighth (the evidence; each needle many times, see [`copies`]) and asks for every class once, in
//! another order, in the span from 5/8 to 3/4 of the sequence: a question token `Q_c`, then the answer, the
//! class-c token that the evidence held. Everything else is filler from its own range of tokens. The
//! evidence is at least half the sequence before every question (2048 tokens at 4096), and the ranks hold
//! them apart (rank 0 the evidence and rank 1 the questions at P = 2, under both the contiguous and the
//! zigzag layout), so nothing but attention across the shards tells an answer: a model that cannot see that
//! far is at chance, 1 in [`VALUES`] (it can know the class from the question, not the member).
//!
//! Training scores the answer tokens only (the filler is noise by construction), and the curriculum
//! ([`Curriculum::default_for`]) starts on short sequences, many per step, and doubles to `--seq-len` with the tokens per
//! step held constant: one attention head learns to match a question with its class's tokens quickly at
//! short length, and the last stages teach it the sharper attention that thousands of distractors need.

use autosp_models::rng::SplitMix64 as Rng;

use crate::train::error::{Result, TrainError};
use crate::train::stream::Sample;
use crate::train::Curriculum;
use crate::Compiled;
use autosp_models::LlamaModel;

/// Needle classes, one needle and one question each per sequence.
pub const CLASSES: usize = 6;

/// Tokens per class (a needle is one of them, uniformly): chance is 1 / VALUES.
pub const VALUES: usize = 16;

/// Copies of each needle in the evidence: the needles fill 3/4 of the evidence span (the rest is filler),
/// so they hold the same share of the sequence at every length.
pub fn copies(n: usize) -> usize {
    (Needles::evidence(n).len() * 3 / 4 / CLASSES).max(1)
}

/// The shortest sequence: the evidence (first eighth) needs room for several copies of [`CLASSES`] needles,
/// and the question span (an eighth, two tokens per question) for [`CLASSES`] questions.
pub const MIN_LEN: usize = 256;

/// The token ids of the task: filler, the classes' values (class c: `values[c * VALUES ..]`), the question
/// tokens (class c: `questions[c]`), and the BOS that starts every sample.
#[derive(Clone, Debug)]
pub struct Vocab {
    /// Filler tokens.
    pub filler: Vec<u32>,
    /// The classes' values, [`VALUES`] per class.
    pub values: Vec<u32>,
    /// The question tokens, one per class.
    pub questions: Vec<u32>,
    /// The first token of every sample.
    pub bos: u32,
}

impl Vocab {
    /// The task's tokens in a model vocabulary of `vocab` ids with no tokenizer (the demo model): values and
    /// questions at the top, the rest above the special ids 0-2 filler, BOS `bos` (the demo's 1).
    pub fn new(vocab: usize, bos: u32) -> Result<Self> {
        Self::from_ordinary((3..vocab as u32).collect(), bos, "the model's vocabulary")
    }

    /// The task's tokens among the ordinary tokens of `tokenizer` (never a special or added token, such as
    /// Llama 3's reserved ones, nor an id past the tokenizer's or the model's `vocab`), with the model's own
    /// `bos` (the tokenizer's first special token when the model has none).
    pub fn of_tokenizer(tokenizer: &autosp_models::Tokenizer, vocab: usize, bos: Option<u32>) -> Result<Self> {
        let added = tokenizer.get_added_tokens_decoder();
        let known = tokenizer.get_vocab_size(true).min(vocab) as u32;
        let ordinary: Vec<u32> = (0..known).filter(|id| !added.contains_key(id)).collect();
        let bos = bos.or_else(|| added.iter().filter(|(_, t)| t.special).map(|(&id, _)| id).min()).unwrap_or(1);
        Self::from_ordinary(ordinary, bos, "the tokenizer's ordinary tokens")
    }

    /// Values and questions from the top of `ordinary` (ascending), the rest filler; refuses fewer than 16
    /// filler tokens.
    fn from_ordinary(mut ordinary: Vec<u32>, bos: u32, what: &str) -> Result<Self> {
        let needed = CLASSES * VALUES + CLASSES + 16;
        if ordinary.len() < needed {
            return Err(TrainError::Config(format!(
                "the needles task needs at least {needed} tokens to draw from; {what} has {}",
                ordinary.len()
            )));
        }
        let values = ordinary.split_off(ordinary.len() - CLASSES * VALUES);
        let questions = ordinary.split_off(ordinary.len() - CLASSES);
        Ok(Self { filler: ordinary, values, questions, bos })
    }

    /// The class of value token `t`, if it is one.
    pub fn class_of(&self, t: u32) -> Option<usize> {
        self.values.iter().position(|&v| v == t).map(|i| i / VALUES)
    }
}

/// The generator of `--data needles` samples.
#[derive(Clone)]
pub struct Needles {
    vocab: Vocab,
    /// The random state (what a checkpoint saves).
    pub rng: Rng,
}

impl Needles {
    /// A generator drawing from `vocab` (see [`Vocab::new`] and [`Vocab::of_tokenizer`]).
    pub fn new(vocab: Vocab, seed: u64) -> Self {
        Self { vocab, rng: Rng::new(seed ^ 0x4EED_1E5C_1A55_E500) }
    }

    /// The evidence span of an `n`-token sample: positions 1 .. n/8 (0 holds the BOS token).
    pub fn evidence(n: usize) -> std::ops::Range<usize> {
        1..n / 8
    }

    /// The question span of an `n`-token sample: n*5/8 .. n*3/4 (two tokens per question).
    pub fn questions(n: usize) -> std::ops::Range<usize> {
        n * 5 / 8..n * 3 / 4
    }

    /// The shortest distance, in tokens, from a needle to a question about it in an `n`-token sample.
    pub fn min_distance(n: usize) -> usize {
        Self::questions(n).start - (Self::evidence(n).end - 1)
    }

    /// `k` distinct values of `0..slots`, in random order.
    fn distinct(&mut self, slots: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..slots).collect();
        for i in 0..k {
            let j = self.rng.below(i..slots);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }

    /// The next sample of `n` tokens (advances the random state); its `answers` are the answer positions.
    pub fn sample(&mut self, n: usize) -> Result<Sample> {
        if n < MIN_LEN {
            return Err(TrainError::Config(format!(
                "--seq-len {n} is too short for the needles task (its evidence and questions need room): use \
                 --seq-len {MIN_LEN} or more"
            )));
        }
        let v = self.vocab.clone();
        let mut ids: Vec<u32> = (0..n).map(|_| v.filler[self.rng.below(0..v.filler.len())]).collect();
        ids[0] = v.bos;
        let needles: Vec<u32> = (0..CLASSES).map(|c| v.values[c * VALUES + self.rng.below(0..VALUES)]).collect();
        let ev = Self::evidence(n);
        for (i, at) in self.distinct(ev.len(), CLASSES * copies(n)).into_iter().enumerate() {
            ids[ev.start + at] = needles[i % CLASSES];
        }
        let qs = Self::questions(n);
        let slots = self.distinct(qs.len() / 2, CLASSES);
        let order = self.distinct(CLASSES, CLASSES);
        let mut answers = Vec::with_capacity(CLASSES);
        for (slot, c) in slots.into_iter().zip(order) {
            let at = qs.start + 2 * slot;
            ids[at] = v.questions[c];
            ids[at + 1] = needles[c];
            answers.push(at + 1);
        }
        answers.sort_unstable();
        Ok(Sample { ids, answers, documents: None })
    }

    /// `n` held-out samples of `seq_len` tokens drawn from `vocab`, from their own seed (derived from `seed`,
    /// so they never meet the training samples' random state).
    pub fn probes(vocab: &Vocab, seed: u64, n: usize, seq_len: usize) -> Result<Vec<Sample>> {
        let mut held_out = Needles::new(vocab.clone(), held_out_seed(seed));
        (0..n).map(|_| held_out.sample(seq_len)).collect()
    }

    /// What the task needs of the run, in one line: where the evidence and the questions sit at `seq_len`
    /// (tokens, and the ranks holding them under `c`'s layout), the distance between them, chance, and the
    /// curriculum of `steps` steps.
    pub fn describe(
        c: &Compiled<LlamaModel>,
        seq_len: usize,
        steps: usize,
        curriculum: &Curriculum,
        tokens_per_step: usize,
    ) -> Result<String> {
        let n_pad = c.padded_len(seq_len);
        let (ev, qs) = (Needles::evidence(seq_len), Needles::questions(seq_len));
        let (mut ev_ranks, mut q_ranks) = (Vec::new(), Vec::new());
        for r in 0..c.sp_group().size() {
            let pos = c.positions(n_pad, r)?;
            if pos.iter().any(|x| ev.contains(x)) {
                ev_ranks.push(r.to_string());
            }
            if pos.iter().any(|x| qs.contains(x)) {
                q_ranks.push(r.to_string());
            }
        }
        let mut stages: Vec<String> = curriculum.stages.iter().map(|(l, s)| format!("{s} steps at {l}")).collect();
        let short: usize = curriculum.stages.iter().map(|s| s.1).sum();
        stages.push(format!("{} at {seq_len}", steps.saturating_sub(short)));
        Ok(format!(
            "task: needles. {} needles stated {} times each in tokens {}-{} (rank {}), asked for in tokens {}-{} \
             (rank {}): every answer is {} to {} tokens before its question; chance {:.1}% (1 in {}). Loss on the \
             answers only; curriculum: {} ({tokens_per_step} tokens per step)",
            CLASSES,
            copies(seq_len),
            ev.start,
            ev.end - 1,
            ev_ranks.join(", "),
            qs.start,
            qs.end - 1,
            q_ranks.join(", "),
            Needles::min_distance(seq_len),
            qs.end - 1 - ev.start,
            100.0 / VALUES as f64,
            VALUES,
            stages.join(", ")
        ))
    }
}

/// The seed of held-out samples drawn for a run of data seed `seed`.
pub(crate) fn held_out_seed(seed: u64) -> u64 {
    seed.wrapping_add(0x00AB_5E11)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_is_stated_only_in_the_evidence_far_before_its_question() {
        let v = Vocab::new(128, 1).unwrap();
        let mut g = Needles::new(v.clone(), 7);
        for n in [256, 1024, 4096] {
            let s = g.sample(n).unwrap();
            assert_eq!(s.ids.len(), n);
            assert_eq!(s.answers.len(), CLASSES);
            let (ev, qs) = (Needles::evidence(n), Needles::questions(n));
            for &a in &s.answers {
                assert!(qs.contains(&(a - 1)) && qs.contains(&a), "answer {a} outside the question span");
                let q = s.ids[a - 1];
                let class = v.questions.iter().position(|&x| x == q).expect("the token before an answer is a question");
                let ans = s.ids[a];
                assert_eq!(v.class_of(ans), Some(class), "the answer is of the asked class");
                // Before the question, the class's tokens occur only in the evidence, and only as the answer.
                for (i, &t) in s.ids[..a - 1].iter().enumerate() {
                    if v.class_of(t) == Some(class) {
                        assert_eq!(t, ans, "position {i}: another token of the class");
                        assert!(ev.contains(&i), "position {i}: the needle outside the evidence");
                    }
                }
                let stated = s.ids[ev.clone()].iter().filter(|&&t| t == ans).count();
                assert_eq!(stated, copies(n));
                assert!(a - 1 - (ev.end - 1) >= Needles::min_distance(n));
            }
        }
        assert_eq!(Needles::min_distance(4096), 2049);
        assert!(g.sample(MIN_LEN - 1).is_err());
    }

    /// A word-level tokenizer of 200 tokens whose ids 0-2 are special and 150 an added (reserved) token.
    fn tokenizer() -> autosp_models::Tokenizer {
        let vocab: Vec<String> = (0..200).map(|i| format!("\"t{i}\": {i}")).collect();
        let added: Vec<String> = [(0, true), (1, true), (2, true), (150, false)]
            .iter()
            .map(|(id, special)| {
                format!(
                    r#"{{"id": {id}, "content": "t{id}", "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": {special}}}"#
                )
            })
            .collect();
        format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{}], "normalizer": null,
               "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null, "decoder": null,
               "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "t0"}}}}"#,
            added.join(","),
            vocab.join(",")
        )
        .parse()
        .unwrap()
    }

    #[test]
    fn with_a_tokenizer_only_ordinary_tokens_are_drawn_and_the_models_bos_starts_each_sample() {
        // The model's vocabulary (210) is larger than the tokenizer's (200): ids past it are never drawn.
        let v = Vocab::of_tokenizer(&tokenizer(), 210, Some(1)).unwrap();
        let mut g = Needles::new(v.clone(), 3);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..20 {
            let s = g.sample(256).unwrap();
            assert_eq!(s.ids[0], 1, "the model's BOS");
            seen.extend(s.ids[1..].iter().copied());
        }
        for bad in [0, 1, 2, 150] {
            assert!(!seen.contains(&bad), "special or added token {bad} drawn");
        }
        assert!(seen.iter().all(|&t| t < 200), "an id past the tokenizer's vocabulary drawn");
        assert!(v.questions.iter().chain(&v.values).all(|t| ![0, 1, 2, 150].contains(t) && *t < 200));
        // No BOS in the model: the tokenizer's first special token.
        assert_eq!(Vocab::of_tokenizer(&tokenizer(), 210, None).unwrap().bos, 0);
        // Too few ordinary tokens: refused, saying so.
        let e = Vocab::of_tokenizer(&tokenizer(), 100, Some(1)).unwrap_err().to_string();
        assert!(e.contains("ordinary tokens"), "{e}");
    }
}
