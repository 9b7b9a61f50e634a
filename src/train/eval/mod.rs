//! Evaluation, forward only and collective over the compiled model (every rank calls it; any P, any mesh):
//!
//! - [`HeldOut`]: the mean next-token loss on held-out tokens (`--eval-data`), before, during and after
//!   training;
//! - [`answer_accuracy`]: teacher-forced retrieval accuracy on samples with marked answers (the synthetic
//!   tasks' probes);
//! - [`PasskeyGrid`]: the passkey test over prompt lengths × needle depths (`--eval-passkey`, `--eval-depths`,
//!   `--eval-samples`), one forward per sample, and with `--eval-passkey-generate` also by greedy generation
//!   (`passkey_generated.rs`);
//! - [`PositionLoss`]: the held-out loss by token position in buckets, each window starting at a document's
//!   start (`--eval-positions`);
//! - [`picture`]: their SVG pictures (a heatmap, a curve).
//!
//! [`LongContext`] is the door a run uses for the long-context pair: built from the options once, scored
//! ([`Trainer::score_long_context`](super::Trainer::score_long_context))
//! before and after training (once when no step ran), each time as JSON lines in the metrics file
//! (`{"eval":"passkey",..}`, `{"eval":"passkey_generated",..}`, `{"eval":"positions",..}`), and reported at the end as tables in the run's
//! [`Summary`](super::Summary) and pictures beside the metrics file (`passkey-before.svg`,
//! `passkey-after.svg`, `positions.svg`; in the `--save` directory when there is no metrics file).

mod answers;
mod heldout;
mod passkey;
mod passkey_generated;
pub mod picture;
mod positions;

use std::path::{Path, PathBuf};

use autosp_models::{LlamaConfig, LlamaModel, RopeScaling, Tokenizer};
use serde_json::Value;

pub use answers::{answer_accuracy, Answers};
pub use heldout::HeldOut;
pub use passkey::{PasskeyCell, PasskeyGrid, PasskeyScores, DEFAULT_DEPTHS, DEFAULT_SAMPLES};
pub use positions::{bucket_edges, Bucket, PositionLoss, PositionScores};

use super::error::{Result, TrainError};
use super::metrics::Table;
use super::options::RunOptions;
use super::synthetic::PasskeyVocab;
use crate::Compiled;

/// When an evaluation ran: before training (or at the resumed step), or after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// Before the first step of this run.
    Before,
    /// After its last step.
    After,
}

impl When {
    /// `before` or `after`, as the metrics lines spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            When::Before => "before",
            When::After => "after",
        }
    }
}

/// The model's windows from its config: `(window, original)`. `window`: the positions it serves, its
/// `max_position_embeddings` as scaled by its `rope_scaling` (llama3, yarn and longrope: the original window ×
/// factor when that is larger; dynamic: `max_position_embeddings` × factor; linear configs carry the scaled
/// one already). `original`: the window it was pretrained with, the scaling's
/// `original_max_position_embeddings` (linear: `max_position_embeddings` / factor), else
/// `max_position_embeddings`.
pub fn model_windows(config: &LlamaConfig) -> (usize, usize) {
    let max = config.max_position_embeddings;
    let scaled = |w: usize, f: f64| (w as f64 * f).round() as usize;
    match &config.rope_scaling {
        None => (max, max),
        Some(RopeScaling::Linear { factor }) => (max, (max as f64 / factor).round().max(1.0) as usize),
        Some(RopeScaling::Dynamic { factor }) => (scaled(max, *factor).max(max), max),
        Some(s) => {
            let original = s.original_max_position_embeddings().unwrap_or(max);
            (scaled(original, s.factor(max)).max(max), original)
        }
    }
}

/// The long-context evaluations a run asked for (`--eval-passkey`, `--eval-positions`), ready to score.
#[derive(Clone, Default)]
pub struct LongContext {
    /// The passkey grid, when asked for.
    pub passkey: Option<PasskeyGrid>,
    /// Whether the passkey grid is also scored by generation (`--eval-passkey-generate`).
    pub passkey_generate: bool,
    /// The loss by position, when asked for.
    pub positions: Option<PositionLoss>,
    /// The model's original window, marked on the loss-by-position picture ([`model_windows`]).
    pub original_window: usize,
    /// Warnings to give before the first evaluation (a passkey length past the model's window, documents too
    /// short for the last position bucket).
    pub warnings: Vec<String>,
    /// Where the pictures go.
    pub dir: PathBuf,
}

