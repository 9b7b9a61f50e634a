//! Loss by position (`--eval-positions`): the held-out next-token loss in buckets of token position, on
//! windows that each start at a document's start, so a bucket's loss is the loss of predicting a token with
//! that much of its own document before it. Short-context loss (the first bucket) is in it, so a regression
//! there shows beside the gains far out.
//!
//! - Documents: the held-out tokens (`--eval-data`, up to `--eval-tokens-max`) cut where the documents start,
//!   as recorded under `--packing documents` ([`HeldOut::starts`]: the token cache's record of each JSONL
//!   `"text"` line, plain-text paragraph or conversation, or the lines of an `ids:` file); document-blind
//!   (`--packing stream`), cut after each of the model's EOS token, which the token cache puts after every
//!   document. A model without an EOS id gives one document.
//! - Windows: the first `seq_len` tokens of each document, one forward pass each; a shorter document is a
//!   shorter window and adds to the buckets it reaches. Documents of fewer than 2 tokens add nothing.
//! - Buckets ([`bucket_edges`]): a target at position `p` (the token predicted from the `p` tokens before it,
//!   `1 <= p < seq_len`) counts in the bucket `from <= p < to`.

use autosp_models::LlamaModel;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use super::heldout::HeldOut;
use super::When;
use crate::train::error::{Result, TrainError};
use crate::Compiled;

/// The bucket edges for windows of `seq_len` tokens, from 0 to `seq_len`: from 2048 tokens on, 1024 and its
/// doublings below `seq_len` (0-1K, 1-2K, 2-4K, 4-8K, ..., the last bucket ending at `seq_len`); below
/// 2048, `seq_len` / 16, / 8, / 4 and / 2 (so short test runs get five buckets too). Edges that coincide (a
/// `seq_len` below 16) are merged.
pub fn bucket_edges(seq_len: usize) -> Vec<usize> {
    let mut edges = vec![0];
    if seq_len >= 2048 {
        let mut e = 1024;
        while e < seq_len {
            edges.push(e);
            e *= 2;
        }
    } else {
        edges.extend([16, 8, 4, 2].map(|d| seq_len / d));
    }
    edges.push(seq_len);
    edges.dedup();
    edges.retain(|&e| e <= seq_len);
    edges
}

/// The windows loss by position scores, and the bucket edges.
#[derive(Clone, Debug)]
pub struct PositionLoss {
    /// Where the tokens came from (`--eval-data` as given).
    pub source: String,
    /// The windows: each document's first `seq_len` tokens, and for conversations which of them are scored.
    pub windows: Vec<(Vec<u32>, Option<Vec<bool>>)>,
    /// The bucket edges ([`bucket_edges`]).
    pub edges: Vec<usize>,
    /// The longest document in tokens (all of it, not only its window).
    pub longest: usize,
}

/// One bucket's mean loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bucket {
    /// The first position in it.
    pub from: usize,
    /// The position after its last.
    pub to: usize,
    /// The mean next-token loss of its targets (NaN when it has none).
    pub loss: f64,
    /// Its targets over every window.
    pub targets: usize,
}

/// A scored loss by position: every bucket, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct PositionScores {
    /// The buckets, empty ones included (`targets` 0).
    pub buckets: Vec<Bucket>,
}

impl PositionLoss {
    /// The windows of `heldout`'s tokens cut into documents at its recorded starts, else after each `eos`
    /// (see the module's doc), each at most `seq_len` tokens. An error naming `--eval-positions` when no
    /// document has 2 tokens.
    pub fn from_heldout(heldout: &HeldOut, seq_len: usize, eos: Option<u32>) -> Result<Self> {
        let mut windows = Vec::new();
        let (mut start, mut longest) = (0, 0);
        let ids = &heldout.ids;
        // Where each document ends: at the next recorded start, else after an EOS.
        let ends_at = |end: usize| match &heldout.starts {
            Some(starts) => starts.binary_search(&(end as u64)).is_ok(),
            None => Some(ids[end - 1]) == eos,
        };
        for end in 1..=ids.len() {
            if end < ids.len() && !ends_at(end) {
                continue;
            }
            longest = longest.max(end - start);
            let stop = end.min(start + seq_len);
            if stop - start >= 2 {
                let trained = heldout.trained.as_ref().map(|t| t[start..stop].to_vec());
                windows.push((ids[start..stop].to_vec(), trained));
            }
            start = end;
        }
        if windows.is_empty() {
            return Err(TrainError::Data(format!(
                "--eval-positions: --eval-data {} holds no document of 2 tokens or more to score",
                heldout.source
            )));
        }
        Ok(Self { source: heldout.source.clone(), windows, edges: bucket_edges(seq_len), longest })
    }

    /// A warning when no document reaches the last bucket (its loss stays empty).
    pub fn warning(&self) -> Option<String> {
        let last = self.edges[self.edges.len() - 2];
        (self.longest <= last).then(|| {
            format!(
                "warning: --eval-positions: the longest document of --eval-data {} has {} tokens, so the buckets from \
                 position {last} on stay empty; give longer documents (or more --eval-tokens-max)",
                self.source, self.longest
            )
        })
    }

