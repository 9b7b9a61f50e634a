//! [`SplitMix64`]: the one small seeded generator autosp uses outside the kernels (random tiny checkpoints,
//! sampling, synthetic data). Portable (same numbers on every machine) and its whole state is one `u64`, so
//! checkpoints can save and restore it.

use std::ops::Range;

/// splitmix64 (Steele, Lea and Flood): well mixed, tiny, portable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose state is `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The whole state (restore it with [`new`](Self::new)).
    pub fn state(&self) -> u64 {
        self.0
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` (53 random bits).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `range` (non-empty).
    pub fn below(&mut self, range: Range<usize>) -> usize {
        range.start + (self.next_u64() % (range.end - range.start) as u64) as usize
    }
}
