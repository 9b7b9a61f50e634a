//! [`HeldOut`]: the mean next-token loss on held-out tokens (`--eval-data`: a text, JSONL or `ids:` file, up to
//! `--eval-tokens-max` tokens, scored in windows of `seq_len`), whose ids can be written out, one window per
//! line, so other tools (`scripts/eval_checkpoint.py`) score exactly the same tokens. Forward only and
//! collective (every rank calls it).

use std::path::Path;

use autosp_core::ops::Documents;
use autosp_models::LlamaModel;
use candle_core::{Device, Tensor};

use crate::train::corpus::{Corpus, Tokenising};
use crate::train::data::{self, DataSource};
use crate::train::error::{Result, TrainError};
use crate::train::packing::{documents_in, Packing};
use crate::Compiled;

/// The held-out tokens, scored in windows.
#[derive(Clone, Debug)]
pub struct HeldOut {
    /// Where they came from (`--eval-data` as given).
    pub source: String,
    /// The token ids scored, at least 2: the windows one after the other.
    pub ids: Vec<u32>,
    /// Tokens per window (the training sequence length); the last window may be shorter (at least 2 tokens).
    pub window: usize,
    /// For conversations: which tokens are scored (the assistant's); `None`: every one.
    pub trained: Option<Vec<bool>>,
    /// Under `--packing documents`: where each document starts in `ids` (ascending, the first 0; the cache's
    /// record, or the lines of an `ids:` file), and each window is scored with its documents; `None`:
    /// document-blind.
    pub starts: Option<Vec<u64>>,
}

impl HeldOut {
    /// Reads `spec` (a text or JSONL file, tokenised by `tokenising` into its cache like `--data`, or
    /// `ids:FILE`) and keeps its first `max_tokens` tokens (all when fewer), to score in windows of `window`
    /// tokens (a last window of a single token, which has no target, is dropped). Conversations score the
    /// assistant's tokens only, as they train. Under `packing` documents each window is scored with its
    /// documents, as training packs them.
    pub fn load(
        spec: &str,
        window: usize,
        max_tokens: usize,
        vocab: usize,
        tokenising: Option<&Tokenising<'_>>,
        packing: Packing,
    ) -> Result<Self> {
        if window < 2 || max_tokens < 2 {
            return Err(TrainError::Config(format!(
                "--eval-data {spec} with --eval-tokens-max {max_tokens} and windows of --seq-len {window}: a window \
                 needs at least 2 tokens (an input and its target); give both 2 or more"
            )));
        }
        let documents = packing == Packing::Documents;
        let (mut ids, mut trained, mut starts) = match (DataSource::parse(spec), tokenising) {
            (DataSource::Ids(f), _) if documents => {
                let (ids, starts) = data::read_id_documents(&f, vocab)?;
                (ids, None, Some(starts))
            }
            (DataSource::Ids(f), _) => (data::read_ids(&f, vocab)?, None, None),
            (DataSource::Text(f), Some(t)) => {
                let corpus = Corpus::prepare(&f, t)?;
                let n = max_tokens.min(corpus.tokens as usize);
                let (ids, trained) = corpus.read(0, n)?;
                let starts = documents.then(|| corpus.starts(0, n as u64)).transpose()?;
                (ids, corpus.chat.then_some(trained), starts)
            }
            (DataSource::Text(f), None) => {
                return Err(TrainError::Config(format!(
                    "--eval-data {}: text needs the model's tokenizer; give token ids as ids:FILE",
                    f.display()
                )))
            }
            _ => {
                return Err(TrainError::Config(format!(
                    "--eval-data {spec}: held-out evaluation needs a file (text, JSONL or ids:FILE); the synthetic \
                     tasks (passkey, needles) already report their accuracy on held-out samples"
                )))
            }
        };
        if ids.len() < 2 {
            return Err(TrainError::Data(format!(
                "--eval-data {spec}: needs at least 2 tokens to score, found {}",
                ids.len()
            )));
        }
        ids.truncate(max_tokens);
        if ids.len() % window == 1 {
            ids.pop();
        }
        if let Some(t) = &mut trained {
            t.truncate(ids.len());
        }
        if let Some(s) = &mut starts {
            s.retain(|&s| s < ids.len() as u64);
        }
        Ok(Self { source: spec.to_string(), ids, window, trained, starts })
    }

    /// Held-out tokens given as ids (`source` names them in reports), scored as one window; at least 2.
    pub fn from_ids(source: impl Into<String>, ids: Vec<u32>) -> Result<Self> {
        let source = source.into();
        if ids.len() < 2 {
            return Err(TrainError::Data(format!("{source}: needs at least 2 tokens to score, found {}", ids.len())));
        }
        let window = ids.len();
        Ok(Self { source, ids, window, trained: None, starts: None })
    }

    /// The windows, in order.
    pub fn windows(&self) -> impl Iterator<Item = &[u32]> {
        self.ids.chunks(self.window)
    }

    /// The documents of window `k` (of `len` tokens) when the tokens are scored with documents.
    pub fn window_documents(&self, k: usize, len: usize) -> Result<Option<Documents>> {
        let Some(starts) = &self.starts else { return Ok(None) };
        let d = documents_in(starts, (k * self.window) as u64, len)
            .map_err(|e| TrainError::Data(format!("--eval-data {}: document starts {e}", self.source)))?;
        Ok(Some(d))
    }

