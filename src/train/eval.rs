//! Evaluation during training, forward only and collective (every rank calls it): [`HeldOut`], the mean
//! next-token loss on held-out tokens (`--eval-data`: the first `seq_len` tokens of a text, JSONL or `ids:`
//! file scored as one sequence), whose ids can be written out so other tools (`--eval-tokens`,
//! `scripts/eval_checkpoint.py`) score exactly the same tokens; and [`answer_accuracy`], teacher-forced
//! retrieval accuracy on samples with marked answers (the synthetic tasks).

use std::path::Path;

use autosp_models::{LlamaModel, Tokenizer};
use candle_core::{Device, Tensor};

use super::data::{self, DataSource};
use super::error::{Result, TrainError};
use super::stream::Sample;
use crate::Compiled;

/// The held-out tokens.
#[derive(Clone, Debug)]
pub struct HeldOut {
    /// Where they came from (`--eval-data` as given).
    pub source: String,
    /// At most `seq_len` token ids, at least 2.
    pub ids: Vec<u32>,
}

impl HeldOut {
    /// Reads `spec` (a text or JSONL file, tokenised with `tokenizer` with `eos` after each document like
    /// `--data`, or `ids:FILE`) and keeps its first `seq_len` tokens.
    pub fn load(
        spec: &str,
        seq_len: usize,
        vocab: usize,
        tokenizer: Option<&Tokenizer>,
        eos: Option<u32>,
    ) -> Result<Self> {
        let Some(mut ids) = DataSource::parse(spec).file_ids("--eval-data", "the model", vocab, tokenizer, eos)? else {
            return Err(TrainError::Config(format!(
                "--eval-data {spec}: held-out evaluation needs a file (text, JSONL or ids:FILE); the synthetic tasks \
                 (passkey, needles) already report their accuracy on held-out samples"
            )));
        };
        if ids.len() < 2 {
            return Err(TrainError::Data(format!(
                "--eval-data {spec}: needs at least 2 tokens to score, found {}",
                ids.len()
            )));
        }
        ids.truncate(seq_len);
        Ok(Self { source: spec.to_string(), ids })
    }

    /// Held-out tokens given as ids (`source` names them in reports); at least 2.
    pub fn from_ids(source: impl Into<String>, ids: Vec<u32>) -> Result<Self> {
        let source = source.into();
        if ids.len() < 2 {
            return Err(TrainError::Data(format!("{source}: needs at least 2 tokens to score, found {}", ids.len())));
        }
        Ok(Self { source, ids })
    }

    /// The mean next-token loss of the held-out tokens and the number of targets scored (one forward pass;
    /// collective: every rank calls it).
    pub fn evaluate(&self, c: &Compiled<LlamaModel>) -> Result<(f64, usize)> {
        let n = self.ids.len();
        Ok(c.eval_loss(&Tensor::from_vec(self.ids.clone(), (1, n), &Device::Cpu)?, None)?)
    }

    /// Writes the ids, whitespace-separated on one line (the `--eval-tokens` / `ids:` format).
    pub fn write_ids(&self, path: &Path) -> Result<()> {
        data::write_ids(path, &self.ids)
    }
}

/// Right answers of a probe set ([`answer_accuracy`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Answers {
    /// Answer tokens predicted right.
    pub right: usize,
    /// Answer tokens.
    pub total: usize,
    /// Samples with every answer token right.
    pub whole: usize,
}

/// Teacher-forced answer accuracy: for every answer token of every probe, whether the argmax of the logits
/// at the token before it is that token (earlier answer tokens are given, not generated). Collective: every
/// rank calls it with the same probes; only the scored rows travel between the ranks.
pub fn answer_accuracy(c: &Compiled<LlamaModel>, probes: &[Sample]) -> Result<Answers> {
    let mut a = Answers::default();
    for s in probes {
        let n = s.ids.len();
        let ids = Tensor::from_vec(s.ids.clone(), (1, n), &Device::Cpu)?;
        let k = s.answers.len();
        let scored: Vec<usize> = s.answers.iter().map(|&a| a - 1).collect();
        let logits = c.logits_at(&ids, &scored)?;
        let rows = logits.argmax(2)?.flatten_all()?.to_vec1::<u32>()?;
        let ok = rows.iter().zip(s.answers.iter().map(|&a| s.ids[a])).filter(|(a, b)| **a == *b).count();
        a.right += ok;
        a.total += k;
        a.whole += usize::from(ok == k);
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_cut_to_the_sequence_length_and_written_back_readable() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ids.txt");
        std::fs::write(&f, "5 6 7\n8 9").unwrap();
        let h = HeldOut::load(&format!("ids:{}", f.display()), 4, 10, None, None).unwrap();
        assert_eq!(h.ids, vec![5, 6, 7, 8]);
        let out = dir.path().join("out.txt");
        h.write_ids(&out).unwrap();
        assert_eq!(data::read_ids(&out, 10).unwrap(), h.ids);
    }

    #[test]
    fn passkey_text_without_a_tokenizer_and_a_single_token_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = HeldOut::load("passkey", 8, 10, None, None).unwrap_err().to_string();
        assert!(e.contains("needs a file"), "{e}");
        let t = dir.path().join("t.txt");
        std::fs::write(&t, "some text").unwrap();
        let e = HeldOut::load(t.to_str().unwrap(), 8, 10, None, None).unwrap_err().to_string();
        assert!(e.contains("ids:FILE") && e.contains("tokenizer"), "{e}");
        let one = dir.path().join("one.txt");
        std::fs::write(&one, "3").unwrap();
        let e = HeldOut::load(&format!("ids:{}", one.display()), 8, 10, None, None).unwrap_err().to_string();
        assert!(e.contains("at least 2 tokens"), "{e}");
        assert!(HeldOut::from_ids("x", vec![1]).is_err());
    }
}
