//! The default task, `--data needles`: multi-needle retrieval that only long context solves. Each sequence
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
//! ([`Curriculum`]) starts on short sequences, many per step, and doubles to `--seq-len` with the tokens per
//! step held constant: one attention head learns to match a question with its class's tokens quickly at
//! short length, and the last stages teach it the sharper attention that thousands of distractors need.

use anyhow::{bail, Result};
use autosp::models::rng::SplitMix64 as Rng;

use crate::data::Sample;

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

/// The token ids of the task in a vocabulary: filler, the classes' values (class c: `values.start + c *
/// VALUES ..`), the question tokens (class c: `questions.start + c`).
#[derive(Clone, Debug)]
pub struct Vocab {
    pub filler: std::ops::Range<u32>,
    pub values: std::ops::Range<u32>,
    pub questions: std::ops::Range<u32>,
}

impl Vocab {
    /// The task's tokens in a model vocabulary of `vocab` ids: values and questions at the top, the rest
    /// (above the special ids 0-2) filler. Refuses a vocabulary too small for at least 16 filler tokens.
    pub fn new(vocab: usize) -> Result<Self> {
        let needed = CLASSES * VALUES + CLASSES + 3 + 16;
        if vocab < needed {
            bail!("the needles task needs a vocabulary of at least {needed} tokens; the model has {vocab}");
        }
        let values_start = (vocab - CLASSES * VALUES) as u32;
        let questions_start = values_start - CLASSES as u32;
        Ok(Self {
            filler: 3..questions_start,
            values: values_start..vocab as u32,
            questions: questions_start..values_start,
        })
    }
}

/// The generator of `--data needles` samples.
#[derive(Clone)]
pub struct Needles {
    vocab: Vocab,
    pub rng: Rng,
}

impl Needles {
    /// A generator for a model vocabulary of `vocab` ids.
    pub fn new(vocab: usize, seed: u64) -> Result<Self> {
        Ok(Self { vocab: Vocab::new(vocab)?, rng: Rng::new(seed ^ 0x4EED_1E5C_1A55_E500) })
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
            bail!(
                "--seq-len {n} is too short for the needles task (its evidence and questions need room): use \
                 --seq-len {MIN_LEN} or more"
            );
        }
        let v = self.vocab.clone();
        let mut ids: Vec<u32> =
            (0..n).map(|_| self.rng.below(v.filler.start as usize..v.filler.end as usize) as u32).collect();
        ids[0] = 1;
        let needles: Vec<u32> =
            (0..CLASSES).map(|c| v.values.start + (c * VALUES + self.rng.below(0..VALUES)) as u32).collect();
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
            ids[at] = v.questions.start + c as u32;
            ids[at + 1] = needles[c];
            answers.push(at + 1);
        }
        answers.sort_unstable();
        Ok(Sample { ids, answers })
    }
}

/// Sequence lengths over training: `stages` of (length, steps) first, then `--seq-len` for the remaining
/// steps. Every step trains on `--seq-len` tokens (times the micro-batches): seq_len / length sequences of
/// the stage's length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Curriculum {
    pub stages: Vec<(usize, usize)>,
    pub seq_len: usize,
}

