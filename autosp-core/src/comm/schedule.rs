//! The pairwise schedule of a personalised exchange built from point-to-point transfers (the NCCL back end's
//! all-to-all): in step `s = 1..P`, rank `r` sends to `(r + s) mod P` and receives from `(r - s) mod P`.
//! Every ordered pair of distinct ranks meets exactly once, and in each step every send has its matching
//! receive on the peer, so the transfers can also run step by step without deadlock. (NCCL runs all of them
//! in one `ncclGroupStart`/`ncclGroupEnd` group; the order still spreads the peers over the links.)

/// One step of the schedule for one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairStep {
    /// The rank this rank sends to in this step.
    pub send_to: usize,
    /// The rank this rank receives from in this step.
    pub recv_from: usize,
}

/// The `size - 1` steps of rank `rank` (`rank < size`); empty for a group of one.
pub fn pairwise_schedule(rank: usize, size: usize) -> Vec<PairStep> {
    assert!(rank < size, "rank {rank} is outside a group of {size}");
    (1..size).map(|s| PairStep { send_to: (rank + s) % size, recv_from: (rank + size - s) % size }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_meets_once_and_every_send_is_matched_in_its_step() {
        for size in 1..9 {
            let plans: Vec<Vec<PairStep>> = (0..size).map(|r| pairwise_schedule(r, size)).collect();
            for (r, plan) in plans.iter().enumerate() {
                assert_eq!(plan.len(), size - 1);
                let mut to: Vec<usize> = plan.iter().map(|p| p.send_to).collect();
                let mut from: Vec<usize> = plan.iter().map(|p| p.recv_from).collect();
                to.sort_unstable();
                from.sort_unstable();
                let others: Vec<usize> = (0..size).filter(|&j| j != r).collect();
                assert_eq!(to, others, "rank {r} of {size} sends");
                assert_eq!(from, others, "rank {r} of {size} receives");
                for (s, step) in plan.iter().enumerate() {
                    // The peer receives from this rank in the same step.
                    assert_eq!(plans[step.send_to][s].recv_from, r, "size {size} step {s}");
                }
            }
        }
    }
}
