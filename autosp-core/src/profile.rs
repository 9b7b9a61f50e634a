//! Where a training step's time goes, per op: when profiling is on for a thread ([`start`]), the tape times
//! every op's forward, replay and backward on that thread ([`span`]), and the step adds its own phases (the
//! gradient reduction, the optimizer). [`finish`] returns the totals by pass and op, with a detail for ops whose
//! role depends on their shape (a linear layer's `[out, in]`). Nested spans count once, in the outermost one.
//!
//! Times are wall-clock on the calling thread: exact for the CPU, whose kernels run synchronously; on a GPU they
//! measure only how long the host took to queue the work. Profiling costs two clock reads per op when on and
//! one thread-local check when off.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Instant;

/// One op's total: seconds over its calls.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Total {
    /// Wall seconds, summed over the calls.
    pub seconds: f64,
    /// Calls.
    pub calls: u64,
}

/// The totals of one profiled stretch: `(pass, op, detail) -> total`, `pass` one of `forward`, `replay`,
/// `backward` or `step`; `detail` empty or the shape that tells the op's role.
pub type Profile = BTreeMap<(&'static str, &'static str, String), Total>;

struct State {
    totals: Profile,
    depth: usize,
}

thread_local! {
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// Starts profiling on this thread (dropping anything recorded before).
pub fn start() {
    STATE.with(|s| *s.borrow_mut() = Some(State { totals: Profile::new(), depth: 0 }));
}

/// Stops profiling on this thread and returns what it recorded (`None` when it was not on).
pub fn finish() -> Option<Profile> {
    STATE.with(|s| s.borrow_mut().take().map(|s| s.totals))
}

/// A timed stretch, recorded when dropped (only while profiling is on, and only when it is the outermost one).
#[must_use = "the span records when it is dropped"]
pub struct Span {
    started: Option<(Instant, &'static str, &'static str, String)>,
}

/// Times `pass` of `op` until the returned span is dropped; `detail` (called only while profiling) names its
/// role, e.g. a weight's shape.
pub fn span(pass: &'static str, op: &'static str, detail: impl FnOnce() -> String) -> Span {
    let outermost = STATE.with(|s| match s.borrow_mut().as_mut() {
        Some(st) => {
            st.depth += 1;
            Some(st.depth == 1)
        }
        None => None,
    });
    Span {
        started: match outermost {
            Some(true) => Some((Instant::now(), pass, op, detail())),
            // Inside another span (its time is the outer one's), or profiling is off.
            Some(false) => Some((Instant::now(), "", op, String::new())),
            None => None,
        },
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let Some((t0, pass, op, detail)) = self.started.take() else { return };
        let seconds = t0.elapsed().as_secs_f64();
        STATE.with(|s| {
            if let Some(st) = s.borrow_mut().as_mut() {
                st.depth = st.depth.saturating_sub(1);
                if !pass.is_empty() {
                    let t = st.totals.entry((pass, op, detail)).or_default();
                    t.seconds += seconds;
                    t.calls += 1;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_add_up_per_op_and_nested_ones_count_once() {
        assert!(finish().is_none(), "off by default");
        {
            let _off = span("forward", "linear", || unreachable!("no detail while off"));
        }
        start();
        for _ in 0..3 {
            let _outer = span("forward", "attention", String::new);
            let _inner = span("forward", "matmul", || "inner".into());
        }
        {
            let _s = span("backward", "linear", || "[4, 8]".into());
        }
        let p = finish().unwrap();
        assert_eq!(p.len(), 2, "{p:?}");
        assert_eq!(p[&("forward", "attention", String::new())].calls, 3);
        assert_eq!(p[&("backward", "linear", "[4, 8]".to_string())].calls, 1);
        assert!(finish().is_none(), "finish turns it off");
    }
}
