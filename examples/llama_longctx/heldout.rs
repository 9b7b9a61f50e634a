//! Held-out evaluation (`--eval-data`): the first `--seq-len` tokens of a held-out text, JSONL or `ids:` file,
//! scored as one sequence (mean next-token loss, forward only) before training, every `--eval-every` steps
//! and after; and the token ids scored, written out so that other tools (`--eval-tokens`,
//! `scripts/eval_checkpoint.py`) score exactly the same tokens.

use std::path::Path;

use anyhow::{bail, Context, Result};
use autosp::models::{LlamaModel, Tokenizer};
use autosp::Compiled;
use candle_core::{Device, Tensor};

use crate::args::DataSource;
use crate::data;

/// The held-out tokens.
#[derive(Clone, Debug)]
pub struct HeldOut {
    /// `--eval-data` as given.
    pub source: String,
    /// At most `--seq-len` token ids, at least 2.
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
        let mut ids = match DataSource::parse(spec) {
            DataSource::Passkey | DataSource::Needles => bail!(
                "--eval-data {spec}: held-out evaluation needs a file (text, JSONL or ids:FILE); the synthetic tasks \
                 (passkey, needles) already report their accuracy on held-out samples"
            ),
            DataSource::Ids(f) => data::read_ids(&f, vocab)?,
            DataSource::Text(f) => {
                let docs = data::read_documents(&f)?;
                let tok = tokenizer.with_context(|| {
                    format!(
                        "--eval-data {}: text needs the model's tokenizer, and the model has no tokenizer.json; \
                         give token ids with --eval-data ids:FILE",
                        f.display()
                    )
                })?;
                data::tokenize(tok, &docs, eos)?
            }
        };
        if ids.len() < 2 {
            bail!("--eval-data {spec}: needs at least 2 tokens to score, found {}", ids.len());
        }
        ids.truncate(seq_len);
        Ok(Self { source: spec.to_string(), ids })
    }

    /// The mean next-token loss of the held-out tokens and the number of targets scored (one forward pass;
    /// collective: every rank calls it).
    pub fn evaluate(&self, c: &Compiled<LlamaModel>) -> Result<(f64, usize)> {
        let n = self.ids.len();
        Ok(c.eval_loss(&Tensor::from_vec(self.ids.clone(), (1, n), &Device::Cpu)?, None)?)
    }

    /// Writes the ids, whitespace-separated on one line (the `--eval-tokens` / `ids:` format).
    pub fn write_ids(&self, path: &Path) -> Result<()> {
        let text: Vec<String> = self.ids.iter().map(u32::to_string).collect();
        std::fs::write(path, text.join(" ") + "\n").with_context(|| format!("writing {}", path.display()))
    }
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
    }
}
