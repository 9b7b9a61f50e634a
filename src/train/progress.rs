//! A console progress display for a binary that asks for one: a bar with step, loss, tokens/s and time left,
//! redrawn in place on stderr when stderr is a terminal; report lines go to stdout above it (so logs and
//! pipes get plain lines only).

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// A progress bar over `total` steps.
#[derive(Debug)]
pub struct Progress {
    total: usize,
    start: Instant,
    first: Option<usize>,
    enabled: bool,
    last: String,
}

impl Progress {
    /// A bar up to step `total`, timed from now; drawn only when `enabled` and stderr is a terminal. The
    /// first update fixes the step it started from (a resumed run starts past 0).
    pub fn new(total: usize, enabled: bool) -> Self {
        let enabled = enabled && std::io::stderr().is_terminal();
        Self { total, start: Instant::now(), first: None, enabled, last: String::new() }
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
        let first = *self.first.get_or_insert(done.saturating_sub(1));
        let per_step = elapsed / (done - first).max(1) as f64;
        let left = per_step * self.total.saturating_sub(done) as f64;
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
