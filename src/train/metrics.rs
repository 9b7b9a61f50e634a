//! Metrics: the per-step record ([`StepRecord`], a report line and a JSON object), the JSON-lines file they
//! go to ([`MetricsLog`], `--metrics`), and the [`Summary`] a run ends with: training loss first and last,
//! held-out loss and task accuracy before and after, throughput, peak memory per rank and where the checkpoint
//! went, as a table and as one JSON object (the metrics file's last line).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::error::{IoContext, Result};

/// One optimizer step, as reported (rank 0 holds every rank's peaks).
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// The step just done (1-based).
    pub step: usize,
    /// Steps of the whole run.
    pub steps: usize,
    /// Its loss: the token-weighted mean over its micro-batches (global over the ranks).
    pub loss: f64,
    /// The learning rate it used.
    pub lr: f64,
    /// The gradients' global L2 norm before clipping.
    pub grad_norm: f64,
    /// The loss scale the step ran at, when the run scales its loss (f16).
    pub loss_scale: Option<f64>,
    /// Reads of computed tensors back to the host during the step on rank 0 ([`autosp_core::host_read`]):
    /// each one a device synchronisation on a GPU.
    pub host_reads: u64,
    /// Tokens per second of the step (all ranks' tokens: the step's sequence tokens).
    pub tokens_per_s: f64,
    /// Each rank's tape peak during the step, bytes.
    pub tape_peak: Vec<u64>,
    /// Each rank's process heap peak so far, bytes (0 without a tracking allocator).
    pub heap_peak: Vec<u64>,
    /// The largest heap peak of any rank over the run so far, bytes.
    pub heap_peak_max: u64,
    /// On a GPU, the largest device-memory peak of any rank's GPU over the run so far, bytes
    /// ([`crate::device::device_memory_peak`]); `None` on the CPU.
    pub device_peak_max: Option<u64>,
}

impl std::fmt::Display for StepRecord {
    /// `step    3/12 loss 5.0851 lr 1.00e-2 grad-norm 4.458   17867 tok/s tape peak [0.9, 0.9] MiB process
    /// peak 6.9 MiB`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tape: Vec<String> = self.tape_peak.iter().map(|v| format!("{:.1}", mib(*v as f64))).collect();
        write!(
            f,
            "step {:>4}/{} loss {:.4} lr {:.2e} grad-norm {:.3} {:>7.0} tok/s tape peak [{}] MiB process peak {:.1} MiB",
            self.step,
            self.steps,
            self.loss,
            self.lr,
            self.grad_norm,
            self.tokens_per_s,
            tape.join(", "),
            mib(self.heap_peak_max as f64)
        )?;
        if let Some(d) = self.device_peak_max {
            write!(f, " device peak {:.1} MiB", mib(d as f64))?;
        }
        match self.loss_scale {
            Some(s) => write!(f, " loss-scale {s}"),
            None => Ok(()),
        }
    }
}

impl StepRecord {
    /// The metrics file's line: step, loss, lr, grad norm, tokens/s, peak bytes per rank.
    pub fn to_json(&self) -> Value {
        json!({
            "step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens_per_s, "tape_peak_bytes": self.tape_peak,
            "process_peak_bytes": self.heap_peak, "device_peak_bytes": self.device_peak_max,
            "loss_scale": self.loss_scale, "host_reads": self.host_reads,
        })
    }
}

/// A JSON-lines metrics file, appended to: one object per step ([`StepRecord::to_json`]), per skipped step
/// (`{"step", "skipped"}`), per held-out evaluation (`{"step", "eval_loss"}`), and the summary last
/// ([`Summary::to_json`]).
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
}

impl MetricsLog {
    /// Opens `path` for appending (created if missing).
    pub fn append(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .io(|| format!("opening --metrics {}", path.display()))?;
        Ok(Self { path: path.to_path_buf(), file })
    }

    /// Appends `line` (one JSON value, one line).
    pub fn write(&mut self, line: &Value) -> Result<()> {
        writeln!(self.file, "{line}").io(|| format!("writing --metrics {}", self.path.display()))
    }
}