    /// Scores every window (collective: every rank calls it; one forward pass per window, [`Compiled::token_losses`])
    /// and sums its targets' losses into the buckets (in f64).
    pub fn evaluate(&self, c: &Compiled<LlamaModel>) -> Result<PositionScores> {
        let k = self.edges.len() - 1;
        let (mut sums, mut counts) = (vec![0.0f64; k], vec![0usize; k]);
        for (ids, trained) in &self.windows {
            let n = ids.len();
            let labels = trained
                .as_ref()
                .map(|t| {
                    let l: Vec<i64> =
                        ids.iter().zip(t).map(|(&id, &on)| if on { i64::from(id) } else { -100 }).collect();
                    Tensor::from_vec(l, (1, n), &Device::Cpu)
                })
                .transpose()?;
            let input = Tensor::from_vec(ids.clone(), (1, n), &Device::Cpu)?;
            let losses =
                c.token_losses(&input, labels.as_ref())?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            // losses[t] predicts the token at position t + 1.
            for (t, &loss) in losses.iter().enumerate().take(n - 1) {
                let p = t + 1;
                if trained.as_ref().is_some_and(|m| !m[p]) {
                    continue;
                }
                let b = self.edges.partition_point(|&e| e <= p) - 1;
                sums[b] += loss;
                counts[b] += 1;
            }
        }
        let buckets = (0..k)
            .map(|b| Bucket {
                from: self.edges[b],
                to: self.edges[b + 1],
                loss: if counts[b] > 0 { sums[b] / counts[b] as f64 } else { f64::NAN },
                targets: counts[b],
            })
            .collect();
        Ok(PositionScores { buckets })
    }
}

impl PositionScores {
    /// One metrics line per bucket with targets: `{"eval":"positions","when","from","to","loss","targets"}`.
    pub fn json_lines(&self, when: When) -> Vec<Value> {
        self.buckets
            .iter()
            .filter(|b| b.targets > 0)
            .map(|b| {
                json!({
                    "eval": "positions", "when": when.as_str(), "from": b.from, "to": b.to, "loss": b.loss,
                    "targets": b.targets,
                })
            })
            .collect()
    }
}

/// `1536` -> `1.5K`, `512` -> `512`: a position for a table or an axis.
pub fn short_position(p: usize) -> String {
    if p >= 1024 && p.is_multiple_of(512) {
        let k = p as f64 / 1024.0;
        if k.fract() == 0.0 {
            format!("{k:.0}K")
        } else {
            format!("{k:.1}K")
        }
    } else {
        p.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_edges_double_from_1k_and_cut_short_windows_in_sixteenths() {
        assert_eq!(bucket_edges(2048), vec![0, 1024, 2048]);
        assert_eq!(bucket_edges(16384), vec![0, 1024, 2048, 4096, 8192, 16384]);
        assert_eq!(bucket_edges(3000), vec![0, 1024, 2048, 3000]);
        assert_eq!(bucket_edges(256), vec![0, 16, 32, 64, 128, 256]);
        assert_eq!(bucket_edges(100), vec![0, 6, 12, 25, 50, 100]);
        assert_eq!(bucket_edges(8), vec![0, 1, 2, 4, 8]);
        assert_eq!(bucket_edges(2), vec![0, 1, 2]);
        assert_eq!(
            (short_position(1024), short_position(1536), short_position(500)),
            ("1K".into(), "1.5K".into(), "500".into())
        );
    }

    #[test]
    fn windows_start_at_documents_and_stop_at_seq_len() {
        // Documents end at EOS 2: [5 6 7 8 9 2] [3 2] [4] (the last without its EOS, cut by --eval-tokens-max).
        let h = HeldOut::from_ids("d", vec![5, 6, 7, 8, 9, 2, 3, 2, 4]).unwrap();
        let p = PositionLoss::from_heldout(&h, 4, Some(2)).unwrap();
        let w: Vec<&[u32]> = p.windows.iter().map(|w| w.0.as_slice()).collect();
        assert_eq!(w, vec![&[5, 6, 7, 8][..], &[3, 2][..]]);
        assert_eq!((p.longest, p.edges.clone()), (6, vec![0, 1, 2, 4]));
        assert!(p.warning().is_none());
        // Without an EOS id: one document.
        let one = PositionLoss::from_heldout(&h, 64, None).unwrap();
        assert_eq!((one.windows.len(), one.windows[0].0.len()), (1, 9));
        assert!(one.warning().unwrap().contains("buckets from position 32 on stay empty"));
        let e = PositionLoss::from_heldout(&HeldOut::from_ids("x", vec![2, 2]).unwrap(), 4, Some(2)).unwrap_err();
        assert!(e.to_string().contains("--eval-positions"), "{e}");
        // Recorded starts decide, not the EOS: documents [5 6 7] [8 9 2 3] [2 4].
        let mut h = HeldOut::from_ids("d", vec![5, 6, 7, 8, 9, 2, 3, 2, 4]).unwrap();
        h.starts = Some(vec![0, 3, 7]);
        let p = PositionLoss::from_heldout(&h, 3, Some(2)).unwrap();
        let w: Vec<&[u32]> = p.windows.iter().map(|w| w.0.as_slice()).collect();
        assert_eq!((w, p.longest), (vec![&[5, 6, 7][..], &[8, 9, 2][..], &[2, 4][..]], 4));
    }
}
