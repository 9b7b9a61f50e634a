//! Ctrl-C (SIGINT) and SIGTERM for a binary that asks for it ([`install`]): the first one sets a flag
//! ([`requested`]) that the training loop checks between steps (pass it as [`Trainer::run`]'s `stop`; all
//! ranks agree on it through one all-reduce), so the run saves a checkpoint and exits cleanly; a second one
//! kills the process at once (an interrupted save never replaces the last good checkpoint).
//!
//! [`Trainer::run`]: super::Trainer::run

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
    // SAFETY: `signal` is async-signal-safe; restoring the default makes a second signal end the process.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
    }
}

/// Installs the handler for SIGINT and SIGTERM (process-wide: call it once, from a binary's `main`).
pub fn install() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic and calls `signal`, both async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// Whether a stop was asked for (on this process).
pub fn requested() -> bool {
    STOP.load(Ordering::SeqCst)
}