    /// The mean next-token loss over every window's targets (each window scored as a sequence of its own, with
    /// its documents when it has them, one forward pass each; the mean weighs each window by its targets, so a
    /// window without one is skipped) and
    /// the number of targets (collective: every rank calls it). An error when no window has a target.
    pub fn evaluate(&self, c: &Compiled<LlamaModel>) -> Result<(f64, usize)> {
        let (mut sum, mut count) = (0.0, 0usize);
        for (k, w) in self.windows().enumerate() {
            let documents = self.window_documents(k, w.len())?;
            let labels = match &self.trained {
                Some(t) => {
                    let t = &t[k * self.window..k * self.window + w.len()];
                    let l: Vec<i64> = w.iter().zip(t).map(|(&id, &on)| if on { i64::from(id) } else { -100 }).collect();
                    Some(Tensor::from_vec(l, (1, w.len()), &Device::Cpu)?)
                }
                None => None,
            };
            let ids = Tensor::from_vec(w.to_vec(), (1, w.len()), &Device::Cpu)?;
            // With documents the compiled step ignores the targets across their boundaries itself.
            let scored = match &documents {
                Some(d) => c.eval_loss_packed(&ids, labels.as_ref(), std::slice::from_ref(d)),
                None => c.eval_loss(&ids, labels.as_ref()),
            };
            let (loss, targets) = match scored {
                Ok(scored) => scored,
                // A window without a scored token (a chat window with no assistant token) weighs nothing.
                Err(crate::CompileError::NoTargets) => continue,
                Err(e) => return Err(e.into()),
            };
            sum += loss * targets as f64;
            count += targets;
        }
        if count == 0 {
            return Err(TrainError::Data(format!(
                "--eval-data {}: none of its {} window(s) holds a token to score (no assistant token in the \
                 conversations kept): give held-out data with answers, or more --eval-tokens-max",
                self.source,
                self.windows().count()
            )));
        }
        Ok((sum / count as f64, count))
    }

    /// Writes the ids, one window per line, whitespace-separated (`scripts/eval_checkpoint.py --ids` scores
    /// each line as a sequence; `ids:FILE` reads them all).
    pub fn write_ids(&self, path: &Path) -> Result<()> {
        data::write_ids(path, self.windows())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_cut_into_windows_up_to_the_maximum_and_written_back_one_window_per_line() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ids.txt");
        std::fs::write(&f, "5 6 7\n8 9 1 2 3 4").unwrap();
        // Windows of 4, at most 8 tokens: two windows.
        let h = HeldOut::load(&format!("ids:{}", f.display()), 4, 8, 10, None, Packing::Stream).unwrap();
        assert_eq!(h.windows().collect::<Vec<_>>(), vec![&[5, 6, 7, 8][..], &[9, 1, 2, 3][..]]);
        // All 9 tokens: a last window of one token has no target and is dropped; of 3 tokens it is kept.
        let h = HeldOut::load(&format!("ids:{}", f.display()), 4, 100, 10, None, Packing::Stream).unwrap();
        assert_eq!(h.ids.len(), 8);
        let h = HeldOut::load(&format!("ids:{}", f.display()), 3, 100, 10, None, Packing::Stream).unwrap();
        assert_eq!(h.windows().count(), 3);
        let out = dir.path().join("out.txt");
        h.write_ids(&out).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "5 6 7\n8 9 1\n2 3 4\n");
        assert_eq!(data::read_ids(&out, 10).unwrap(), h.ids);
    }

    #[test]
    fn packed_by_documents_each_window_gets_its_documents() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ids.txt");
        // Lines are documents: [5 6 7] [8 9 1 2 3] [4]; windows of 4, at most 7 tokens.
        std::fs::write(&f, "5 6 7\n8 9 1 2 3\n4\n").unwrap();
        let spec = format!("ids:{}", f.display());
        let h = HeldOut::load(&spec, 4, 7, 10, None, Packing::Documents).unwrap();
        assert_eq!(h.starts, Some(vec![0, 3]));
        let docs = |k: usize, len: usize| {
            let d = h.window_documents(k, len).unwrap().unwrap();
            (d.cu_seqlens().to_vec(), d.first_position())
        };
        assert_eq!(docs(0, 4), (vec![0, 3, 4], 0));
        assert_eq!(docs(1, 3), (vec![0, 3], 1));
        // Document-blind: no starts, no documents.
        let blind = HeldOut::load(&spec, 4, 7, 10, None, Packing::Stream).unwrap();
        assert_eq!((blind.starts.clone(), blind.window_documents(0, 4).unwrap()), (None, None));
    }

    #[test]
    fn passkey_text_without_a_tokenizer_and_a_single_token_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = HeldOut::load("passkey", 8, 64, 10, None, Packing::Stream).unwrap_err().to_string();
        assert!(e.contains("needs a file"), "{e}");
        let t = dir.path().join("t.txt");
        std::fs::write(&t, "some text").unwrap();
        let e = HeldOut::load(t.to_str().unwrap(), 8, 64, 10, None, Packing::Stream).unwrap_err().to_string();
        assert!(e.contains("ids:FILE") && e.contains("tokenizer"), "{e}");
        let one = dir.path().join("one.txt");
        std::fs::write(&one, "3").unwrap();
        let e =
            HeldOut::load(&format!("ids:{}", one.display()), 8, 64, 10, None, Packing::Stream).unwrap_err().to_string();
        assert!(e.contains("at least 2 tokens"), "{e}");
        assert!(HeldOut::from_ids("x", vec![1]).is_err());
        let e = HeldOut::load("passkey", 8, 1, 10, None, Packing::Stream).unwrap_err().to_string();
        assert!(e.contains("--eval-tokens-max 1") && e.contains("at least 2"), "{e}");
    }
}
