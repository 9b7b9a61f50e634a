//! [`Curriculum`]: the sequence length of each step. Stages of shorter sequences first, then the run's
//! `seq_len`; every step trains on `seq_len` tokens per micro-batch (`seq_len / length` sequences of the
//! stage's length), so the tokens per step stay constant. Long-range skills are learned much faster on short
//! sequences first (the needles task learns its retrieval at 256 tokens, then sharpens it at length).

use super::error::{Result, TrainError};

/// Sequence lengths over training: `stages` of (length, steps) first, then the run's `seq_len` for the
/// remaining steps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Curriculum {
    /// (length, steps), in order; each length divides `seq_len` and is shorter.
    pub stages: Vec<(usize, usize)>,
}

impl Curriculum {
    /// No stages: every step at `seq_len`.
    pub fn none() -> Self {
        Self::default()
    }

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
        Self { stages }
    }

    /// Parses `--curriculum`: `none`, or `L1:S1,L2:S2,...` (S_i steps at L_i tokens, then `seq_len`). Each
    /// length must divide `seq_len` and be shorter than it ([`TrainError::Config`] otherwise).
    pub fn parse(s: &str, seq_len: usize) -> Result<Self> {
        let mut stages = Vec::new();
        if s != "none" {
            for part in s.split(',') {
                let parsed =
                    part.split_once(':').and_then(|(l, n)| Some((l.trim().parse().ok()?, n.trim().parse().ok()?)));
                let Some((len, steps)) = parsed else {
                    return Err(TrainError::Config(format!(
                        "--curriculum `{s}`: `{part}` is not LENGTH:STEPS; give e.g. 256:60,1024:40 (or none)"
                    )));
                };
                if len == 0 || len >= seq_len || !seq_len.is_multiple_of(len) {
                    return Err(TrainError::Config(format!(
                        "--curriculum `{s}`: length {len} must be shorter than --seq-len {seq_len} and divide it"
                    )));
                }
                stages.push((len, steps));
            }
        }
        Ok(Self { stages })
    }

    /// Checks the stages against `seq_len` (what [`Curriculum::parse`] checks of a spelled one).
    pub fn validate(&self, seq_len: usize) -> Result<()> {
        Self::parse(&self.flag(), seq_len).map(|_| ())
    }

    /// How `--curriculum` spells it (`none` without stages).
    pub fn flag(&self) -> String {
        if self.stages.is_empty() {
            return "none".into();
        }
        self.stages.iter().map(|(l, s)| format!("{l}:{s}")).collect::<Vec<_>>().join(",")
    }

    /// The sequence length of (0-based) `step` in a run of `seq_len`.
    pub fn len_at(&self, step: usize, seq_len: usize) -> usize {
        let mut end = 0;
        for &(len, steps) in &self.stages {
            end += steps;
            if step < end {
                return len;
            }
        }
        seq_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_curriculum_doubles_to_seq_len_and_parses_back() {
        let c = Curriculum::default_for(4096, 200);
        assert_eq!(c.stages, vec![(256, 80), (512, 33), (1024, 33), (2048, 34)]);
        let at = |s| c.len_at(s, 4096);
        assert_eq!((at(0), at(79), at(80), at(179), at(180)), (256, 256, 512, 2048, 4096));
        assert_eq!(Curriculum::parse(&c.flag(), 4096).unwrap(), c);
        assert_eq!(c.flag(), "256:80,512:33,1024:33,2048:34");
        assert!(Curriculum::default_for(256, 10).stages.is_empty());
        assert_eq!(Curriculum::default_for(512, 12).stages, vec![(256, 10)]);
        assert!(Curriculum::parse("none", 512).unwrap().stages.is_empty());
        for bad in ["300:5", "512:5", "256", "x:1"] {
            assert!(Curriculum::parse(bad, 512).is_err(), "{bad}");
        }
        assert!(c.validate(4096).is_ok() && c.validate(2048).is_err());
    }
}
