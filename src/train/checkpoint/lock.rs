//! [`SaveLock`]: one run at a time saves into a directory. The lock is `DIR/.lock`, holding the owner's
//! process id, `flock`ed for as long as the value lives; the OS releases it when the process dies, so a
//! crashed run never leaves the directory locked.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::train::error::{IoContext, Result, TrainError};
use crate::train::flock::{same_file, try_lock};

/// The lock file's name inside a save directory.
pub const LOCK_FILE: &str = ".lock";

/// The lock that makes one run at a time save into a directory: `DIR/.lock`, holding the owner's process
/// id, locked with `flock` (released by the OS when the process dies, so a crashed run never leaves the
/// directory locked) for as long as this value lives. Dropping it removes the file, and the directory too
/// when the lock created it and nothing else was written there.
#[derive(Debug)]
pub struct SaveLock {
    path: PathBuf,
    created_dir: Option<PathBuf>,
    _file: std::fs::File,
}

impl SaveLock {
    /// Locks `root` for this process (creating it if needed). Refused with [`TrainError::Locked`], naming the
    /// other run's process id, while another live process holds the lock.
    pub fn acquire(root: &Path) -> Result<Self> {
        let created_dir = if root.exists() { None } else { Some(root.to_path_buf()) };
        std::fs::create_dir_all(root).io(|| format!("--save {}: creating the checkpoint directory", root.display()))?;
        let path = root.join(LOCK_FILE);
        let cleanup = |e: TrainError| {
            if let Some(d) = &created_dir {
                let _ = std::fs::remove_dir(d);
            }
            e
        };
        // A file another process unlinked while we waited is not the lock: retry on the new one.
        for _ in 0..8 {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .io(|| format!("--save {}: opening the lock file {}", root.display(), path.display()))
                .map_err(cleanup)?;
            if !try_lock(&file, "the checkpoint directory").map_err(cleanup)? {
                let mut owner = String::new();
                let _ = (&file).read_to_string(&mut owner);
                let owner = owner.trim();
                let owner = (!owner.is_empty()).then(|| owner.to_string());
                return Err(cleanup(TrainError::Locked { dir: root.to_path_buf(), owner }));
            }
            if !same_file(&file, &path) {
                continue;
            }
            file.set_len(0)
                .and_then(|()| {
                    use std::io::Write;
                    (&file).write_all(std::process::id().to_string().as_bytes())
                })
                .io(|| format!("--save {}: writing the lock file {}", root.display(), path.display()))
                .map_err(cleanup)?;
            return Ok(SaveLock { path, created_dir, _file: file });
        }
        Err(cleanup(TrainError::Config(format!(
            "--save {}: could not take the lock file {} (it keeps being replaced)",
            root.display(),
            path.display()
        ))))
    }
}

impl Drop for SaveLock {
    fn drop(&mut self) {
        // Unlinked while still locked: a process that opened it meanwhile sees another file at the path
        // (`same_file`) and retries.
        let _ = std::fs::remove_file(&self.path);
        if let Some(d) = &self.created_dir {
            // Only when empty: checkpoints saved by this run stay.
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `.lock` left by a dead run (not held) is taken over; while held, a second lock of the directory
    /// is refused naming the holder; dropping it removes the file, and the directory when the lock made it
    /// and it is empty (a directory that existed stays).
    #[test]
    #[cfg(unix)]
    fn the_save_lock_is_exclusive_and_leaves_no_trace() {
        let root = tempfile::tempdir().unwrap();
        let made = root.path().join("new");
        let lock = SaveLock::acquire(&made).unwrap();
        assert_eq!(std::fs::read_to_string(made.join(LOCK_FILE)).unwrap(), std::process::id().to_string());
        // flock locks belong to the open file: a second open in this process conflicts like another process.
        let e = SaveLock::acquire(&made).expect_err("a held lock must refuse a second one").to_string();
        assert!(e.contains(&format!("another run (process {})", std::process::id())), "{e}");
        assert!(made.join(LOCK_FILE).is_file(), "a refused lock must not remove the holder's file");
        drop(lock);
        assert!(!made.exists(), "the directory the lock made, left empty, goes with it");

        let kept = root.path().join("kept");
        std::fs::create_dir_all(&kept).unwrap();
        std::fs::write(kept.join(LOCK_FILE), "999999999").unwrap();
        let lock = SaveLock::acquire(&kept).unwrap();
        assert_eq!(std::fs::read_to_string(kept.join(LOCK_FILE)).unwrap(), std::process::id().to_string());
        drop(lock);
        let left: Vec<_> = std::fs::read_dir(&kept).unwrap().collect();
        assert!(kept.is_dir() && left.is_empty(), "a directory that existed stays, without the lock file");
    }
}
