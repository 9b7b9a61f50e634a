//! Which token positions each rank holds: the whole sequence (P = 1), contiguous shards (Ulysses), zigzag
//! shards (causal Ring: rank r holds chunks r and 2P-1-r of 2P), or hybrid shards (Ulysses groups of u ranks
//! around a zigzag ring of P/u groups: rank (g, i) holds sub-chunk i of chunks g and 2R-1-g).

/// How the sequence is split over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqLayout {
    /// One rank holds everything.
    Whole,
    /// Rank r holds the r-th of P equal pieces.
    Contiguous { p: usize },
    /// 2P chunks; rank r holds chunks r and 2P-1-r.
    Zigzag { p: usize },
    /// P = u * ring ranks; Ulysses groups of u consecutive ranks; zigzag over the groups.
    Hybrid { u: usize, ring: usize },
}

impl SeqLayout {
    /// The sequence length must be a multiple of this (sequences are padded up to it).
    pub fn multiple(&self) -> usize {
        match *self {
            SeqLayout::Whole => 1,
            SeqLayout::Contiguous { p } => p,
            SeqLayout::Zigzag { p } => 2 * p,
            SeqLayout::Hybrid { u, ring } => 2 * u * ring,
        }
    }

    /// `n` rounded up to [`multiple`](Self::multiple).
    pub fn padded_len(&self, n: usize) -> usize {
        n.div_ceil(self.multiple()) * self.multiple()
    }

    /// The global positions rank `rank` holds, in its local order, for a padded length `n`.
    pub fn positions(&self, n: usize, rank: usize) -> Vec<usize> {
        assert!(n % self.multiple() == 0, "pad the sequence to a multiple of {} first", self.multiple());
        match *self {
            SeqLayout::Whole => (0..n).collect(),
            SeqLayout::Contiguous { p } => {
                let s = n / p;
                (rank * s..(rank + 1) * s).collect()
            }
            SeqLayout::Zigzag { p } => {
                let c = n / (2 * p);
                let second = 2 * p - 1 - rank;
                (rank * c..(rank + 1) * c).chain(second * c..(second + 1) * c).collect()
            }
            SeqLayout::Hybrid { u, ring } => {
                let (g, i) = (rank / u, rank % u);
                let c = n / (2 * ring);
                let sub = c / u;
                let second = 2 * ring - 1 - g;
                (g * c + i * sub..g * c + (i + 1) * sub).chain(second * c + i * sub..second * c + (i + 1) * sub).collect()
            }
        }
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        match *self {
            SeqLayout::Whole => 1,
            SeqLayout::Contiguous { p } | SeqLayout::Zigzag { p } => p,
            SeqLayout::Hybrid { u, ring } => u * ring,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_is_a_partition() {
        for layout in [
            SeqLayout::Whole,
            SeqLayout::Contiguous { p: 3 },
            SeqLayout::Zigzag { p: 4 },
            SeqLayout::Hybrid { u: 2, ring: 2 },
            SeqLayout::Hybrid { u: 3, ring: 2 },
        ] {
            let n = layout.padded_len(50);
            let mut all: Vec<usize> = (0..layout.ranks()).flat_map(|r| layout.positions(n, r)).collect();
            all.sort();
            assert_eq!(all, (0..n).collect::<Vec<_>>(), "{layout:?}");
        }
        assert_eq!(SeqLayout::Zigzag { p: 2 }.positions(8, 0), vec![0, 1, 6, 7]);
        assert_eq!(SeqLayout::Hybrid { u: 2, ring: 2 }.positions(16, 1), vec![2, 3, 14, 15]);
    }
}
