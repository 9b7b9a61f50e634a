//! FNV-1a hashes: of bytes ([`fnv1a`]) and of a file, streamed ([`fingerprint`]). Checkpoints record their
//! files' fingerprints; the token cache is keyed by the data's.

use std::io::Read;
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

#[cfg(test)]
mod tests {
    use super::*;

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
