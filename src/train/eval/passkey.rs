//! The passkey grid (`--eval-passkey LENGTHS`, `--eval-depths`, `--eval-samples`): the standard passkey prompt
//! ([`Passkey::at_depth`]: filler, "The pass key is NNNNN. Remember it.", the question at the end) at every
//! length × needle depth, `samples` keys per cell, each scored in one sequence-parallel forward pass (the
//! logits of the answer rows only, [`answer_accuracy`]): a hit when every answer token is the argmax. With
//! `--eval-passkey-generate` each sample is also scored by greedy generation (`passkey_generated.rs`).

use autosp_models::LlamaModel;
use serde_json::{json, Value};

use super::answers::answer_accuracy;
use super::When;
use crate::train::error::{Result, TrainError};
use crate::train::stream::Sample;
use crate::train::synthetic::{Passkey, PasskeyVocab};
use crate::Compiled;

/// The depths scored when `--eval-depths` is not given, in percent of the filler.
pub const DEFAULT_DEPTHS: [usize; 5] = [0, 25, 50, 75, 100];

/// The keys scored per cell when `--eval-samples` is not given.
pub const DEFAULT_SAMPLES: usize = 5;

/// What the grid scores: prompts of each length (tokens) with the needle at each depth (percent), `samples`
/// keys per cell. Sample `i` of every cell asks for the same key (drawn from `seed` and `i`).
#[derive(Clone)]
pub struct PasskeyGrid {
    /// Prompt lengths in tokens, as given.
    pub lengths: Vec<usize>,
    /// Needle depths in percent of the filler (0: right after the instructions, 100: right before the
    /// question).
    pub depths: Vec<usize>,
    /// Keys per cell.
    pub samples: usize,
    /// The seed the keys come from.
    pub seed: u64,
    /// How the prompt is spelled: through the model's tokenizer, or with fixed ids for a model without one.
    pub vocab: PasskeyVocab,
}

/// One cell of a scored grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PasskeyCell {
    /// The prompt length in tokens.
    pub length: usize,
    /// The needle depth in percent.
    pub depth: usize,
    /// Samples whose every answer digit was the argmax (one forward), or whose generated digits were the key
    /// (by generation).
    pub hits: usize,
    /// Samples scored.
    pub samples: usize,
}

impl PasskeyCell {
    /// `hits / samples`.
    pub fn accuracy(&self) -> f64 {
        self.hits as f64 / self.samples.max(1) as f64
    }
}

/// A scored grid: its cells, lengths outer, depths inner, in the order given.
#[derive(Clone, Debug, PartialEq)]
pub struct PasskeyScores {
    /// Every (length, depth) cell.
    pub cells: Vec<PasskeyCell>,
    /// Whether the hits are generated keys ([`PasskeyGrid::evaluate_generated`]) rather than one forward's
    /// argmax ([`PasskeyGrid::evaluate`]).
    pub generated: bool,
}

/// A comma-separated list of whole numbers for `flag`; an error naming it for an empty list or a bad entry.
fn numbers(flag: &str, s: &str, what: &str) -> Result<Vec<usize>> {
    let parts: Vec<&str> = s.split(',').map(str::trim).filter(|p| !p.is_empty()).collect();
    if parts.is_empty() {
        return Err(TrainError::Config(format!("{flag} `{s}` is empty: give a comma-separated list of {what}")));
    }
    parts
        .iter()
        .map(|p| {
            p.parse::<usize>().map_err(|_| {
                TrainError::Config(format!("{flag} `{s}`: `{p}` is not a whole number; give a list of {what}"))
            })
        })
        .collect()
}

impl PasskeyGrid {
    /// The grid of `--eval-passkey LENGTHS` (comma-separated tokens), `--eval-depths DEPTHS` (percent; `None`:
    /// [`DEFAULT_DEPTHS`]) and `--eval-samples N`, spelled with `vocab`. Refuses an empty or malformed list, a
    /// depth past 100, 0 samples, and a length shorter than the prompt's fixed text (naming the shortest that
    /// works), each naming its option.
    pub fn parse(lengths: &str, depths: Option<&str>, samples: usize, seed: u64, vocab: PasskeyVocab) -> Result<Self> {
        let lengths = numbers("--eval-passkey", lengths, "prompt lengths in tokens, e.g. 4096,8192,16384")?;
        let depths = match depths {
            Some(d) => numbers("--eval-depths", d, "needle depths in percent, e.g. 0,25,50,75,100")?,
            None => DEFAULT_DEPTHS.to_vec(),
        };
        if let Some(d) = depths.iter().find(|&&d| d > 100) {
            return Err(TrainError::Config(format!(
                "--eval-depths: {d}% is past the end of the filler; give depths from 0 to 100 (percent)"
            )));
        }
        if samples == 0 {
            return Err(TrainError::Config("--eval-samples 0: give 1 or more keys per cell".into()));
        }
        let shortest = Passkey::shortest(&vocab)?;
        if let Some(&short) = lengths.iter().filter(|&&l| l < shortest).min() {
            return Err(TrainError::Config(format!(
                "--eval-passkey {short} is too short for the passkey prompt: its fixed text (instructions, key, \
                 question and answer) takes {shortest} tokens with this model's {}; the shortest length that works \
                 is {shortest}",
                match vocab {
                    PasskeyVocab::Text(_) => "tokenizer",
                    PasskeyVocab::Ids { .. } => "fixed ids (it has no tokenizer)",
                }
            )));
        }
        Ok(Self { lengths, depths, samples, seed, vocab })
    }

