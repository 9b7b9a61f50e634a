//! The file-system mechanics that make a checkpoint save atomic and durable: fsync of files and directories, putting a complete directory in place so that a
//! complete `step-N` exists at every moment (an atomic exchange where the OS has one, else move aside and
//! back), and cleaning up after runs that died while saving.

use std::path::Path;

use crate::train::error::{IoContext, Result, TrainError};

/// fsyncs every file directly in `dir`, then `dir` itself.
pub(super) fn sync_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).io(|| format!("listing {}", dir.display()))? {
        let path = entry.io(|| format!("listing {}", dir.display()))?.path();
        if path.is_file() {
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .io(|| format!("flushing {} to disk", path.display()))?;
        }
    }
    sync_dir(dir)
}

/// fsyncs a directory (its entries: names created, renamed or removed in it). A no-op where directories
/// cannot be opened as files (Windows).
pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    std::fs::File::open(dir).and_then(|f| f.sync_all()).io(|| format!("flushing {} to disk", dir.display()))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Swaps the directories `a` and `b` in one atomic rename, when the OS can (Linux 3.15+ on most file
/// systems). `Ok(false)`: not supported here; nothing changed.
fn exchange(a: &Path, b: &Path) -> Result<bool> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let swapping = || format!("swapping {} and {}", a.display(), b.display());
        let c = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_bytes())
                .map_err(|e| TrainError::io(swapping(), std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))
        };
        let (ca, cb) = (c(a)?, c(b)?);
        // SAFETY: two valid NUL-terminated paths; renameat2 reads them and touches no memory of ours.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                ca.as_ptr(),
                libc::AT_FDCWD,
                cb.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if rc == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(false),
            _ => Err(TrainError::io(swapping(), e)),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (a, b);
        Ok(false)
    }
}

/// Puts the complete checkpoint `tmp` at `dir` (a sibling in `root`). When `dir` exists the two are swapped
/// atomically and the old one deleted, so a complete `dir` exists at every moment; without an atomic swap
/// the old one is moved aside to `old` first (the next save restores it if we die in between).
/// `observe(what)` is called after every step that changes the directory tree (tests check the invariant
/// there).
pub(super) fn install(root: &Path, tmp: &Path, dir: &Path, old: &Path, observe: &mut dyn FnMut(&str)) -> Result<()> {
    if !dir.exists() {
        std::fs::rename(tmp, dir).io(|| format!("renaming {} into place", tmp.display()))?;
        observe("renamed into place");
    } else if exchange(tmp, dir)? {
        observe("swapped with the old checkpoint");
        sync_dir(root)?;
        // `tmp` now holds the old checkpoint.
        std::fs::remove_dir_all(tmp).io(|| format!("removing the old checkpoint at {}", tmp.display()))?;
        observe("old checkpoint removed");
    } else {
        std::fs::rename(dir, old).io(|| format!("moving the old {} aside", dir.display()))?;
        observe("old checkpoint moved aside");
        std::fs::rename(tmp, dir).io(|| format!("renaming {} into place", tmp.display()))?;
        observe("renamed into place");
        sync_dir(root)?;
        std::fs::remove_dir_all(old).io(|| format!("removing {}", old.display()))?;
        observe("old checkpoint removed");
    }
    sync_dir(root)
}

/// Whether process `pid` is running (on Unix; elsewhere every process is assumed alive, so nothing of
/// another run is ever removed).
fn alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        if pid == std::process::id() {
            return true;
        }
        // SAFETY: signal 0 only checks that the process exists; it sends nothing.
        let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
        rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Cleans up after runs that died while saving into `root`: hidden `.step-N.partial-PID` directories