/// What one evaluation of a [`LongContext`] measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LongScores {
    /// The passkey grid's cells.
    pub passkey: Option<PasskeyScores>,
    /// The passkey grid's cells scored by generation, when asked for.
    pub passkey_generated: Option<PasskeyScores>,
    /// The loss by position's buckets.
    pub positions: Option<PositionScores>,
}

impl LongScores {
    /// The metrics lines of this evaluation, tagged `when`.
    pub fn json_lines(&self, when: When) -> Vec<Value> {
        let mut lines = self.passkey.as_ref().map(|p| p.json_lines(when)).unwrap_or_default();
        lines.extend(self.passkey_generated.as_ref().map(|p| p.json_lines(when)).unwrap_or_default());
        lines.extend(self.positions.as_ref().map(|p| p.json_lines(when)).unwrap_or_default());
        lines
    }
}

impl LongContext {
    /// The evaluations `o` asks for on a model of `config`: the passkey prompt through `tokenizer` (with fixed
    /// token ids, as `--data passkey` does, for a model without one), the loss by position on `heldout`
    /// (`--eval-data`, required for it) cut into documents at the config's EOS. Pictures go beside
    /// `o.metrics`, else into `save_dir`. Checks every option, naming it.
    pub fn from_options(
        o: &RunOptions,
        config: &LlamaConfig,
        tokenizer: Option<&Tokenizer>,
        heldout: Option<&HeldOut>,
        save_dir: &Path,
    ) -> Result<Self> {
        let (window, original_window) = model_windows(config);
        let mut warnings = Vec::new();
        if o.eval_passkey.is_none() && (o.eval_depths.is_some() || o.eval_samples.is_some()) {
            return Err(TrainError::Config(
                "--eval-depths and --eval-samples shape the passkey grid: give --eval-passkey LENGTHS too".into(),
            ));
        }
        if o.eval_passkey.is_none() && o.eval_passkey_generate {
            return Err(TrainError::Config(
                "--eval-passkey-generate scores the passkey grid by generation: give --eval-passkey LENGTHS too".into(),
            ));
        }
        let passkey = match &o.eval_passkey {
            Some(lengths) => {
                let vocab = match tokenizer {
                    Some(t) => PasskeyVocab::Text(Box::new(t.clone())),
                    None => PasskeyVocab::Ids { vocab: config.vocab_size },
                };
                let samples = o.eval_samples.unwrap_or(DEFAULT_SAMPLES);
                let grid = PasskeyGrid::parse(lengths, o.eval_depths.as_deref(), samples, o.seed, vocab)?;
                if o.eval_passkey_generate {
                    grid.check_generation(config)?;
                }
                warnings.extend(grid.warnings(window));
                Some(grid)
            }
            None => None,
        };
        let positions = match (o.eval_positions, heldout) {
            (false, _) => None,
            (true, None) => {
                return Err(TrainError::Config(
                    "--eval-positions scores the held-out documents of --eval-data: give --eval-data FILE too".into(),
                ))
            }
            (true, Some(h)) => {
                let p = PositionLoss::from_heldout(h, o.seq_len, config.eos_token_id)?;
                warnings.extend(p.warning());
                Some(p)
            }
        };
        let dir = match o.metrics.as_ref().and_then(|m| m.parent()) {
            Some(d) if d.as_os_str().is_empty() => PathBuf::from("."),
            Some(d) => d.to_path_buf(),
            None => save_dir.to_path_buf(),
        };
        Ok(Self { passkey, passkey_generate: o.eval_passkey_generate, positions, original_window, warnings, dir })
    }

    /// Whether nothing is asked for.
    pub fn is_empty(&self) -> bool {
        self.passkey.is_none() && self.positions.is_none()
    }

    /// Scores every evaluation asked for on `c` (collective: every rank calls it).
    pub fn evaluate(&self, c: &Compiled<LlamaModel>) -> Result<LongScores> {
        Ok(LongScores {
            passkey: self.passkey.as_ref().map(|g| g.evaluate(c)).transpose()?,
            passkey_generated: match &self.passkey {
                Some(g) if self.passkey_generate => Some(g.evaluate_generated(c)?),
                _ => None,
            },
            positions: self.positions.as_ref().map(|p| p.evaluate(c)).transpose()?,
        })
    }

