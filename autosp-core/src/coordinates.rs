//! [`TokenCoordinates`]: where the tokens of one forward sit in a training step's global batch (the sequence
//! of each row, the position of each column), so that what is drawn per token (LoRA's dropout masks) is the
//! same whichever rank, replica or shard computes it.

/// The global coordinates of a forward's `[rows, columns]` tokens: `sequences[r]` is row `r`'s index in the
/// step's global batch (over the data-parallel replicas and the accumulation micro-batches), `positions[c]`
/// is column `c`'s position in the whole sequence (a rank holds a shard of the columns under sequence
/// parallelism: contiguous for Ulysses, zigzag for Ring).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenCoordinates {
    /// Each row's sequence index in the global batch.
    pub sequences: Vec<u64>,
    /// Each column's position in the whole sequence.
    pub positions: Vec<u64>,
}

impl TokenCoordinates {
    /// The coordinates of a `[rows, columns]` batch seen whole by one rank: sequences `0..rows`, positions
    /// `0..columns`.
    pub fn local(rows: usize, columns: usize) -> Self {
        Self { sequences: (0..rows as u64).collect(), positions: (0..columns as u64).collect() }
    }

    /// The number of tokens described (`rows · columns`).
    pub fn tokens(&self) -> usize {
        self.sequences.len() * self.positions.len()
    }
}
