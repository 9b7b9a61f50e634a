//! Where the backward pass running on this thread stands ([`BackwardMark`]): how many of its nodes it has
//! differentiated, of how many; and where the forward pass stands ([`ForwardMark`]): how many of its
//! checkpoint regions (decoder blocks) it has begun. The tape sets both; work handed to another thread (a
//! gradient bucket posted to a communication thread, a block's weights asked of the gather prefetch) carries
//! the marks of its posting with it ([`with_mark`], [`with_forward_mark`]), so that a recording process group
//! can show that a reduction was posted before backward ended, or a block's weights gathered before the block
//! began ([`crate::comm::RecordingGroup`]).

use std::cell::Cell;
use std::thread::LocalKey;

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

/// A point in one forward pass: `begun` of its checkpoint regions (decoder blocks, in order) have begun, so
/// block `begun - 1` is computing (or was the last to run, once the forward is past the blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardMark {
    /// Regions the forward has begun so far.
    pub begun: usize,
}

thread_local! {
    static MARK: Cell<Option<BackwardMark>> = const { Cell::new(None) };
    static FORWARD: Cell<Option<ForwardMark>> = const { Cell::new(None) };
}

/// The mark of the backward pass running on this thread (or of the work this thread runs for one, inside
/// [`with_mark`]); `None` outside both.
pub fn current_mark() -> Option<BackwardMark> {
    MARK.with(Cell::get)
}

/// Runs `f` with this thread's mark set to `mark` (restored after): for work another thread posted during a
/// backward pass, so that what it records carries where that backward stood when the work was posted.
pub fn with_mark<T>(mark: Option<BackwardMark>, f: impl FnOnce() -> T) -> T {
    with_set(&MARK, mark, f)
}

/// Sets this thread's mark (the tape, while backward runs).
pub(crate) fn set_mark(mark: Option<BackwardMark>) {
    MARK.with(|m| m.set(mark));
}

/// The mark of the forward pass running on this thread (or of the work this thread runs for one, inside
/// [`with_forward_mark`]); `None` before the forward's first region, after it (backward began or the tape
/// went), and outside both.
pub fn current_forward_mark() -> Option<ForwardMark> {
    FORWARD.with(Cell::get)
}

/// Runs `f` with this thread's forward mark set to `mark` (restored after): for work another thread asked for
/// during a forward pass ([`with_mark`]'s counterpart).
pub fn with_forward_mark<T>(mark: Option<ForwardMark>, f: impl FnOnce() -> T) -> T {
    with_set(&FORWARD, mark, f)
}

/// Runs `f` with the thread-local `cell` set to `mark`, restored after, also when `f` panics (as
/// [`crate::dispatch::with_kernels`] restores its choice).
fn with_set<M: Copy + 'static, T>(
    cell: &'static LocalKey<Cell<Option<M>>>,
    mark: Option<M>,
    f: impl FnOnce() -> T,
) -> T {
    struct Restore<M: Copy + 'static>(&'static LocalKey<Cell<Option<M>>>, Option<M>);
    impl<M: Copy + 'static> Drop for Restore<M> {
        fn drop(&mut self) {
            self.0.with(|m| m.set(self.1));
        }
    }
    let _restore = Restore(cell, cell.with(|m| m.replace(mark)));
    f()
}

/// Sets this thread's forward mark (the tape, as a region begins and once its forward is over).
pub(crate) fn set_forward_mark(mark: Option<ForwardMark>) {
    FORWARD.with(|m| m.set(mark));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CheckpointPolicy, Tape};
    use candle_core::{Device, Tensor};

    /// A recording tape marks the regions its forward began, from the first on; backward starting clears the
    /// mark, and so does the tape going; an inference tape marks nothing; `with_forward_mark` restores the
    /// mark it replaced.
    #[test]
    fn a_recording_tape_marks_the_regions_its_forward_began_until_backward() -> crate::Result<()> {
        let tape = Tape::new(CheckpointPolicy::Full);
        assert_eq!(current_forward_mark(), None);
        let x = tape.leaf(Tensor::new(1f32, &Device::Cpu)?);
        let mut y = x;
        for begun in 1..=2 {
            y = tape.checkpoint("block", |t| crate::ops::scale(t, &y, 2.0))?;
            assert_eq!(current_forward_mark(), Some(ForwardMark { begun }));
        }
        let inner = with_forward_mark(None, current_forward_mark);
        assert_eq!((inner, current_forward_mark()), (None, Some(ForwardMark { begun: 2 })));
        tape.backward(&y)?;
        assert_eq!(current_forward_mark(), None, "backward began: the forward is over");
        let tape = Tape::new(CheckpointPolicy::Full);
        tape.checkpoint("block", |_| Ok(()))?;
        assert_eq!(current_forward_mark(), Some(ForwardMark { begun: 1 }));
        drop(tape);
        assert_eq!(current_forward_mark(), None, "the tape went");
        Tape::inference().checkpoint("block", |_| Ok(()))?;
        assert_eq!(current_forward_mark(), None, "an inference tape marks nothing");
        Ok(())
    }

    /// `with_mark` restores the mark it replaced also when its work panics (a communication thread's gather
    /// that panicked leaves no stale mark behind).
    #[test]
    fn with_mark_restores_the_mark_when_its_work_panics() {
        let outer = Some(BackwardMark { done: 1, total: 3 });
        with_mark(outer, || {
            let inner = Some(BackwardMark { done: 2, total: 3 });
            let panicked = std::panic::catch_unwind(|| with_mark(inner, || panic!("a gather failed")));
            assert!(panicked.is_err());
            assert_eq!(current_mark(), outer, "the mark before the work");
        });
        assert_eq!(current_mark(), None);
    }
}
