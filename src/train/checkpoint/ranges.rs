//! Parts of a safetensors file without loading it: [`TensorFile`] reads the header (every tensor's dtype,
//! shape and byte offsets) and then only the element ranges asked for, with positioned reads, so a resuming
//! rank reads its own share of a checkpoint's optimizer state, or of a model's weights, and never the whole
//! file. Each open file counts the bytes it read ([`TensorFile::bytes_read`]).

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use crate::train::error::{Result, TrainError};

/// One tensor's entry in a safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its bytes, from the start of the file.
    pub bytes: Range<u64>,
}

impl Entry {
    /// Its number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open safetensors file whose header has been read (the tensors themselves are read on demand).
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    file: File,
    entries: HashMap<String, Entry>,
    /// Bytes of tensors read so far (the header not counted).
    read: AtomicU64,
}

/// The longest header read (safetensors' own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

impl TensorFile {
    /// Opens `path` and reads its header: 8 little-endian bytes of length, then that many bytes of JSON.
    pub fn open(path: &Path) -> Result<Self> {
        let damaged = |what: String| {
            TrainError::checkpoint(format!("{} is damaged: {what}; resume from another checkpoint", path.display()))
        };
        let file = File::open(path).map_err(|e| damaged(format!("it cannot be opened ({e})")))?;
        let size = file.metadata().map_err(|e| damaged(format!("it cannot be read ({e})")))?.len();
        let mut len = [0u8; 8];
        file.read_exact_at(&mut len, 0).map_err(|_| damaged("it is shorter than a safetensors header".into()))?;
        let len = u64::from_le_bytes(len);
        if len > MAX_HEADER || 8 + len > size {
            return Err(damaged(format!("its header claims {len} bytes of a {size}-byte file")));
        }
        let mut header = vec![0u8; len as usize];
        file.read_exact_at(&mut header, 8).map_err(|e| damaged(format!("its header cannot be read ({e})")))?;
        let doc: Value =
            serde_json::from_slice(&header).map_err(|e| damaged(format!("its header is not JSON ({e})")))?;
        let map = doc.as_object().ok_or_else(|| damaged("its header is not a map".into()))?;
        let data = 8 + len;
        let mut entries = HashMap::with_capacity(map.len());
        for (name, e) in map.iter().filter(|(n, _)| *n != "__metadata__") {
            let bad = || damaged(format!("its header's entry `{name}` is malformed"));
            let dtype = match e.get("dtype").and_then(Value::as_str).ok_or_else(bad)? {
                "F64" => DType::F64,
                "F32" => DType::F32,
                "BF16" => DType::BF16,
                "F16" => DType::F16,
                "I64" => DType::I64,
                "U32" => DType::U32,
                "U8" => DType::U8,
                other => return Err(damaged(format!("`{name}` has dtype {other}, which autosp does not read"))),
            };
            let shape: Vec<usize> = e
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(bad)?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<_>>()
                .ok_or_else(bad)?;
            let offsets = e.get("data_offsets").and_then(Value::as_array).ok_or_else(bad)?;
            let (begin, end) = match offsets.as_slice() {
                [b, e] => (b.as_u64().ok_or_else(bad)?, e.as_u64().ok_or_else(bad)?),
                _ => return Err(bad()),
            };
            let want = (shape.iter().product::<usize>() * dtype.size_in_bytes()) as u64;
            if end < begin || end - begin != want || data + end > size {
                return Err(damaged(format!("`{name}`'s bytes {begin}..{end} do not hold {shape:?} {dtype:?}")));
            }
            entries.insert(name.clone(), Entry { dtype, shape, bytes: data + begin..data + end });
        }
        Ok(Self { path: path.to_path_buf(), file, entries, read: AtomicU64::new(0) })
    }

    /// The entry of tensor `name`, if the file has it.
    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    /// The names of the tensors it holds (any order).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The bytes of tensors [`read`](Self::read) has read from this file so far (the header not counted).
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Elements `elems` of tensor `name` flattened, as a 1-D tensor `[elems.len()]` in the file's dtype on
    /// the host: one positioned read of exactly those bytes.
    pub fn read(&self, name: &str, elems: Range<usize>) -> Result<Tensor> {
        let e = self
            .entry(name)
            .ok_or_else(|| TrainError::checkpoint(format!("{} has no tensor `{name}`", self.path.display())))?;
        if elems.end > e.numel() || elems.start > elems.end {
            return Err(TrainError::checkpoint(format!(
                "{}: elements {elems:?} are outside `{name}` ({} elements)",
                self.path.display(),
                e.numel()
            )));
        }
        let size = e.dtype.size_in_bytes() as u64;
        let mut bytes = vec![0u8; elems.len() * size as usize];
        self.file
            .read_exact_at(&mut bytes, e.bytes.start + elems.start as u64 * size)
            .map_err(|err| TrainError::checkpoint(format!("{} cannot be read ({err})", self.path.display())))?;
        self.read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(Tensor::from_raw_buffer(&bytes, e.dtype, &[elems.len()], &Device::Cpu)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header's entries and any element range read back as `safetensors::save` wrote them.
    #[test]
    fn reads_ranges_as_written() {
        let dir = std::env::temp_dir().join(format!("autosp-ranges-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let a = Tensor::arange(0f32, 12., &Device::Cpu).unwrap().reshape((3, 4)).unwrap();
        let b = Tensor::arange(0f64, 5., &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let map = HashMap::from([("a".to_string(), a), ("b".to_string(), b)]);
        candle_core::safetensors::save(&map, &path).unwrap();
        let f = TensorFile::open(&path).unwrap();
        assert_eq!(f.entry("a").map(|e| (e.dtype, e.shape.clone())), Some((DType::F32, vec![3, 4])));
        assert_eq!(f.read("a", 5..9).unwrap().to_vec1::<f32>().unwrap(), vec![5., 6., 7., 8.]);
        let b = f.read("b", 1..5).unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(b, vec![1., 2., 3., 4.]);
        assert_eq!(f.bytes_read(), 4 * 4 + 4 * 2, "the two reads' bytes, nothing else");
        assert!(f.read("a", 10..13).is_err() && f.read("c", 0..1).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