/// What a finished run reports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    /// The step the run started from (0, or the resumed checkpoint's step).
    pub first_step: usize,
    /// The step it ended at.
    pub last_step: usize,
    /// Training loss of the first and of the last step this run took (none when it took no step).
    pub loss: Option<(f64, f64)>,
    /// Held-out loss before and after training (`--eval-data`).
    pub eval: Option<EvalLoss>,
    /// The task's accuracy before and after training, when the task has one.
    pub accuracy: Option<Accuracy>,
    /// Tokens trained on and the seconds the steps took (none when no step ran).
    pub throughput: Option<(usize, f64)>,
    /// The vector path the CPU kernels ran on (`avx512`, `avx2`, `neon`, `scalar`; `AUTOSP_SIMD`) and the
    /// kernels candle's matmuls ran on ([`crate::cpu_matmul::kernels`]), none off the CPU.
    pub vector_path: Option<(&'static str, &'static str)>,
    /// The tape's peak bytes on each rank.
    pub tape_peak: Vec<f64>,
    /// The process heap's peak bytes on each rank (thread ranks share one process: every entry is the same).
    pub heap_peak: Vec<f64>,
    /// Whether the ranks are threads of one process.
    pub threads: bool,
    /// Steps skipped for a non-finite loss or gradient norm (`--skip-nonfinite`).
    pub skipped: usize,
    /// Training windows without a trainable target (they added nothing) and windows drawn in all.
    pub untrained_windows: (usize, usize),
    /// Steps skipped because no window of theirs held a trainable target.
    pub no_target_steps: usize,
    /// The loss scale at the end and the steps skipped for an f16 overflow, when the run scaled its loss.
    pub loss_scale: Option<(f64, usize)>,
    /// On a GPU, each rank's device-memory peak, bytes (`None` on the CPU).
    pub device_peak: Option<Vec<f64>>,
    /// The checkpoint written at the end; `None` when nothing was trained and none was asked for (an
    /// evaluation run: `--steps 0`, or no step past the checkpoint resumed, without `--save`).
    pub checkpoint: Option<PathBuf>,
    /// Further tables printed after the summary's own (the long-context evaluations: the passkey grid, the
    /// loss by position).
    pub tables: Vec<Table>,
}

/// A table of its own under the summary: a title, a header row and rows of cells, printed with aligned
/// columns.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Table {
    /// The line above it.
    pub title: String,
    /// The column names.
    pub header: Vec<String>,
    /// The rows, each as many cells as the header or fewer.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// `title:` then `| a | b |` lines, a rule under the header, columns aligned.
    pub fn render(&self) -> String {
        let cols = self.header.len().max(self.rows.iter().map(Vec::len).max().unwrap_or(0));
        let cell = |r: &[String], i: usize| r.get(i).cloned().unwrap_or_default();
        let width: Vec<usize> = (0..cols)
            .map(|i| self.rows.iter().chain([&self.header]).map(|r| cell(r, i).chars().count()).max().unwrap_or(0))
            .collect();
        let line = |r: &[String]| {
            let cells: Vec<String> = (0..cols).map(|i| format!(" {:<w$} ", cell(r, i), w = width[i])).collect();
            format!("|{}|\n", cells.join("|"))
        };
        let mut out = format!("{}:\n", self.title);
        out.push_str(&line(&self.header));
        let rule: Vec<String> = width.iter().map(|w| "-".repeat(w + 2)).collect();
        out.push_str(&format!("|{}|\n", rule.join("|")));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

/// Mean token loss on held-out tokens, before and after training.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalLoss {
    /// Before training (or at the resumed step).
    pub before: f64,
    /// After training.
    pub after: f64,
    /// Tokens in the held-out sequence (one fewer next-token targets are scored).
    pub tokens: usize,
    /// Where the tokens came from.
    pub source: String,
}

/// A task's accuracy before and after training; the task fills it.
#[derive(Clone, Debug, PartialEq)]
pub struct Accuracy {
    /// What is measured, e.g. `passkey` (the row reads `passkey accuracy`).
    pub what: String,
    /// Before training.
    pub before: Score,
    /// After training.
    pub after: Score,
    /// The accuracy of guessing, when the task has a known one (needles: 1 in 16).
    pub chance: Option<f64>,
}

/// `right` of `total` `unit`s (e.g. answer tokens), with an optional note (e.g. `2/8 whole keys`).
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    /// Right answers.
    pub right: usize,
    /// Answers.
    pub total: usize,
    /// What an answer is (`answer tokens`).
    pub unit: String,
    /// A note after the fraction (`1/8 whole keys`).
    pub note: String,
}

