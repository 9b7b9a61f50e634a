//! The passkey task (`--data passkey`): a number hidden in long filler and asked for at the end, the standard
//! long-context retrieval test. Spelled with fixed token ids for a model without a tokenizer, or as the
//! standard English prompt through the model's tokenizer.

use autosp_models::rng::SplitMix64 as Rng;
use autosp_models::tokenizer::{encode, encode_document};
use autosp_models::Tokenizer;

use crate::train::error::{Result, TrainError};
use crate::train::stream::Sample;

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
    Ids {
        /// The model's vocabulary size.
        vocab: usize,
    },
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
    /// The random state (what a checkpoint saves).
    pub rng: Rng,
}

impl Passkey {
    /// A generator of `seq_len`-token samples. Refuses a `seq_len` shorter than the fixed text of a sample
    /// (instructions, key, question, answer) as the tokenizer spells it, naming the smallest that works.
    pub fn new(vocab: PasskeyVocab, seq_len: usize, seed: u64) -> Result<Self> {
        if let PasskeyVocab::Ids { vocab } = vocab {
            if vocab < 40 {
                return Err(TrainError::Config(format!(
                    "the passkey task needs a vocabulary of at least 40 tokens; the model has {vocab}"
                )));
            }
        }
        let g = Self { vocab, seq_len, rng: Rng::new(seed ^ 0x005E_ED0F_9A55_CE11) };
        let fixed = g.fixed_len()?;
        let smallest = fixed.max(MIN_PASSKEY_LEN);
        if seq_len < smallest {
            return Err(TrainError::Config(too_short(seq_len, fixed, smallest)));
        }
        Ok(g)
    }

    /// The next sample (advances the random state).
    pub fn sample(&mut self) -> Result<Sample> {
        let key: Vec<usize> = (0..DIGITS).map(|_| self.rng.below(0..10)).collect();
        let depth = self.rng.below(10..80);
        assemble(self.parts(&key)?, self.seq_len, depth)
    }

    /// The tokens a sample takes besides its filler (instructions, key, question, answer). Keys of one
    /// repeated digit stand for all keys (a tokenizer that merges digits could still spell some key longer:
    /// `assemble` refuses that sample rather than cut it).
    fn fixed_len(&self) -> Result<usize> {
        let mut fixed = 0;
        for d in 0..10 {
            fixed = fixed.max(self.parts(&[d; DIGITS])?.fixed_len());
        }
        Ok(fixed)
    }

    /// The shortest prompt of `vocab` in tokens: its fixed text with no filler (what
    /// [`at_depth`](Self::at_depth) needs at least).
    pub fn shortest(vocab: &PasskeyVocab) -> Result<usize> {
        Self { vocab: vocab.clone(), seq_len: 0, rng: Rng::new(0) }.fixed_len()
    }

