//! The document starts of a token cache: a sidecar file `.{name}.autosp-{key}.starts` beside the `.tokens`
//! file, one little-endian u64 per document (or conversation, or run of padding after one), the offset of its
//! first token in the cache, ascending, the first 0. Written with the tokens ([`super::layout::Windows`]) and
//! read back a window at a time by binary search, so that no process holds the starts of a large corpus whole.

use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::train::error::{IoContext, Result, TrainError};

/// The starts file of the cache at `tokens` (the same name, `.starts` for `.tokens`).
pub(super) fn path_of(tokens: &Path) -> PathBuf {
    tokens.with_extension("starts")
}

/// Whether the starts file of `tokens` is there and whole (a multiple of 8 bytes, at least one start when
/// the cache holds tokens).
pub(super) fn is_whole(tokens: &Path, token_count: u64) -> bool {
    std::fs::metadata(path_of(tokens)).is_ok_and(|m| m.len() % 8 == 0 && (m.len() > 0) == (token_count > 0))
}

/// The starts of the documents that tokens `from..to` of the cache at `tokens` belong to: the last start at
/// or before `from` (when any), then every start before `to`, ascending.
pub(super) fn read_range(tokens: &Path, from: u64, to: u64) -> Result<Vec<u64>> {
    let path = path_of(tokens);
    let reading =
        || format!("reading the document starts {} (delete it and its .tokens file to remake them)", path.display());
    let mut f = std::fs::File::open(&path).io(reading)?;
    let count = f.metadata().io(reading)?.len() / 8;
    let at = |f: &mut std::fs::File, i: u64| -> Result<u64> {
        let mut b = [0u8; 8];
        f.seek(SeekFrom::Start(i * 8)).and_then(|_| f.read_exact(&mut b)).io(reading)?;
        Ok(u64::from_le_bytes(b))
    };
    // The number of starts at or before `from`.
    let (mut lo, mut hi) = (0u64, count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if at(&mut f, mid)? <= from {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let first = lo.saturating_sub(1);
    f.seek(SeekFrom::Start(first * 8)).io(reading)?;
    let mut r = BufReader::with_capacity(1 << 14, f);
    let mut out = Vec::new();
    for _ in first..count {
        let mut b = [0u8; 8];
        r.read_exact(&mut b).io(reading)?;
        let s = u64::from_le_bytes(b);
        if s >= to && !out.is_empty() {
            break;
        }
        if out.last().is_some_and(|&l| s <= l) {
            return Err(TrainError::Data(format!(
                "{}: document starts are not ascending ({s} after {}): the cache is damaged; delete it and its \
                 .tokens file to remake them",
                path.display(),
                out.last().copied().unwrap_or_default()
            )));
        }
        out.push(s);
    }
    Ok(out)
}

/// The longest document of the cache at `tokens` (of `token_count` tokens), read through its starts in one pass.
pub(super) fn longest(tokens: &Path, token_count: u64) -> Result<u64> {
    let path = path_of(tokens);
    let f = std::fs::File::open(&path).io(|| format!("reading the document starts {}", path.display()))?;
    let mut r = BufReader::with_capacity(1 << 16, f);
    let (mut previous, mut longest) = (None::<u64>, 0u64);
    let mut b = [0u8; 8];
    loop {
        match r.read_exact(&mut b) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(TrainError::io(format!("reading the document starts {}", path.display()), e)),
        }
        let s = u64::from_le_bytes(b);
        if let Some(p) = previous {
            longest = longest.max(s.saturating_sub(p));
        }
        previous = Some(s);
    }
    Ok(previous.map_or(0, |p| longest.max(token_count.saturating_sub(p))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_are_found_by_binary_search() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = dir.path().join(".d.autosp-1.tokens");
        let starts: Vec<u64> = vec![0, 3, 8, 10, 20];
        std::fs::write(path_of(&tokens), starts.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        assert!(is_whole(&tokens, 25) && !is_whole(&tokens, 0));
        assert_eq!(read_range(&tokens, 0, 4).unwrap(), vec![0, 3]);
        assert_eq!(read_range(&tokens, 4, 8).unwrap(), vec![3]);
        assert_eq!(read_range(&tokens, 8, 12).unwrap(), vec![8, 10]);
        assert_eq!(read_range(&tokens, 12, 16).unwrap(), vec![10]);
        assert_eq!(read_range(&tokens, 21, 25).unwrap(), vec![20]);
        assert_eq!(read_range(&tokens, 0, 100).unwrap(), starts);
        assert_eq!(longest(&tokens, 25).unwrap(), 10);
        assert_eq!(longest(&tokens, 40).unwrap(), 20);
        std::fs::write(path_of(&tokens), [0u64, 5, 4].iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>())
            .unwrap();
        let e = read_range(&tokens, 0, 10).unwrap_err().to_string();
        assert!(e.contains("not ascending"), "{e}");
    }
}
