//! Per-rank counting of calls and bytes sent, per kind of collective, so tests can assert a plan's
//! communication exactly. The byte formulas are in the module doc of `comm`.

use std::sync::atomic::{AtomicU64, Ordering};

use super::collective::Collective;

const KINDS: usize = Collective::ALL.len();

/// A snapshot of one rank's counters on one group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    calls: [u64; KINDS],
    bytes: [u64; KINDS],
}

impl CommStats {
    /// Number of calls of `kind` started by this rank (counted after its local argument checks pass).
    pub fn calls(&self, kind: Collective) -> u64 {
        self.calls[kind.index()]
    }

    /// Tensor payload bytes this rank sent to *other* ranks in calls of `kind`.
    pub fn bytes_sent(&self, kind: Collective) -> u64 {
        self.bytes[kind.index()]
    }

    /// Calls of every kind.
    pub fn total_calls(&self) -> u64 {
        self.calls.iter().sum()
    }

    /// Payload bytes sent in calls of every kind.
    pub fn total_bytes_sent(&self) -> u64 {
        self.bytes.iter().sum()
    }
}

/// The live counters a group handle updates.
#[derive(Debug, Default)]
pub(crate) struct StatsCounter {
    calls: [AtomicU64; KINDS],
    bytes: [AtomicU64; KINDS],
}

impl StatsCounter {
    pub fn record(&self, kind: Collective, bytes: u64) {
        self.calls[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.bytes[kind.index()].fetch_add(bytes, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> CommStats {
        let mut s = CommStats::default();
        for k in 0..KINDS {
            s.calls[k] = self.calls[k].load(Ordering::Relaxed);
            s.bytes[k] = self.bytes[k].load(Ordering::Relaxed);
        }
        s
    }

    pub fn reset(&self) {
        for k in 0..KINDS {
            self.calls[k].store(0, Ordering::Relaxed);
            self.bytes[k].store(0, Ordering::Relaxed);
        }
    }
}

/// Payload size of a tensor: `elem_count * dtype size`.
pub fn tensor_bytes(t: &candle_core::Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Bytes rank `rank` of `p` sends in one `all_reduce` of `n` elements of `elem` bytes: every other rank's
/// chunk in the reduce-scatter phase and its own reduced chunk to the P-1 others, `(n + (P-2)·c_r)·elem`
/// with `c_r = n/P + (r < n % P)` (0 at P = 1). Planners use it to predict what the counters will show.
pub fn all_reduce_bytes(n: usize, p: usize, rank: usize, elem: usize) -> u64 {
    if p <= 1 {
        return 0;
    }
    let mine = super::reduce::chunk_sizes(n, p)[rank];
    ((n - mine + (p - 1) * mine) * elem) as u64
}
