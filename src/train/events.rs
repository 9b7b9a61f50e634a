//! [`Event`]: what a training run reports as it goes, handed to the caller's observer on rank 0 (every rank
//! computes the same values; the library prints nothing). Each event reads (`Display`) as the line
//! `llama_longctx` prints for it. [`Trainer::run`](super::Trainer::run) reports steps, skips, stages,
//! held-out scores and saves; a [`Job`](super::Job) also describes the run (`Info`) and ends with an
//! `Interrupted` or a `Summary`.

use std::fmt;
use std::path::PathBuf;

use super::eval::Answers;
use super::metrics::{StepRecord, Summary};

/// One report of a training loop.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// An optimizer step was applied.
    Step(StepRecord),
    /// A step's loss or gradient norm was not finite and [`super::NonFinite::Skip`] skipped it (no update).
    Skipped {
        /// The step (1-based).
        step: usize,
        /// Steps of the run.
        steps: usize,
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// The value found.
        value: f64,
    },
    /// No window of a step held a trainable target (on any rank): the step was skipped (no update).
    NoTargets {
        /// The step (1-based).
        step: usize,
        /// Steps of the run.
        steps: usize,
        /// Windows the step drew.
        windows: usize,
    },
    /// A step's f16 gradients overflowed at loss scale `scale` (its loss was finite): no update, and the
    /// scale is now `halved` ([`super::LossScaling`]).
    Overflow {
        /// The step (1-based).
        step: usize,
        /// Steps of the run.
        steps: usize,
        /// The scale the step ran at.
        scale: f64,
        /// The scale from now on.
        halved: f64,
    },
    /// The first step's gradients were written to `path` ([`super::TrainConfig::dump_grads`]).
    GradientsWritten {
        /// The step (1-based).
        step: usize,
        /// The safetensors file.
        path: PathBuf,
    },
    /// A curriculum stage of `len`-token sequences ended after `step`: the answer accuracy of the first
    /// `samples` probes at `seq_len` tokens.
    Stage {
        /// The stage's sequence length.
        len: usize,
        /// The step it ended at.
        step: usize,
        /// The run's sequence length (the probes').
        seq_len: usize,
        /// The probes' answers.
        answers: Answers,
        /// Probes scored.
        samples: usize,
    },
    /// The held-out loss after `step` ([`super::TrainConfig::eval_every`]).
    HeldOut {
        /// The step.
        step: usize,
        /// Steps of the run.
        steps: usize,
        /// Mean next-token loss.
        loss: f64,
    },
    /// A checkpoint was saved.
    Saved(PathBuf),
    /// Saving first cleaned up after a run that died while saving into `root` (a warning: `what` was done).
    Cleaned {
        /// The save directory.
        root: PathBuf,
        /// What was removed or restored, and why.
        what: String,
    },
    /// A line describing the run (the model, the compiled plan, the task, a resume, the held-out score before
    /// training), the plan itself (`explain`), or a one-off result (`{"eval_loss": ...}`).
    Info(String),
    /// The run was stopped between steps after `step`; `checkpoint` holds the state when one was saved.
    Interrupted {
        /// Steps done.
        step: usize,
        /// Where the state went (none when no step was taken or there is no save directory).
        checkpoint: Option<PathBuf>,
        /// Whether a step was taken since the run (re)started.
        stepped: bool,
    },
    /// The run finished: its summary (reads as [`Summary::table`] titled `training`).
    Summary(Box<Summary>),
}

impl Event {
    /// The reason of a non-finite step: `loss is not finite at step 3 (NaN)`.
    pub fn nonfinite_reason(what: &str, step: usize, value: f64) -> String {
        format!("{what} is not finite at step {step} ({value})")
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Step(r) => write!(f, "{r}"),
            Event::Skipped { step, steps, what, value } => write!(
                f,
                "step {step:>4}/{steps}: skipped, {}: no update (--skip-nonfinite)",
                Event::nonfinite_reason(what, *step, *value)
            ),
            Event::NoTargets { step, steps, windows } => write!(
                f,
                "step {step:>4}/{steps}: skipped, no trainable target in its {windows} window(s) (no assistant token \
                 in any): no update"
            ),
            Event::Overflow { step, steps, scale, halved } => write!(
                f,
                "step {step:>4}/{steps}: skipped, f16 gradients overflowed at loss scale {scale}: no update, scale \
                 now {halved}"
            ),
            Event::GradientsWritten { step, path } => {
                write!(f, "gradients of step {step} written to {}", path.display())
            }
            Event::Stage { len, step, seq_len, answers, samples } => write!(
                f,
                "stage of {len}-token sequences done at step {step}: accuracy at {seq_len} tokens {:.1}% ({}/{} \
                 answers of {samples} held-out samples)",
                100.0 * answers.right as f64 / answers.total.max(1) as f64,
                answers.right,
                answers.total
            ),
            Event::HeldOut { step, steps, loss } => write!(f, "step {step:>4}/{steps} held-out loss {loss:.4}"),
            Event::Saved(dir) => write!(f, "checkpoint: {}", dir.display()),
            Event::Cleaned { root, what } => write!(f, "checkpoint directory {}: {what}", root.display()),
            Event::Info(line) => write!(f, "{line}"),
            Event::Interrupted { step, checkpoint: Some(dir), .. } => {
                write!(f, "interrupted after step {step}: checkpoint saved to {}", dir.display())
            }
            Event::Interrupted { stepped: false, .. } => {
                write!(f, "interrupted before the first step: nothing to save")
            }
            Event::Interrupted { step, .. } => {
                write!(f, "interrupted after step {step}: no save directory, nothing saved")
            }
            Event::Summary(s) => write!(f, "{}", s.table("training")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_read_as_the_lines_llama_longctx_prints() {
        let skipped = Event::Skipped { step: 3, steps: 4, what: "gradient norm", value: f64::NAN };
        assert_eq!(
            skipped.to_string(),
            "step    3/4: skipped, gradient norm is not finite at step 3 (NaN): no update (--skip-nonfinite)"
        );
        let overflow = Event::Overflow { step: 5, steps: 50, scale: 65536.0, halved: 32768.0 };
        assert_eq!(
            overflow.to_string(),
            "step    5/50: skipped, f16 gradients overflowed at loss scale 65536: no update, scale now 32768"
        );
        assert_eq!(
            Event::NoTargets { step: 2, steps: 9, windows: 2 }.to_string(),
            "step    2/9: skipped, no trainable target in its 2 window(s) (no assistant token in any): no update"
        );
        let answers = Answers { right: 4, total: 24, whole: 0 };
        let stage = Event::Stage { len: 256, step: 10, seq_len: 512, answers, samples: 4 };
        assert_eq!(
            stage.to_string(),
            "stage of 256-token sequences done at step 10: accuracy at 512 tokens 16.7% (4/24 answers of 4 held-out \
             samples)"
        );
        assert_eq!(Event::HeldOut { step: 6, steps: 12, loss: 4.5 }.to_string(), "step    6/12 held-out loss 4.5000");
        assert_eq!(Event::Saved("r/step-2".into()).to_string(), "checkpoint: r/step-2");
        let stopped = |checkpoint: Option<&str>, stepped| {
            Event::Interrupted { step: 5, checkpoint: checkpoint.map(PathBuf::from), stepped }.to_string()
        };
        assert_eq!(stopped(Some("r/step-5"), true), "interrupted after step 5: checkpoint saved to r/step-5");
        assert_eq!(stopped(None, false), "interrupted before the first step: nothing to save");
    }
}
