//! [`ShardedKv`]: the KV cache of a generation as one rank holds it: its part of every layer
//! ([`KvBlocks`]), and every rank's fill, so that each rank knows, without asking, which rank takes the next
//! token's keys and values (the least filled, the lowest rank on ties: the parts stay within one row of each
//! other once the decode has evened them) and which ranks hold any row.

use autosp_kernels::attention::KvBlocks;

/// This rank's part of every layer's cache, and the fills of every rank's part.
#[derive(Debug)]
pub struct ShardedKv {
    /// This rank's part of each layer.
    pub(crate) layers: Vec<KvBlocks>,
    /// Rows every rank holds (the same in every layer).
    fills: Vec<usize>,
    /// The rank that stores the token being decoded.
    owner: usize,
    /// The sequence position of the token being decoded.
    position: usize,
    /// This rank in the sequence-parallel group.
    rank: usize,
    /// The query rows each layer's attention saw in the prefill, on this rank.
    pub(crate) query_rows: Vec<usize>,
}

impl ShardedKv {
    /// An empty cache of `layers` layers on rank `rank`, whose ranks will hold `fills[r]` prompt rows each
    /// after the prefill.
    pub fn new(layers: usize, rank: usize, fills: Vec<usize>) -> Self {
        Self {
            layers: vec![KvBlocks::default(); layers],
            fills,
            owner: 0,
            position: 0,
            rank,
            query_rows: vec![0; layers],
        }
    }

    /// Chooses the rank that stores the next token, at sequence position `position` (the least filled; the
    /// lowest on ties), and counts it.
    pub fn begin_token(&mut self, position: usize) {
        let owner = (0..self.fills.len()).min_by_key(|&r| (self.fills[r], r)).unwrap_or(0);
        self.fills[owner] += 1;
        self.owner = owner;
        self.position = position;
    }

    /// The sequence position of the token being decoded (set by [`begin_token`](Self::begin_token)).
    pub fn position(&self) -> usize {
        self.position
    }

    /// Whether this rank stores the token being decoded.
    pub fn owns_token(&self) -> bool {
        self.owner == self.rank
    }

    /// Whether each rank holds any row.
    pub fn holds(&self) -> Vec<bool> {
        self.fills.iter().map(|&f| f > 0).collect()
    }

    /// This rank's part of layer `i`.
    pub fn layer(&self, i: usize) -> Option<&KvBlocks> {
        self.layers.get(i)
    }

    /// Rows held per layer on this rank, read from the tensors.
    pub fn rows(&self) -> autosp_kernels::Result<Vec<usize>> {
        self.layers.iter().map(KvBlocks::rows).collect()
    }

    /// Bytes allocated on this rank for keys and values.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KvBlocks::bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_go_to_the_least_filled_rank_so_parts_even_out() {
        let mut c = ShardedKv::new(1, 1, vec![3, 1, 2]);
        let mut owners = Vec::new();
        for t in 0..6 {
            c.begin_token(t);
            owners.push(c.owner);
        }
        assert_eq!(owners, vec![1, 1, 2, 0, 1, 2]);
        assert_eq!(c.fills, vec![4, 4, 4]);
        assert_eq!(c.holds(), vec![true; 3]);
        c.begin_token(6);
        assert_eq!(c.position(), 6);
        assert!(!c.owns_token());
        assert_eq!(c.owner, 0);
    }
}
