//! The progress display: a bar with step, loss, tokens/s and time left, redrawn in place on stderr when
//! stderr is a terminal; per-step lines go to stdout above it (so logs and pipes get plain lines only).

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// A progress bar over `total` steps.
pub struct Progress {
    total: usize,
    start: Instant,
    first: usize,
    enabled: bool,
    last: String,
}

impl Progress {
    /// A bar from step `first` to `total`; drawn only when `enabled` and stderr is a terminal.
    pub fn new(first: usize, total: usize, enabled: bool) -> Self {
        let enabled = enabled && std::io::stderr().is_terminal();
        Self { total, start: Instant::now(), first, enabled, last: String::new() }
    }

    /// Prints `line` on stdout, above the bar.
    pub fn println(&mut self, line: &str) {
        self.clear();
        println!("{line}");
        let _ = std::io::stdout().flush();
        self.redraw();
    }

    /// Updates the bar after `done` steps (of `total`), with the latest loss and throughput.
    pub fn update(&mut self, done: usize, loss: f64, tokens_per_s: f64) {
        if !self.enabled {
            return;
        }
        let width = 30;
        let filled = (done * width / self.total.max(1)).min(width);
        let elapsed = self.start.elapsed().as_secs_f64();
        let per_step = elapsed / (done - self.first).max(1) as f64;
        let left = per_step * (self.total - done) as f64;
        self.last = format!(
            "[{}{}] {done}/{} loss {loss:.4} {tokens_per_s:.0} tok/s {:.0}s left",
            "#".repeat(filled),
            "-".repeat(width - filled),
            self.total,
            left
        );
        self.redraw();
    }

    fn clear(&self) {
        if self.enabled && !self.last.is_empty() {
            eprint!("\r\x1b[2K");
        }
    }

    fn redraw(&self) {
        if self.enabled && !self.last.is_empty() {
            eprint!("\r\x1b[2K{}", self.last);
            let _ = std::io::stderr().flush();
        }
    }

    /// Removes the bar (at the end).
    pub fn finish(&mut self) {
        self.clear();
        self.last.clear();
    }
}
