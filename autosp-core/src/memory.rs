//! Memory accounting for the tape: the bytes of the tensors it holds, counted once per storage (views share
//! their storage), and the peak of that count over a step.

use std::collections::HashMap;

use candle_core::{CpuStorage, Storage, Tensor};

/// The bytes of the storage behind `t` (the whole allocation, not only the view `t` covers).
pub fn storage_bytes(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => {
            let len = match cpu {
                CpuStorage::U8(v) => v.len(),
                CpuStorage::U32(v) => v.len(),
                CpuStorage::I16(v) => v.len(),
                CpuStorage::I32(v) => v.len(),
                CpuStorage::I64(v) => v.len(),
                CpuStorage::BF16(v) => v.len(),
                CpuStorage::F16(v) => v.len(),
                CpuStorage::F32(v) => v.len(),
                CpuStorage::F64(v) => v.len(),
                CpuStorage::F8E4M3(v) => v.len(),
                CpuStorage::F6E2M3(v) | CpuStorage::F6E3M2(v) | CpuStorage::F4(v) | CpuStorage::F8E8M0(v) => {
                    return v.len()
                }
            };
            len * t.dtype().size_in_bytes()
        }
        _ => t.elem_count() * t.dtype().size_in_bytes(),
    }
}

/// A key equal for tensors that share one storage.
pub fn storage_key(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    std::ptr::from_ref::<Storage>(&storage) as usize
}

/// Bytes held now and their peak since the last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes of the distinct storages held now.
    pub held_bytes: usize,
    /// The most `held_bytes` has been since the tape was made or the peak was reset.
    pub peak_bytes: usize,
}

/// Reference-counted storages, so a storage held through several values or views counts once.
#[derive(Debug, Default)]
pub(crate) struct MemoryTracker {
    live: HashMap<usize, (usize, usize)>,
    stats: MemoryStats,
    /// When tracing: the held bytes after every increase (every moment the peak can be reached).
    trace: Option<Vec<usize>>,
}

impl MemoryTracker {
    pub(crate) fn track(&mut self, t: &Tensor) {
        let entry = self.live.entry(storage_key(t)).or_insert((0, 0));
        if entry.1 == 0 {
            entry.0 = storage_bytes(t);
            self.stats.held_bytes += entry.0;
            self.stats.peak_bytes = self.stats.peak_bytes.max(self.stats.held_bytes);
            if let Some(trace) = &mut self.trace {
                trace.push(self.stats.held_bytes);
            }
        }
        entry.1 += 1;
    }

    pub(crate) fn untrack(&mut self, t: &Tensor) {
        let key = storage_key(t);
        if let Some(entry) = self.live.get_mut(&key) {
            entry.1 -= 1;
            if entry.1 == 0 {
                self.stats.held_bytes -= entry.0;
                self.live.remove(&key);
            }
        }
    }

    pub(crate) fn stats(&self) -> MemoryStats {
        self.stats
    }

    pub(crate) fn reset_peak(&mut self) {
        self.stats.peak_bytes = self.stats.held_bytes;
    }

    pub(crate) fn start_trace(&mut self) {
        self.trace = Some(Vec::new());
    }

    pub(crate) fn trace(&self) -> Vec<usize> {
        self.trace.clone().unwrap_or_default()
    }
}
