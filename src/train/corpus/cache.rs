//! Where a data file's token cache lives and whether it is current, decided cheaply; and the lock that lets
//! one process tokenise while the others wait for it.
//!
//! Beside `data` (for one set of tokenising settings, keyed `S`):
//! - `.{name}.autosp-{K}.tokens`: the cache, `K` keyed by `S` and the data's whole hash, and beside it
//!   `.{name}.autosp-{K}.starts`, where its documents start (`starts.rs`);
//! - `.{name}.autosp-{S}.index`: JSON naming the current cache with the data's [`Stamp`] (size, modification
//!   time, a hash of its first and last MiB) and whole hash. When the stamp still matches, the cache is current
//!   and the data is not hashed whole; otherwise it is, and a cache of that hash is used (or made);
//! - `.{name}.autosp-{S}.lock`: `flock`ed by the process that hashes and tokenises, which writes its progress
//!   into it; the others wait, saying what for. The OS releases the lock when its holder dies, and the next
//!   process then does the work itself (removing the `.{name}.autosp-{S}.*.partial-*` files it left).

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::train::error::{IoContext, Result, TrainError};
use crate::train::fingerprint::Stamp;
use crate::train::flock::{same_file, try_lock};

/// How often a waiting process says what it waits for, and a tokenising one how far it is.
const REPORT_EVERY: Duration = Duration::from_secs(5);
/// How often a waiting process tries the lock.
const POLL: Duration = Duration::from_millis(100);

/// The cache files of one data file and one set of tokenising settings.
pub(super) struct CacheFiles {
    data: PathBuf,
    dir: PathBuf,
    /// `.{data file name}.autosp-`.
    prefix: String,
    settings: u64,
}

/// A cache found current.
pub(super) struct Current {
    /// The cache file.
    pub path: PathBuf,
    /// Its tokens.
    pub tokens: u64,
}

impl CacheFiles {
    /// The cache files of `data` under the settings key `settings`.
    pub fn new(data: &Path, settings: u64) -> Self {
        let name = data.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
        let dir = data.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
        Self { data: data.to_path_buf(), dir, prefix: format!(".{name}.autosp-"), settings }
    }

    /// The cache for the data's whole hash keyed into `key`.
    pub fn cache(&self, key: u64) -> PathBuf {
        self.dir.join(format!("{}{key:016x}.tokens", self.prefix))
    }

    /// Where a cache is written (under the lock) before it is renamed into place.
    pub fn partial(&self) -> PathBuf {
        self.dir.join(format!("{}{:016x}.tokens.partial-{}", self.prefix, self.settings, std::process::id()))
    }