impl Curriculum {
    /// The default of `--data needles` for `steps` steps at `seq_len`: lengths doubling from 256 to
    /// seq_len / 2 take 90% of the steps (the first, where the skill is learned, 40%; the others share 50%),
    /// and the last 10% run at seq_len. With seq_len <= 256, every step is at seq_len.
    pub fn default_for(seq_len: usize, steps: usize) -> Self {
        let mut lens = Vec::new();
        let mut l = 256;
        while l < seq_len && seq_len.is_multiple_of(l) {
            lens.push(l);
            l *= 2;
        }
        let short = steps * 9 / 10;
        let first = if lens.len() > 1 { steps * 4 / 10 } else { short };
        let rest = lens.len().saturating_sub(1).max(1);
        let stages = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| match i {
                0 => (l, first),
                _ => (l, (short - first) * i / rest - (short - first) * (i - 1) / rest),
            })
            .collect();
        Self { stages, seq_len }
    }

    /// Parses `--curriculum`: `none`, or `L1:S1,L2:S2,...` (S_i steps at L_i tokens, then --seq-len). Each
    /// length must divide `seq_len` and be shorter than it.
    pub fn parse(s: &str, seq_len: usize) -> Result<Self> {
        let mut stages = Vec::new();
        if s != "none" {
            for part in s.split(',') {
                let parsed =
                    part.split_once(':').and_then(|(l, n)| Some((l.trim().parse().ok()?, n.trim().parse().ok()?)));
                let Some((len, steps)) = parsed else {
                    bail!("--curriculum `{s}`: `{part}` is not LENGTH:STEPS; give e.g. 256:60,1024:40 (or none)");
                };
                if len == 0 || len >= seq_len || !seq_len.is_multiple_of(len) {
                    bail!("--curriculum `{s}`: length {len} must be shorter than --seq-len {seq_len} and divide it");
                }
                stages.push((len, steps));
            }
        }
        Ok(Self { stages, seq_len })
    }

    /// How `--curriculum` spells it (`none` without stages).
    pub fn flag(&self) -> String {
        if self.stages.is_empty() {
            return "none".into();
        }
        self.stages.iter().map(|(l, s)| format!("{l}:{s}")).collect::<Vec<_>>().join(",")
    }

    /// The sequence length of (0-based) `step`.
    pub fn len_at(&self, step: usize) -> usize {
        let mut end = 0;
        for &(len, steps) in &self.stages {
            end += steps;
            if step < end {
                return len;
            }
        }
        self.seq_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_is_stated_only_in_the_evidence_far_before_its_question() {
        let mut g = Needles::new(128, 7).unwrap();
        let v = Vocab::new(128).unwrap();
        for n in [256, 1024, 4096] {
            let s = g.sample(n).unwrap();
            assert_eq!(s.ids.len(), n);
            assert_eq!(s.answers.len(), CLASSES);
            let (ev, qs) = (Needles::evidence(n), Needles::questions(n));
            for &a in &s.answers {
                assert!(qs.contains(&(a - 1)) && qs.contains(&a), "answer {a} outside the question span");
                let q = s.ids[a - 1];
                assert!(v.questions.contains(&q), "the token before an answer is a question");
                let class = (q - v.questions.start) as usize;
                let ans = s.ids[a];
                assert_eq!((ans - v.values.start) as usize / VALUES, class, "the answer is of the asked class");
                // Before the question, the class's tokens occur only in the evidence, and only as the answer.
                for (i, &t) in s.ids[..a - 1].iter().enumerate() {
                    if v.values.contains(&t) && (t - v.values.start) as usize / VALUES == class {
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

    #[test]
    fn the_default_curriculum_doubles_to_seq_len_and_parses_back() {
        let c = Curriculum::default_for(4096, 200);
        assert_eq!(c.stages, vec![(256, 80), (512, 33), (1024, 33), (2048, 34)]);
        assert_eq!(
            (c.len_at(0), c.len_at(79), c.len_at(80), c.len_at(179), c.len_at(180)),
            (256, 256, 512, 2048, 4096)
        );
        assert_eq!(Curriculum::parse(&c.flag(), 4096).unwrap(), c);
        assert_eq!(c.flag(), "256:80,512:33,1024:33,2048:34");
        assert!(Curriculum::default_for(256, 10).stages.is_empty());
        assert_eq!(Curriculum::default_for(512, 12).stages, vec![(256, 10)]);
        assert!(Curriculum::parse("none", 512).unwrap().stages.is_empty());
        for bad in ["300:5", "512:5", "256", "x:1"] {
            assert!(Curriculum::parse(bad, 512).is_err(), "{bad}");
        }
    }
}
