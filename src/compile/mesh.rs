//! The device mesh: the world of W ranks as D data-parallel replicas of S sequence-parallel ranks (W = D·S).
//! Rank r is sequence rank `r mod S` of replica `r / S`: the S ranks of a replica are consecutive, so its
//! attention traffic stays between neighbours. Each replica trains its own part of the batch (the batch's
//! rows split in D equal parts, in order), its S ranks split each of those sequences; the loss is the token
//! mean over the whole world and gradients are summed over the whole world, so every mesh of W ranks
//! computes what one rank computes on the whole batch.

use super::CompileError;

/// A data × sequence mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// Data-parallel replicas D: each takes its own sequences of the batch.
    pub data: usize,
    /// Sequence-parallel ranks S per replica: they split each sequence (Ulysses, Ring, hybrid).
    pub sequence: usize,
}

impl Mesh {
    /// D replicas of S sequence-parallel ranks.
    pub fn new(data: usize, sequence: usize) -> Self {
        Self { data, sequence }
    }

    /// Every rank of a world of `world` ranks splits the same sequence (no data parallelism): `1 × world`.
    pub fn sequence_only(world: usize) -> Self {
        Self { data: 1, sequence: world }
    }

    /// The ranks the mesh has, D·S.
    pub fn world(&self) -> usize {
        self.data * self.sequence
    }

    /// The replica of world rank `rank`.
    pub fn replica(&self, rank: usize) -> usize {
        rank / self.sequence
    }

    /// Checks the mesh against a world of `world` ranks.
    pub fn check(&self, world: usize) -> Result<(), CompileError> {
        if self.data == 0 || self.sequence == 0 {
            return Err(CompileError::Input(format!(
                "a mesh of {} × {} ranks: both the data-parallel and the sequence-parallel degree must be at least 1",
                self.data, self.sequence
            )));
        }
        if self.world() != world {
            return Err(CompileError::Input(format!(
                "a mesh of {} data-parallel replicas × {} sequence-parallel ranks needs {} ranks, but the group has \
                 {world}: make D × S equal the number of ranks (e.g. --dp {} --sp {})",
                self.data,
                self.sequence,
                self.world(),
                world / self.sequence.max(1),
                self.sequence
            )));
        }
        Ok(())
    }

    /// The rows of a batch of `batch` sequences that replica `replica` trains: `replica·b/D .. (replica+1)·b/D`.
    /// Errors when D does not divide the batch, naming the batch sizes that would work.
    pub fn rows(&self, batch: usize, replica: usize) -> Result<std::ops::Range<usize>, CompileError> {
        if !batch.is_multiple_of(self.data) {
            let below = batch / self.data * self.data;
            let above = below + self.data;
            return Err(CompileError::Input(format!(
                "a batch of {batch} sequence(s) does not split over {} data-parallel replicas: give a multiple of {} \
                 ({}{above} sequences), or fewer replicas",
                self.data,
                self.data,
                if below > 0 { format!("{below} or ") } else { String::new() }
            )));
        }
        let per = batch / self.data;
        Ok(replica * per..(replica + 1) * per)
    }
}

impl std::fmt::Display for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} data × {} sequence", self.data, self.sequence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_map_to_replicas_and_batches_split_in_order() {
        let m = Mesh::new(2, 3);
        assert_eq!(m.world(), 6);
        assert_eq!((0..6).map(|r| m.replica(r)).collect::<Vec<_>>(), vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(m.rows(4, 1).unwrap(), 2..4);
        let e = m.rows(3, 0).unwrap_err().to_string();
        assert!(e.contains("2 or 4 sequences"), "{e}");
        let e = Mesh::new(2, 2).check(2).unwrap_err().to_string();
        assert!(e.contains("needs 4 ranks") && e.contains("--dp 1 --sp 2"), "{e}");
        assert!(Mesh::new(2, 2).check(4).is_ok());
    }
}