impl Score {
    /// `12.5% (5/40 answer tokens, 1/8 whole keys)`.
    fn show(&self) -> String {
        let pct = 100.0 * self.right as f64 / self.total.max(1) as f64;
        let unit = if self.unit.is_empty() { String::new() } else { format!(" {}", self.unit) };
        let note = if self.note.is_empty() { String::new() } else { format!(", {}", self.note) };
        format!("{pct:.1}% ({}/{}{unit}{note})", self.right, self.total)
    }
}

/// Bytes in MiB.
pub(crate) fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

fn mib_list(v: &[f64]) -> String {
    let parts: Vec<String> = v.iter().map(|b| format!("{:.1}", mib(*b))).collect();
    format!("[{}] MiB", parts.join(", "))
}

impl Summary {
    /// The rows of the table: (what, value).
    pub fn rows(&self) -> Vec<(String, String)> {
        let mut rows = Vec::new();
        if let Some((first, last)) = self.loss {
            rows.push((
                "training loss".to_string(),
                format!("{first:.4} (step {}) -> {last:.4} (step {})", self.first_step + 1, self.last_step),
            ));
        }
        if let Some(e) = &self.eval {
            rows.push((
                "held-out loss".to_string(),
                format!(
                    "{:.4} -> {:.4} ({:+.4}; {} tokens of {})",
                    e.before,
                    e.after,
                    e.after - e.before,
                    e.tokens,
                    e.source
                ),
            ));
        }
        if let Some(a) = &self.accuracy {
            let chance = a.chance.map(|c| format!("; chance {:.1}%", 100.0 * c)).unwrap_or_default();
            rows.push((format!("{} accuracy", a.what), format!("{} -> {}{chance}", a.before.show(), a.after.show())));
        }
        if let Some((tokens, seconds)) = self.throughput {
            rows.push((
                "throughput".to_string(),
                format!(
                    "{:.0} tokens/s ({tokens} tokens in {seconds:.1} s over {} steps{})",
                    tokens as f64 / seconds,
                    self.last_step - self.first_step,
                    self.vector_path
                        .map(|(p, m)| format!("; CPU kernels on the {p} vector path, matmuls on gemm's {m}"))
                        .unwrap_or_default()
                ),
            ));
        }
        rows.push(("tape peak per rank".to_string(), mib_list(&self.tape_peak)));
        if self.threads {
            let p = self.heap_peak.len();
            let heap = self.heap_peak.first().copied().unwrap_or(0.0);
            rows.push((
                "process heap peak".to_string(),
                format!("{:.1} MiB (one process holds all {p} thread ranks)", mib(heap)),
            ));
        } else {
            rows.push(("process heap peak per rank".to_string(), mib_list(&self.heap_peak)));
        }
        if let Some(d) = &self.device_peak {
            rows.push(("device memory peak per rank".to_string(), mib_list(d)));
        }
        if self.skipped > 0 {
            rows.push(("skipped steps".to_string(), format!("{} (non-finite loss or gradient norm)", self.skipped)));
        }
        if self.untrained_windows.0 > 0 {
            let (none, all) = self.untrained_windows;
            rows.push((
                "windows without a target".to_string(),
                format!("{none} of {all} (no assistant token): they added nothing to their steps"),
            ));
        }
        if self.no_target_steps > 0 {
            rows.push((
                "steps without a target".to_string(),
                format!("{} skipped (no window of theirs had a trainable token)", self.no_target_steps),
            ));
        }
        if let Some((scale, overflows)) = self.loss_scale {
            rows.push((
                "loss scale (f16)".to_string(),
                format!("{scale} at the end; {overflows} step(s) skipped for a gradient overflow"),
            ));
        }
        let checkpoint = match &self.checkpoint {
            Some(dir) => format!(
                "{} ({}; optimizer and trainer state beside)",
                dir.display(),
                if autosp_models::is_adapter(dir) { "the LoRA adapter in PEFT's layout" } else { "HF layout" }
            ),
            None => "none written (nothing trained; --save DIR writes the model as loaded)".to_string(),
        };
        rows.push(("checkpoint".to_string(), checkpoint));
        rows
    }