    /// The evaluation prompt of exactly `len` tokens with the needle at `depth` percent of the filler (0: right
    /// after the opening instructions, 100: right before the question; the filler before it is
    /// `⌊filler · depth / 100⌋` tokens) and a key of five digits drawn from `seed` alone, so that a grid's
    /// cells ask for the same keys. Refuses a `len` below [`shortest`](Self::shortest) or a `depth` past 100.
    pub fn at_depth(vocab: &PasskeyVocab, len: usize, depth: usize, seed: u64) -> Result<Sample> {
        if depth > 100 {
            return Err(TrainError::Config(format!("a passkey depth of {depth}% is past the end: give 0 to 100")));
        }
        let mut rng = Rng::new(seed ^ 0x0DE9_7400_5EED_0000);
        let key: Vec<usize> = (0..DIGITS).map(|_| rng.below(0..10)).collect();
        let g = Self { vocab: vocab.clone(), seq_len: len, rng };
        assemble(g.parts(&key)?, len, depth)
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
                let enc = |s: &str| -> Result<Vec<u32>> { Ok(encode(tok, s)?) };
                Ok(Parts {
                    // The prompt starts as the tokenizer starts a text (the model's BOS where it adds one).
                    start: encode_document(
                        tok,
                        "There is important information hidden inside a lot of irrelevant text. Find it and memorize \
                         it. ",
                    )?,
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
        return Err(TrainError::Config(too_short(seq_len, fixed, fixed.max(MIN_PASSKEY_LEN))));
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
    Ok(Sample { ids, answers: answer_range.collect(), documents: None })
}

impl Passkey {
    /// `n` held-out samples of `seq_len` tokens, from their own seed (derived from `seed`, so they never meet
    /// the training samples' random state).
    pub fn probes(vocab: PasskeyVocab, seed: u64, n: usize, seq_len: usize) -> Result<Vec<Sample>> {
        let mut held_out = Passkey::new(vocab, seq_len, super::needles::held_out_seed(seed))?;
        (0..n).map(|_| held_out.sample()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sample is exactly `seq_len` tokens; its answers are the key's digits, also stated once earlier (the
    /// needle), right after the question.
    #[test]
    fn the_key_is_stated_before_and_answered_after_the_question() {
        let mut g = Passkey::new(PasskeyVocab::Ids { vocab: 64 }, 128, 3).unwrap();
        for _ in 0..4 {
            let s = g.sample().unwrap();
            assert_eq!(s.ids.len(), 128);
            assert_eq!(s.answers.len(), DIGITS);
            let key: Vec<u32> = s.answers.iter().map(|&a| s.ids[a]).collect();
            assert!(key.iter().all(|d| (10..20).contains(d)), "{key:?}");
            assert_eq!(&s.ids[s.answers[0] - 2..s.answers[0]], &[4, 3], "the question comes right before");
            let first = s.ids.windows(DIGITS).position(|w| w == key.as_slice()).unwrap();
            assert!(first < s.answers[0] - 2, "the key is stated before the question");
        }
        let e = Passkey::new(PasskeyVocab::Ids { vocab: 64 }, 20, 3).err().unwrap().to_string();
        assert!(e.contains("--seq-len 20 is too short for the passkey task"), "{e}");
        assert!(Passkey::new(PasskeyVocab::Ids { vocab: 39 }, 128, 3).is_err());
    }

    /// The needle sits after `⌊filler · depth / 100⌋` filler tokens; the key depends on the seed alone.
    #[test]
    fn the_needle_is_placed_at_its_depth_of_the_filler() {
        let vocab = PasskeyVocab::Ids { vocab: 64 };
        let fixed = Passkey::shortest(&vocab).unwrap();
        // start 1, needle 3 + 5 digits + 5, question 4 3, answer 5 digits, end 2.
        assert_eq!(fixed, 1 + 7 + 2 + 5 + 1);
        let len = 118;
        let filler = len - fixed;
        for depth in [0, 25, 50, 75, 100] {
            let s = Passkey::at_depth(&vocab, len, depth, 9).unwrap();
            assert_eq!(s.ids.len(), len);
            let needle = s.ids.iter().position(|&t| t == 3).unwrap();
            assert_eq!(needle, 1 + filler * depth / 100, "depth {depth}");
            let key: Vec<u32> = s.answers.iter().map(|&a| s.ids[a]).collect();
            assert_eq!(&s.ids[needle + 1..needle + 6], key.as_slice());
            assert_eq!(
                key,
                Passkey::at_depth(&vocab, 200, 0, 9)
                    .unwrap()
                    .answers
                    .iter()
                    .map(|&a| { Passkey::at_depth(&vocab, 200, 0, 9).unwrap().ids[a] })
                    .collect::<Vec<_>>()
            );
        }
        assert_ne!(
            Passkey::at_depth(&vocab, len, 0, 9).unwrap().ids,
            Passkey::at_depth(&vocab, len, 0, 10).unwrap().ids
        );
        assert!(Passkey::at_depth(&vocab, fixed - 1, 0, 9).is_err());
        assert!(Passkey::at_depth(&vocab, fixed, 101, 9).is_err());
        assert_eq!(Passkey::at_depth(&vocab, fixed, 50, 9).unwrap().ids.len(), fixed);
    }

    /// With a tokenizer whose post-processor adds BOS (id 1), every sample starts with it, once.
    #[test]
    fn a_text_sample_starts_with_the_tokenizers_bos() {
        let tok = crate::train::data::tests::with_bos();
        let mut g = Passkey::new(PasskeyVocab::Text(Box::new(tok)), 256, 5).unwrap();
        let s = g.sample().unwrap();
        assert_eq!(s.ids[0], 1, "the sample starts with the tokenizer's BOS");
        assert_eq!(s.ids.iter().filter(|&&t| t == 1).count(), 1, "and has it once");
    }
}
