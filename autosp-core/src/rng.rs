//! [`SplitMix64`]: the one small seeded generator autosp uses (dropout masks, random tiny checkpoints,
//! sampling, synthetic data). Portable (same numbers on every machine) and its whole state is one `u64`, so
//! checkpoints can save and restore it. It is counter-based: the `i`-th output of the stream from `seed` is a
//! pure function of `(seed, i)` ([`SplitMix64::at`]), and [`SplitMix64::key`] derives a new stream's seed
//! from a seed and a coordinate, so a value can be addressed by coordinates instead of by call order.

use std::ops::Range;

/// The golden-ratio increment of the state per output.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function: one well-mixed 64-bit value per state.
fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

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
        self.0 = self.0.wrapping_add(GAMMA);
        finalize(self.0)
    }

    /// The `i`-th output (from 0) of the stream whose seed is `seed`, without drawing the ones before it:
    /// `SplitMix64::new(seed)`'s `(i + 1)`-th `next_u64`.
    pub fn at(seed: u64, i: u64) -> u64 {
        finalize(seed.wrapping_add(GAMMA.wrapping_mul(i.wrapping_add(1))))
    }

    /// The seed of the stream at coordinate `c` under `seed` (a hash of the pair): chain it to address a value
    /// by several coordinates, `key(key(seed, a), b)`.
    pub fn key(seed: u64, c: u64) -> u64 {
        Self::at(seed ^ Self::at(c, 0), 0)
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

#[cfg(test)]
mod tests {
    use super::SplitMix64;

    /// `at` addresses the stream that `next_u64` walks; `key` differs by coordinate and by seed.
    #[test]
    fn at_is_the_stream_by_index() {
        let mut g = SplitMix64::new(42);
        let walked: Vec<u64> = (0..5).map(|_| g.next_u64()).collect();
        let addressed: Vec<u64> = (0..5).map(|i| SplitMix64::at(42, i)).collect();
        assert_eq!(walked, addressed);
        assert_ne!(SplitMix64::key(1, 2), SplitMix64::key(1, 3));
        assert_ne!(SplitMix64::key(1, 2), SplitMix64::key(2, 1));
    }
}