    /// A warning for each length past the model's `window` (its scaled window: such prompts are scored
    /// anyway, as they are what the grid is for).
    pub fn warnings(&self, window: usize) -> Vec<String> {
        self.lengths
            .iter()
            .filter(|&&l| l > window)
            .map(|l| {
                format!(
                    "warning: --eval-passkey {l} is past the model's window of {window} positions \
                     (max_position_embeddings, scaled by its rope_scaling): scored anyway"
                )
            })
            .collect()
    }

    /// Scores every cell (collective: every rank calls it; one forward pass per sample, only the answer rows'
    /// logits travel between the ranks).
    pub fn evaluate(&self, c: &Compiled<LlamaModel>) -> Result<PasskeyScores> {
        self.score_cells(false, |samples| Ok(answer_accuracy(c, samples)?.whole))
    }

    /// Every cell's samples handed to `hits` (which counts the hits among them), as scores `generated` or not.
    pub(super) fn score_cells(
        &self,
        generated: bool,
        mut hits: impl FnMut(&[Sample]) -> Result<usize>,
    ) -> Result<PasskeyScores> {
        let mut cells = Vec::with_capacity(self.lengths.len() * self.depths.len());
        for &length in &self.lengths {
            for &depth in &self.depths {
                let samples = (0..self.samples)
                    .map(|i| Passkey::at_depth(&self.vocab, length, depth, sample_seed(self.seed, i)))
                    .collect::<Result<Vec<_>>>()?;
                let hits = hits(&samples)?;
                cells.push(PasskeyCell { length, depth, hits, samples: self.samples });
            }
        }
        Ok(PasskeyScores { cells, generated })
    }
}

/// The seed of sample `i`'s key.
fn sample_seed(seed: u64, i: usize) -> u64 {
    seed.wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

impl PasskeyScores {
    /// One metrics line per cell: `{"eval":"passkey","when","length","depth","hits","samples","accuracy"}`
    /// (`"eval":"passkey_generated"` for scores by generation).
    pub fn json_lines(&self, when: When) -> Vec<Value> {
        let eval = if self.generated { "passkey_generated" } else { "passkey" };
        self.cells
            .iter()
            .map(|c| {
                json!({
                    "eval": eval, "when": when.as_str(), "length": c.length, "depth": c.depth,
                    "hits": c.hits, "samples": c.samples, "accuracy": c.accuracy(),
                })
            })
            .collect()
    }

    /// The distinct lengths and depths, in the order scored.
    pub fn axes(&self) -> (Vec<usize>, Vec<usize>) {
        let (mut lengths, mut depths) = (Vec::new(), Vec::new());
        for c in &self.cells {
            if !lengths.contains(&c.length) {
                lengths.push(c.length);
            }
            if !depths.contains(&c.depth) {
                depths.push(c.depth);
            }
        }
        (lengths, depths)
    }

    /// The cell at `(length, depth)`.
    pub fn cell(&self, length: usize, depth: usize) -> Option<&PasskeyCell> {
        self.cells.iter().find(|c| c.length == length && c.depth == depth)
    }

    /// Hits and samples over the whole grid.
    pub fn total(&self) -> (usize, usize) {
        self.cells.iter().fold((0, 0), |(h, n), c| (h + c.hits, n + c.samples))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> PasskeyVocab {
        PasskeyVocab::Ids { vocab: 64 }
    }

    #[test]
    fn bad_lists_depths_samples_and_short_lengths_are_refused_naming_the_option() {
        let err = |l: &str, d: Option<&str>, n: usize| PasskeyGrid::parse(l, d, n, 0, ids()).err().unwrap().to_string();
        assert!(err("", None, 5).contains("--eval-passkey `` is empty"));
        assert!(err("64,x", None, 5).contains("--eval-passkey `64,x`: `x` is not a whole number"));
        assert!(err("64", Some(" , "), 5).contains("--eval-depths ` , ` is empty"));
        assert!(err("64", Some("0,101"), 5).contains("--eval-depths: 101% is past the end"));
        assert!(err("64", None, 0).contains("--eval-samples 0"));
        let shortest = Passkey::shortest(&ids()).unwrap();
        let e = err(&format!("64,{}", shortest - 1), None, 5);
        assert!(
            e.contains(&format!("--eval-passkey {} is too short", shortest - 1))
                && e.contains(&format!("the shortest length that works is {shortest}")),
            "{e}"
        );
        let g = PasskeyGrid::parse("64, 128", None, 2, 0, ids()).unwrap();
        assert_eq!((g.lengths.clone(), g.depths.clone(), g.samples), (vec![64, 128], DEFAULT_DEPTHS.to_vec(), 2));
        let w = g.warnings(100);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("--eval-passkey 128 is past the model's window of 100"), "{w:?}");
    }
}
