//! Where the backward pass running on this thread stands ([`BackwardMark`]): how many of its nodes it has
//! differentiated, of how many. The tape sets it while backward runs; work handed to another thread (a
//! gradient bucket posted to a communication thread) carries the mark of its posting with it
//! ([`with_mark`]), so that a recording process group can show that a reduction was posted before backward
//! ended ([`crate::comm::RecordingGroup`]).

use std::cell::Cell;

/// A point in one backward pass: `done` of its `total` nodes differentiated (`done == total`: backward
/// ended, or the work was posted after it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardMark {
    /// Nodes backward has differentiated so far.
    pub done: usize,
    /// Nodes it differentiates in all.
    pub total: usize,
}

impl BackwardMark {
    /// Whether backward still had nodes to differentiate at this mark.
    pub fn before_end(&self) -> bool {
        self.done < self.total
    }
}

thread_local! {
    static MARK: Cell<Option<BackwardMark>> = const { Cell::new(None) };
}

/// The mark of the backward pass running on this thread (or of the work this thread runs for one, inside
/// [`with_mark`]); `None` outside both.
pub fn current_mark() -> Option<BackwardMark> {
    MARK.with(Cell::get)
}

/// Runs `f` with this thread's mark set to `mark` (restored after): for work another thread posted during a
/// backward pass, so that what it records carries where that backward stood when the work was posted.
pub fn with_mark<T>(mark: Option<BackwardMark>, f: impl FnOnce() -> T) -> T {
    let before = MARK.with(|m| m.replace(mark));
    let out = f();
    MARK.with(|m| m.set(before));
    out
}

/// Sets this thread's mark (the tape, while backward runs).
pub(crate) fn set_mark(mark: Option<BackwardMark>) {
    MARK.with(|m| m.set(mark));
}
