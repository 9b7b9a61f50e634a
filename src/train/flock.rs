//! Advisory file locks between processes: an exclusive, non-blocking `flock` on an open file (released by the
//! OS when the process dies, so a crash never leaves a lock behind), and whether an open file is still the one
//! at its path (a holder unlinks its lock file on release; a process that opened it meanwhile retries). The
//! checkpoint directory's [`SaveLock`](super::checkpoint::SaveLock) and the corpus cache's tokenising lock
//! use them.

use std::path::Path;

use super::error::{Result, TrainError};

/// Takes an exclusive `flock` on `file` (the lock of `what`, for the error) without waiting: `Ok(false)` when
/// another process holds it. Where `flock` does not exist every lock succeeds (one run at a time is then up to
/// the user).
pub fn try_lock(file: &std::fs::File, what: &str) -> Result<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: a valid open file descriptor; flock touches no memory of ours.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Ok(false);
        }
        Err(TrainError::io(format!("locking {what}"), e))
    }
    #[cfg(not(unix))]
    {
        let _ = (file, what);
        Ok(true)
    }
}

/// Whether the open `file` is still the file at `path` (not unlinked or replaced since it was opened).
pub fn same_file(file: &std::fs::File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (file, path);
        true
    }
}