/// (unfinished saves) of processes no longer running are removed; a `.step-N.old-PID` (a complete
/// checkpoint moved aside) is renamed back to `step-N` when that is missing, else removed. Returns what
/// it did, one line each. [`save`](super::save) calls it first.
pub fn clean_stale(root: &Path) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let Ok(entries) = std::fs::read_dir(root) else { return Ok(done) };
    for entry in entries {
        let path = entry.io(|| format!("listing {}", root.display()))?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix(".step-") else { continue };
        let parsed = [(".partial-", false), (".old-", true)].into_iter().find_map(|(tag, old)| {
            let (step, pid) = rest.split_once(tag)?;
            Some((step.parse::<u64>().ok()?, pid.parse::<u32>().ok()?, old))
        });
        let Some((step, pid, old)) = parsed else { continue };
        if alive(pid) || !path.is_dir() {
            continue;
        }
        let target = root.join(format!("step-{step}"));
        if old && !target.exists() {
            std::fs::rename(&path, &target).io(|| format!("restoring {} to {}", path.display(), target.display()))?;
            done.push(format!("restored {} (a save of process {pid} died between two renames)", target.display()));
        } else {
            std::fs::remove_dir_all(&path).io(|| format!("removing the stale {}", path.display()))?;
            done.push(format!("removed {} (left by process {pid}, which is no longer running)", path.display()));
        }
    }
    if !done.is_empty() {
        sync_dir(root)?;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A complete fake checkpoint: `a` and `b` hold the same `tag`.
    fn fake(dir: &Path, tag: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("a"), tag).unwrap();
        std::fs::write(dir.join("b"), tag).unwrap();
    }

    /// The tag of a complete fake checkpoint at `dir`, or why it is not one.
    fn complete(dir: &Path) -> std::result::Result<String, String> {
        let a = std::fs::read_to_string(dir.join("a")).map_err(|e| format!("{}: a: {e}", dir.display()))?;
        let b = std::fs::read_to_string(dir.join("b")).map_err(|e| format!("{}: b: {e}", dir.display()))?;
        if a == b {
            Ok(a)
        } else {
            Err(format!("{} mixes {a} and {b}", dir.display()))
        }
    }

    /// Saving a step that exists replaces it with no moment (between any two file-system operations)
    /// without a complete `step-N`, and leaves nothing hidden behind.
    #[test]
    fn replacing_a_step_always_leaves_a_complete_one() {
        let root = tempfile::tempdir().unwrap();
        let (dir, tmp, old) =
            (root.path().join("step-3"), root.path().join(".step-3.partial-1"), root.path().join(".step-3.old-1"));
        fake(&dir, "old");
        fake(&tmp, "new");
        let mut seen = Vec::new();
        install(root.path(), &tmp, &dir, &old, &mut |what| {
            let tag = complete(&dir).unwrap_or_else(|e| panic!("after `{what}` there is no complete step-3: {e}"));
            seen.push(format!("{what}: {tag}"));
        })
        .unwrap();
        assert_eq!(complete(&dir).unwrap(), "new", "{seen:?}");
        let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["step-3"], "{seen:?}");
    }

    /// A process id that no longer runs: a child that has exited and been waited for.
    fn dead_pid() -> u32 {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    }

    /// Hidden directories of dead runs go (an unfinished save is removed; a complete checkpoint moved aside
    /// comes back when its step is missing); those of a running process stay.
    #[test]
    #[cfg(unix)]
    fn stale_hidden_directories_of_dead_runs_are_cleaned() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let (dead, live) = (dead_pid(), std::os::unix::process::parent_id());
        fake(&r.join(format!(".step-2.partial-{dead}")), "partial");
        fake(&r.join(format!(".step-2.partial-{live}")), "someone else's save in progress");
        fake(&r.join(format!(".step-5.old-{dead}")), "five");
        fake(&r.join("step-6"), "six");
        fake(&r.join(format!(".step-6.old-{dead}")), "six before");
        let done = clean_stale(r).unwrap();
        assert_eq!(done.len(), 3, "{done:?}");
        let mut left: Vec<String> =
            std::fs::read_dir(r).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().to_string()).collect();
        left.sort();
        assert_eq!(left, [format!(".step-2.partial-{live}"), "step-5".into(), "step-6".into()]);
        assert_eq!(complete(&r.join("step-5")).unwrap(), "five");
        assert_eq!(complete(&r.join("step-6")).unwrap(), "six");
    }
}
