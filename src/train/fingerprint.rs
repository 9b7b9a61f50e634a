//! FNV-1a hashes: of bytes ([`fnv1a`]), of a file, streamed ([`fingerprint`]), and a file's cheap stamp
//! ([`Stamp`]: size, modification time and a hash of its first and last MiB). Checkpoints record their files'
//! fingerprints; the token cache is keyed by the data's, and its index records the data's stamp so that an
//! unchanged file is recognised without hashing it whole.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use super::error::{IoContext, Result, TrainError};

/// Bytes read at a time when hashing a file.
pub(crate) const HASH_CHUNK: usize = 1 << 20;

/// FNV-1a's starting value.
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a (64-bit) of `bytes`, continuing from `h` ([`FNV_OFFSET`] to start).
pub(crate) fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// FNV-1a (64-bit) of a file's bytes and its length, read in [`HASH_CHUNK`] pieces (a checkpoint's files
/// can be larger than the memory left).
pub(crate) fn fingerprint(path: &Path) -> Result<(u64, String)> {
    let mut f = std::fs::File::open(path).io(|| format!("reading {}", path.display()))?;
    let mut buf = vec![0u8; HASH_CHUNK];
    let (mut h, mut len) = (FNV_OFFSET, 0u64);
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(TrainError::io(format!("reading {}", path.display()), e)),
        };
        h = fnv1a(h, &buf[..n]);
        len += n as u64;
    }
    Ok((len, format!("{h:016x}")))
}

/// A file's cheap stamp: what decides, without reading it whole, that it has not changed since the stamp was
/// taken (a change that keeps the size, the modification time and both end MiBs goes unseen; rewriting a
/// file updates its time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Stamp {
    /// The file's length in bytes.
    pub bytes: u64,
    /// Its modification time, in nanoseconds since the Unix epoch (0 where the platform has none).
    pub modified_ns: u128,
    /// FNV-1a (64-bit) of its first and last [`HASH_CHUNK`] bytes (the whole file when shorter than two).
    pub ends: String,
}

impl Stamp {
    /// The stamp of the file at `path`: one metadata call and at most two [`HASH_CHUNK`] reads.
    pub fn of(path: &Path) -> Result<Self> {
        let what = || format!("reading {}", path.display());
        let mut f = std::fs::File::open(path).io(what)?;
        let meta = f.metadata().io(what)?;
        let modified_ns =
            meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
        let bytes = meta.len();
        let mut buf = vec![0u8; HASH_CHUNK];
        let head = read_up_to(&mut f, &mut buf).io(what)?;
        let mut h = fnv1a(FNV_OFFSET, &buf[..head]);
        let tail_from = bytes.saturating_sub(HASH_CHUNK as u64).max(head as u64);
        if tail_from < bytes {
            f.seek(SeekFrom::Start(tail_from)).io(what)?;
            let n = read_up_to(&mut f, &mut buf).io(what)?;
            h = fnv1a(h, &buf[..n]);
        }
        Ok(Self { bytes, modified_ns, ends: format!("{h:016x}") })
    }
}

/// Fills `buf` from `f` as far as the file goes; the bytes read.
fn read_up_to(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stamp sees a change of length, of either end MiB or of the modification time, and not one in the
    /// middle of a large file that keeps all three (the whole hash is for that).
    #[test]
    fn the_stamp_hashes_both_ends_only() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("f");
        let mut bytes: Vec<u8> = (0..HASH_CHUNK * 3).map(|i| (i * 7 % 253) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let set_time = |secs: u64| {
            let f = std::fs::File::options().write(true).open(&path).unwrap();
            f.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs)).unwrap();
        };
        set_time(1_000_000);
        let a = Stamp::of(&path).unwrap();
        assert_eq!((a.bytes, a.modified_ns), (bytes.len() as u64, 1_000_000_000_000_000));
        assert_eq!(Stamp::of(&path).unwrap(), a);
        // The middle MiB changed, same time: unseen by design.
        bytes[HASH_CHUNK + 5] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        set_time(1_000_000);
        assert_eq!(Stamp::of(&path).unwrap(), a);
        // The last byte changed: seen.
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        set_time(1_000_000);
        assert_ne!(Stamp::of(&path).unwrap().ends, a.ends);
        // Only the time changed: seen.
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        set_time(2_000_000);
        let b = Stamp::of(&path).unwrap();
        assert_eq!(b.ends, a.ends);
        assert_ne!(b, a);
        // A short file is hashed once, whole.
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(Stamp::of(&path).unwrap().ends, format!("{:016x}", fnv1a(FNV_OFFSET, b"abc")));
    }

    /// The streaming hash equals FNV-1a over the whole file at once, across chunk boundaries, and hashing a
    /// file far larger than a chunk does not hold it in memory.
    #[test]
    fn file_hash_is_streamed() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("f");
        let bytes: Vec<u8> = (0..HASH_CHUNK * 2 + 12345).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let whole = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
        assert_eq!(fingerprint(&path).unwrap(), (bytes.len() as u64, format!("{whole:016x}")));
        drop(bytes);

        // 256 MiB (sparse) on disk; the hash may allocate its chunk (1 MiB) and small change, not the file.
        let big = root.path().join("big");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(256 << 20).unwrap();
        drop(f);
        let alloc = &crate::test_alloc::ALLOC;
        let before = alloc.live_bytes();
        alloc.reset_peak();
        fingerprint(&big).unwrap();
        let extra = alloc.peak_bytes().saturating_sub(before);
        // The allocator is process-wide and other tests of this binary allocate concurrently (one was seen to
        // take 34 MB): 96 MiB leaves room for them and is still far below the 256 MiB a whole-file read takes.
        assert!(extra < 96 << 20, "hashing a 256 MiB file took {extra} bytes of heap");
    }
}
