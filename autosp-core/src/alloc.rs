//! [`TrackingAllocator`]: a global allocator that binaries install to report the process's live and peak
//! heap bytes (`#[global_allocator] static ALLOC: TrackingAllocator = TrackingAllocator::new();`), and
//! which tape op was running when the peak was reached ([`TrackingAllocator::peak_phase`]: the tape marks
//! each op it runs forward, replays or differentiates with [`phase`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The phase running now and the one that was running at the last new peak: indices into `PHASES` + 1
/// (0: none marked).
static PHASE: AtomicUsize = AtomicUsize::new(0);
static PEAK_PHASE: AtomicUsize = AtomicUsize::new(0);
static PHASES: Mutex<Vec<(&'static str, &'static str)>> = Mutex::new(Vec::new());
/// Bytes allocated while each phase was marked (index as `PHASE`; phases past the table count in slot 0).
const PHASE_SLOTS: usize = 256;
static PHASE_BYTES: [AtomicUsize; PHASE_SLOTS] = [const { AtomicUsize::new(0) }; PHASE_SLOTS];

/// Marks what the process is doing now: `pass` (`forward`, `replay`, `backward`) of the op named `op`, for
/// [`TrackingAllocator::peak_phase`]. Process-wide: with several threads marking, the last mark wins.
pub fn phase(pass: &'static str, op: &'static str) {
    let mut names = PHASES.lock().unwrap_or_else(|e| e.into_inner());
    let i = match names.iter().position(|&n| n == (pass, op)) {
        Some(i) => i,
        None => {
            names.push((pass, op));
            names.len() - 1
        }
    };
    PHASE.store(i + 1, Ordering::Relaxed);
}

/// The system allocator, counting live bytes and their peak.
#[derive(Debug)]
pub struct TrackingAllocator {
    live: AtomicUsize,
    peak: AtomicUsize,
    allocated: AtomicUsize,
    large: AtomicUsize,
}

/// The size from which [`TrackingAllocator::large_allocations`] counts an allocation: 1 MiB (glibc serves
/// blocks this large from fresh mmap pages or a trimmed top, which the kernel zeroes and faults in).
pub const LARGE_ALLOCATION: usize = 1 << 20;

impl TrackingAllocator {
    /// A tracker with nothing counted yet.
    pub const fn new() -> Self {
        Self {
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            allocated: AtomicUsize::new(0),
            large: AtomicUsize::new(0),
        }
    }

    /// Bytes allocated since start (never decreases; a step's is the difference of two readings).
    pub fn allocated_bytes(&self) -> usize {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Allocations of at least [`LARGE_ALLOCATION`] bytes since start.
    pub fn large_allocations(&self) -> usize {
        self.large.load(Ordering::Relaxed)
    }

    /// Heap bytes allocated and not yet freed.
    pub fn live_bytes(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// The most `live_bytes` has been since start or the last [`reset_peak`](Self::reset_peak).
    pub fn peak_bytes(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Starts a new peak measurement from the current live bytes.
    pub fn reset_peak(&self) {
        self.peak.store(self.live_bytes(), Ordering::Relaxed);
        PEAK_PHASE.store(PHASE.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// The [`phase`] marked last before the peak was reached, as `"pass op"` (`None`: nothing marked yet).
    pub fn peak_phase(&self) -> Option<String> {
        let i = PEAK_PHASE.load(Ordering::Relaxed);
        let names = PHASES.lock().unwrap_or_else(|e| e.into_inner());
        i.checked_sub(1).and_then(|i| names.get(i)).map(|(pass, op)| format!("{pass} {op}"))
    }

    /// Bytes allocated since start while each phase was marked, as `("pass op", bytes)` (phases that allocated
    /// nothing left out; bytes allocated before any mark under `"unmarked"`). Process-wide, like the marks.
    pub fn allocated_by_phase(&self) -> Vec<(String, usize)> {
        let names = PHASES.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for (slot, bytes) in PHASE_BYTES.iter().enumerate() {
            let b = bytes.load(Ordering::Relaxed);
            if b > 0 {
                let name = match slot.checked_sub(1).and_then(|i| names.get(i)) {
                    Some((pass, op)) => format!("{pass} {op}"),
                    None => "unmarked".to_string(),
                };
                out.push((name, b));
            }
        }
        out
    }

    fn added(&self, n: usize) {
        self.allocated.fetch_add(n, Ordering::Relaxed);
        let phase = PHASE.load(Ordering::Relaxed);
        PHASE_BYTES[if phase < PHASE_SLOTS { phase } else { 0 }].fetch_add(n, Ordering::Relaxed);
        if n >= LARGE_ALLOCATION {
            self.large.fetch_add(1, Ordering::Relaxed);
        }
        let now = self.live.fetch_add(n, Ordering::Relaxed) + n;
        if self.peak.fetch_max(now, Ordering::Relaxed) < now {
            PEAK_PHASE.store(PHASE.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }
}

impl Default for TrackingAllocator {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every call forwards to `System` with the caller's layout; the counters only observe sizes.
unsafe impl GlobalAlloc for TrackingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            self.added(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            self.added(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        self.live.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            self.live.fetch_sub(layout.size(), Ordering::Relaxed);
            self.added(new_size);
        }
        p
    }
}