    /// The table as text: a title line (`== {name} summary ==`), then one `| what | value |` row per quantity,
    /// columns aligned; then the further [`tables`](Self::tables), each after an empty line.
    pub fn table(&self, name: &str) -> String {
        let rows = self.rows();
        let w = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0).max("what".len());
        let v = rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0).max("value".len());
        let mut out = format!("== {name} summary ==\n");
        out.push_str(&format!("| {:<w$} | {:<v$} |\n", "what", "value"));
        out.push_str(&format!("|{}|{}|\n", "-".repeat(w + 2), "-".repeat(v + 2)));
        for (k, val) in &rows {
            out.push_str(&format!("| {k:<w$} | {val:<v$} |\n"));
        }
        for t in &self.tables {
            out.push('\n');
            out.push_str(&t.render());
        }
        out
    }

    /// The summary as one JSON object (`{"summary": {...}}`), the last line of the `--metrics` file.
    pub fn to_json(&self) -> Value {
        let score = |s: &Score| json!({ "right": s.right, "total": s.total, "unit": s.unit, "note": s.note });
        json!({ "summary": {
            "first_step": self.first_step,
            "last_step": self.last_step,
            "loss_first": self.loss.map(|l| l.0),
            "loss_last": self.loss.map(|l| l.1),
            "eval": self.eval.as_ref().map(|e| json!({
                "before": e.before, "after": e.after, "tokens": e.tokens, "source": e.source,
            })),
            "accuracy": self.accuracy.as_ref().map(|a| json!({
                "what": a.what, "before": score(&a.before), "after": score(&a.after),
            })),
            "tokens": self.throughput.map(|t| t.0),
            "seconds": self.throughput.map(|t| t.1),
            "tokens_per_s": self.throughput.map(|(t, s)| t as f64 / s),
            "vector_path": self.vector_path.map(|v| v.0),
            "matmul_kernels": self.vector_path.map(|v| v.1),
            "tape_peak_bytes": self.tape_peak.iter().map(|b| *b as u64).collect::<Vec<_>>(),
            "process_peak_bytes": self.heap_peak.iter().map(|b| *b as u64).collect::<Vec<_>>(),
            "skipped": self.skipped,
            "untrained_windows": self.untrained_windows.0,
            "windows": self.untrained_windows.1,
            "no_target_steps": self.no_target_steps,
            "loss_scale": self.loss_scale.map(|l| l.0),
            "overflow_skips": self.loss_scale.map(|l| l.1),
            "device_peak_bytes": self.device_peak.as_ref().map(|d| d.iter().map(|b| *b as u64).collect::<Vec<_>>()),
            "checkpoint": self.checkpoint.as_ref().map(|c| c.display().to_string()),
        }})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> Summary {
        Summary {
            first_step: 0,
            last_step: 4,
            loss: Some((3.25, 2.5)),
            eval: Some(EvalLoss { before: 3.5, after: 3.0, tokens: 8191, source: "heldout.txt".into() }),
            accuracy: Some(Accuracy {
                what: "passkey".into(),
                before: Score { right: 2, total: 40, unit: "answer tokens".into(), note: "0/8 whole keys".into() },
                after: Score { right: 10, total: 40, unit: String::new(), note: String::new() },
                chance: Some(0.1),
            }),
            throughput: Some((32768, 16.0)),
            vector_path: Some(("avx2", "avx2")),
            tape_peak: vec![2.0 * (1 << 20) as f64, 3.0 * (1 << 20) as f64],
            heap_peak: vec![(100u64 << 20) as f64; 2],
            threads: true,
            skipped: 0,
            untrained_windows: (0, 8),
            no_target_steps: 0,
            loss_scale: None,
            device_peak: None,
            checkpoint: Some(PathBuf::from("runs/x/step-4")),
            tables: Vec::new(),
        }
    }

    #[test]
    fn further_tables_follow_the_summary_with_aligned_columns() {
        let t = Table {
            title: "passkey retrieval".into(),
            header: vec!["length".into(), "0%".into(), "100%".into()],
            rows: vec![vec!["256".into(), "0/5 -> 5/5".into(), "1/5".into()], vec!["4096".into()]],
        };
        let s = Summary { tables: vec![t], ..full() };
        let out = s.table("x");
        let tail: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("passkey retrieval:")).collect();
        assert_eq!(
            tail,
            vec![
                "passkey retrieval:",
                "| length | 0%         | 100% |",
                "|--------|------------|------|",
                "| 256    | 0/5 -> 5/5 | 1/5  |",
                "| 4096   |            |      |",
            ],
            "{out}"
        );
    }

    #[test]
    fn the_table_has_every_quantity_in_aligned_rows() {
        let t = full().table("llama_longctx");
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "== llama_longctx summary ==");
        // Every row (header, rule and 7 quantities) has the same width, so the columns line up.
        assert_eq!(lines.len(), 1 + 2 + 7, "{t}");
        let width = lines[1].chars().count();
        assert!(lines[1..].iter().all(|l| l.chars().count() == width), "{t}");
        for want in [
            "| training loss ",
            "3.2500 (step 1) -> 2.5000 (step 4)",
            "3.5000 -> 3.0000 (-0.5000; 8191 tokens of heldout.txt)",
            "| passkey accuracy ",
            "5.0% (2/40 answer tokens, 0/8 whole keys) -> 25.0% (10/40)",
            "2048 tokens/s (32768 tokens in 16.0 s over 4 steps; CPU kernels on the avx2 vector path, matmuls on gemm's avx2)",
            "[2.0, 3.0] MiB",
            "100.0 MiB (one process holds all 2 thread ranks)",
            "runs/x/step-4",
        ] {
            assert!(t.contains(want), "missing `{want}` in\n{t}");
        }
    }

    #[test]
    fn absent_quantities_have_no_row_and_mpi_ranks_list_their_heaps() {
        let s = Summary {
            first_step: 4,
            last_step: 4,
            threads: false,
            heap_peak: vec![(1u64 << 20) as f64, (2u64 << 20) as f64],
            tape_peak: vec![0.0, 0.0],
            skipped: 1,
            untrained_windows: (3, 10),
            no_target_steps: 1,
            checkpoint: Some(PathBuf::from("c")),
            ..Summary::default()
        };
        let t = s.table("llama_longctx");
        assert!(!t.contains("training loss") && !t.contains("held-out") && !t.contains("accuracy"), "{t}");
        assert!(!t.contains("throughput"), "{t}");
        assert!(t.contains("| process heap peak per rank | [1.0, 2.0] MiB"), "{t}");
        assert!(t.contains("| skipped steps "), "{t}");
        assert!(t.contains("3 of 10 (no assistant token): they added nothing"), "{t}");
        assert!(t.contains("| steps without a target ") && t.contains("| 1 skipped (no window of theirs"), "{t}");
        assert!(!full().table("x").contains("without a target"));
    }

    #[test]
    fn the_json_carries_the_numbers() {
        let j = full().to_json();
        let s = &j["summary"];
        assert_eq!(s["loss_first"], 3.25);
        assert_eq!(s["loss_last"], 2.5);
        assert_eq!(s["eval"]["after"], 3.0);
        assert_eq!(s["accuracy"]["after"]["right"], 10);
        assert_eq!(s["tokens_per_s"], 2048.0);
        assert_eq!(s["tape_peak_bytes"][1], 3u64 << 20);
        assert_eq!(s["checkpoint"], "runs/x/step-4");
        assert!(Summary::default().to_json()["summary"]["loss_first"].is_null());
    }

    /// The step line, exactly as `llama_longctx` prints it, and its JSON.
    #[test]
    fn a_step_record_reads_as_the_step_line() {
        let r = StepRecord {
            step: 3,
            steps: 12,
            loss: 5.08512,
            lr: 0.01,
            grad_norm: 4.4581,
            loss_scale: None,
            host_reads: 3,
            tokens_per_s: 17867.2,
            tape_peak: vec![943_718, 943_718],
            heap_peak: vec![7_235_174, 7_235_174],
            heap_peak_max: 7_235_174,
            device_peak_max: None,
        };
        assert_eq!(
            r.to_string(),
            "step    3/12 loss 5.0851 lr 1.00e-2 grad-norm 4.458   17867 tok/s tape peak [0.9, 0.9] MiB process peak \
             6.9 MiB"
        );
        let j = r.to_json();
        assert_eq!((j["step"].as_u64(), j["loss"].as_f64()), (Some(3), Some(5.08512)));
        assert_eq!(j["tape_peak_bytes"][1], 943_718);
        assert!(j["loss_scale"].is_null() && j["device_peak_bytes"].is_null());
        let f16 = StepRecord { loss_scale: Some(32768.0), device_peak_max: Some(3 << 30), ..r };
        assert!(f16.to_string().ends_with("process peak 6.9 MiB device peak 3072.0 MiB loss-scale 32768"), "{f16}");
        assert_eq!(f16.to_json()["loss_scale"].as_f64(), Some(32768.0));
    }
}