    /// The end of a run (rank 0): writes the pictures into [`dir`](Self::dir) and returns the summary's
    /// tables and the pictures written. `after` is `None` when no step ran (the model was scored once).
    pub fn report(&self, before: &LongScores, after: Option<&LongScores>) -> Result<(Vec<Table>, Vec<PathBuf>)> {
        let (mut tables, mut pictures) = (Vec::new(), Vec::new());
        if let Some(b) = &before.passkey {
            let a = after.and_then(|a| a.passkey.as_ref());
            tables.push(passkey_table(b, a));
            for (when, s) in [(When::Before, Some(b)), (When::After, a)] {
                let Some(s) = s else { continue };
                let path = self.dir.join(format!("passkey-{}.svg", when.as_str()));
                let (hits, n) = s.total();
                picture::passkey_heatmap(&path, &format!("passkey {} training: {hits}/{n} keys", when.as_str()), s)?;
                pictures.push(path);
            }
        }
        if let Some(b) = &before.passkey_generated {
            tables.push(passkey_table(b, after.and_then(|a| a.passkey_generated.as_ref())));
        }
        if let Some(b) = &before.positions {
            let a = after.and_then(|a| a.positions.as_ref());
            tables.push(positions_table(b, a));
            let mut curves = vec![("before training", b)];
            curves.extend(a.map(|a| ("after training", a)));
            let path = self.dir.join("positions.svg");
            let source = self.positions.as_ref().map(|p| p.source.as_str()).unwrap_or("held-out data");
            picture::position_curves(
                &path,
                &format!("held-out loss by position ({source})"),
                &curves,
                self.original_window,
            )?;
            pictures.push(path);
        }
        Ok((tables, pictures))
    }
}

/// `hits/samples`, or `before -> after`.
fn change<T: std::fmt::Display>(before: T, after: Option<T>) -> String {
    match after {
        Some(a) => format!("{before} -> {a}"),
        None => before.to_string(),
    }
}

/// The passkey grid as a length × depth table, each cell `hits/samples` (before -> after); by one forward or
/// by generation, as `before` was scored.
fn passkey_table(before: &PasskeyScores, after: Option<&PasskeyScores>) -> Table {
    let (lengths, depths) = before.axes();
    let mut header = vec!["length".to_string()];
    header.extend(depths.iter().map(|d| format!("{d}%")));
    let rows = lengths
        .iter()
        .map(|&l| {
            let mut row = vec![l.to_string()];
            for &d in &depths {
                let show =
                    |s: &PasskeyScores| s.cell(l, d).map(|c| format!("{}/{}", c.hits, c.samples)).unwrap_or_default();
                row.push(change(show(before), after.map(show)));
            }
            row
        })
        .collect();
    let when = if after.is_some() { "before -> after training" } else { "no step ran" };
    let what = if before.generated { " by generation: keys generated" } else { ": keys found" };
    Table { title: format!("passkey retrieval{what} per needle depth ({when})"), header, rows }
}

/// The loss by position as a table: a row per bucket with its targets and mean loss (before -> after).
fn positions_table(before: &PositionScores, after: Option<&PositionScores>) -> Table {
    let show = |b: &Bucket| if b.targets > 0 { format!("{:.4}", b.loss) } else { "-".into() };
    let rows = before
        .buckets
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let a = after.map(|a| &a.buckets[i]);
            let mut row = vec![
                format!("{}-{}", positions::short_position(b.from), positions::short_position(b.to)),
                b.targets.to_string(),
                change(show(b), a.map(show)),
            ];
            if let Some(a) = a.filter(|a| a.targets > 0 && b.targets > 0) {
                row.push(format!("{:+.4}", a.loss - b.loss));
            }
            row
        })
        .collect();
    let mut header = vec!["positions".to_string(), "targets".into(), "mean loss".into()];
    if after.is_some() {
        header.push("change".into());
    }
    let when = if after.is_some() { "before -> after training" } else { "no step ran" };
    Table { title: format!("held-out loss by position ({when})"), header, rows }
}