    /// Removes what a holder of the lock that died left half written (only a holder writes these).
    fn remove_stale_partials(&self) {
        let start = format!("{}{:016x}.", self.prefix, self.settings);
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with(&start) && name.contains(".partial-") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    fn index(&self) -> PathBuf {
        self.dir.join(format!("{}{:016x}.index", self.prefix, self.settings))
    }

    fn lock(&self) -> PathBuf {
        self.dir.join(format!("{}{:016x}.lock", self.prefix, self.settings))
    }

    /// The cache the index names, when the data's stamp is the one the index recorded and the cache is whole;
    /// `None` otherwise (no index, another stamp, a missing or cut cache).
    pub fn current(&self) -> Result<Option<Current>> {
        let Ok(text) = std::fs::read_to_string(self.index()) else { return Ok(None) };
        let Ok(index) = serde_json::from_str::<Value>(&text) else { return Ok(None) };
        let stamp = Stamp::of(&self.data)?;
        let recorded = Stamp {
            bytes: index["data_bytes"].as_u64().unwrap_or(u64::MAX),
            modified_ns: index["data_modified_ns"].as_str().and_then(|s| s.parse().ok()).unwrap_or(u128::MAX),
            ends: index["data_ends"].as_str().unwrap_or_default().to_string(),
        };
        let (Some(name), Some(tokens)) = (index["cache"].as_str(), index["tokens"].as_u64()) else { return Ok(None) };
        if recorded != stamp {
            return Ok(None);
        }
        let path = self.dir.join(name);
        match std::fs::metadata(&path) {
            Ok(m) if m.len() == tokens * 4 && super::starts::is_whole(&path, tokens) => {
                Ok(Some(Current { path, tokens }))
            }
            _ => Ok(None),
        }
    }

    /// Records `cache` (of `tokens`) as current for the data of `stamp` and whole hash `hash`.
    pub fn record(&self, stamp: &Stamp, hash: &str, cache: &Path, tokens: u64) -> Result<()> {
        let index = json!({
            "data_bytes": stamp.bytes,
            "data_modified_ns": stamp.modified_ns.to_string(),
            "data_ends": stamp.ends,
            "data_fnv1a64": hash,
            "cache": cache.file_name().map(|n| n.to_string_lossy().to_string()),
            "tokens": tokens,
        });
        let path = self.index();
        let tmp = self.dir.join(format!("{}{:016x}.index.partial-{}", self.prefix, self.settings, std::process::id()));
        std::fs::write(&tmp, index.to_string()).io(|| format!("writing the token cache index {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).io(|| format!("putting the token cache index {} in place", path.display()))
    }

    /// Takes the tokenising lock, waiting while another process holds it and saying every few seconds, on
    /// stderr, which process and how far it is.
    pub fn lock_for_tokenising(&self) -> Result<TokenisingLock> {
        let path = self.lock();
        let what = format!("the token cache of {}", self.data.display());
        let start = Instant::now();
        let mut said = None::<Instant>;
        loop {
            let file = open_lock_file(&path)?;
            let locked = match try_lock(&file, &what) {
                Ok(locked) => locked,
                Err(TrainError::Io { source, .. }) if flock_unsupported(&source) => {
                    eprintln!(
                        "{}: the filesystem of {} does not support flock ({source}): this process tokenises without \
                         waiting for others (processes that do the same write the same cache)",
                        self.data.display(),
                        path.display()
                    );
                    return Ok(TokenisingLock::new(path, file, &self.data, false));
                }
                Err(e) => return Err(e),
            };
            if locked {
                if !same_file(&file, &path) {
                    // Unlinked by its last holder while we waited: lock the file now there.
                    continue;
                }
                let lock = TokenisingLock::new(path, file, &self.data, true);
                lock.write(&format!("process {} is hashing the data", std::process::id()));
                self.remove_stale_partials();
                return Ok(lock);
            }
            if said.is_none_or(|t| t.elapsed() >= REPORT_EVERY) {
                let mut holder = String::new();
                let _ = (&file).read_to_string(&mut holder);
                let holder = if holder.trim().is_empty() { "another process holds its lock".into() } else { holder };
                eprintln!(
                    "process {}: waiting {:.0} s for {what} ({holder})",
                    std::process::id(),
                    start.elapsed().as_secs_f64()
                );
                said = Some(Instant::now());
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Opens (creating it) the lock file at `path`.
fn open_lock_file(path: &Path) -> Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(true).create(true).truncate(false);
    o.open(path).map_err(|e| {
        let what = format!(
            "creating the lock file {} (the token cache is written beside the data: its directory must be writable)",
            path.display()
        );
        TrainError::io(what, e)
    })
}

/// Whether `e` says that the filesystem has no `flock` (some network filesystems, Lustre mounted without it).
fn flock_unsupported(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    {
        matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EOPNOTSUPP | libc::ENOLCK))
    }
    #[cfg(not(unix))]
    {
        let _ = e;
        false
    }
}

/// The lock a process holds while it hashes and tokenises a data file (see the module doc); released, and the
/// lock file removed, when dropped. Where the filesystem has no `flock` it is not held (`locked` false): each
/// process then tokenises on its own.
pub(super) struct TokenisingLock {
    path: PathBuf,
    file: std::fs::File,
    data: PathBuf,
    locked: bool,
    started: Instant,
    said: Instant,
    /// Whether progress was said on stderr (then the end is too).
    spoke: bool,
}

impl TokenisingLock {
    fn new(path: PathBuf, file: std::fs::File, data: &Path, locked: bool) -> Self {
        let now = Instant::now();
        Self { path, file, data: data.to_path_buf(), locked, started: now, said: now, spoke: false }
    }

    /// Tokenising has read `done` bytes of `total`: written into the lock file (for waiting processes) and,
    /// every few seconds once it has run that long, said on stderr with the rate.
    pub fn progress(&mut self, done: u64, total: u64) {
        let secs = self.started.elapsed().as_secs_f64();
        let line = format!(
            "process {} is tokenising: {:.1} of {:.1} MB ({:.0}%), {:.2} MB/s",
            std::process::id(),
            done as f64 / 1e6,
            total as f64 / 1e6,
            100.0 * done as f64 / total.max(1) as f64,
            done as f64 / 1e6 / secs.max(1e-9)
        );
        if self.said.elapsed() >= REPORT_EVERY {
            if self.locked {
                self.write(&line);
            }
            eprintln!("{}: {line}", self.data.display());
            self.said = Instant::now();
            self.spoke = true;
        }
    }

    /// Says on stderr that tokenising ended, with `tokens`, when progress was said.
    pub fn done(&self, tokens: u64, bytes: u64) {
        if self.spoke {
            let secs = self.started.elapsed().as_secs_f64();
            eprintln!(
                "{}: tokenised {:.1} MB into {tokens} tokens in {secs:.0} s ({:.2} MB/s)",
                self.data.display(),
                bytes as f64 / 1e6,
                bytes as f64 / 1e6 / secs.max(1e-9)
            );
        }
    }

    fn write(&self, line: &str) {
        // Best effort: the words are for people waiting; the lock is what matters.
        let mut f = &self.file;
        let _ = f.set_len(0).and_then(|()| f.rewind()).and_then(|()| f.write_all(line.as_bytes()));
    }
}

impl Drop for TokenisingLock {
    fn drop(&mut self) {
        // Unlinked while still locked: a process that opened it meanwhile sees another file at the path and
        // retries (`same_file`). Not held: other processes may be using it.
        if self.locked {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
