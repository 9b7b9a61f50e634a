//! Tensors every rank holds alike, made once: [`broadcast`] gives every rank the root's tensor, and
//! [`all_gather_once`] the concatenation of every rank's tensor. Over ranks that share memory
//! ([`ProcessGroup::shares_memory`]: thread ranks) the result is one tensor, one storage, that every rank
//! holds by handle, where `all_gather` would make one copy per rank: thread ranks keep one copy of what is
//! the same on every rank (the gathered parameters of a sharded model). Over one process per rank they are
//! the plain collectives (each process needs its own copy anyway).
//!
//! Nothing may write into such a tensor in place: every rank reads it. The optimisers write their updates
//! into fresh tensors (`crate::optim`), and parameters are replaced, never written into (`Param::set`).

use candle_core::Tensor;

use super::process_group::ProcessGroup;
use crate::{Error, Result};

/// `x` of rank `root` on every rank (collective: every rank passes a tensor, whose value only the root's
/// matters; the others may pass an empty one). Over shared memory every rank gets the root's own handle.
/// Sent: `(P-1)·bytes(x)` by the root, nothing by the others.
pub fn broadcast(group: &dyn ProcessGroup, x: &Tensor, root: usize) -> Result<Tensor> {
    let (size, rank) = (group.size(), group.rank());
    if root >= size {
        return Err(Error::InvalidArgument {
            op: "broadcast",
            msg: format!("root rank {root} in a group of {size} ranks: the root must be one of 0..{size}"),
        });
    }
    let empty = Tensor::zeros(0, x.dtype(), x.device())?;
    let outgoing = (0..size).map(|_| if rank == root { x.clone() } else { empty.clone() }).collect();
    let mut incoming = group.all_to_all(outgoing)?;
    Ok(incoming.swap_remove(root))
}

/// The concatenation along `dim` of every rank's `x`, in rank order, as [`ProcessGroup::all_gather`]
/// returns it; over shared memory, made once on rank 0 and held by every rank (rank 0 receives the other
/// ranks' handles, joins them, and hands the result on), else the group's own `all_gather`.
pub fn all_gather_once(group: &dyn ProcessGroup, x: &Tensor, dim: usize) -> Result<Tensor> {
    if !group.shares_memory() || group.size() == 1 {
        return Ok(group.all_gather(x, dim)?);
    }
    let (size, rank) = (group.size(), group.rank());
    let empty = Tensor::zeros(0, x.dtype(), x.device())?;
    let to_root = (0..size).map(|j| if j == 0 { x.clone() } else { empty.clone() }).collect();
    let parts = group.all_to_all(to_root)?;
    let joined = if rank == 0 {
        match Tensor::cat(&parts, dim) {
            Ok(t) => t,
            Err(e) => {
                // The others wait in the broadcast below: tell them now, not at their timeout.
                let msg = format!(
                    "all_gather_once on group `{}`: the ranks' tensors do not join along dim {dim} ({e}); every \
                     rank must pass the same shape except along dim {dim}",
                    group.name()
                );
                group.abort(&msg);
                return Err(Error::InvalidArgument { op: "all_gather_once", msg });
            }
        }
    } else {
        empty
    };
    drop(parts);
    broadcast(group, &joined, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::run_ranks;
    use crate::memory::storage_key;
    use candle_core::Device;
    use std::time::Duration;

    #[test]
    fn thread_ranks_hold_one_gathered_tensor_with_all_gathers_value() {
        let out = run_ranks(3, Duration::from_secs(10), |g| -> Result<_> {
            let mine = Tensor::new(&[[g.rank() as f32, 10.0 + g.rank() as f32]], &Device::Cpu)?;
            let once = all_gather_once(g.as_ref(), &mine, 0)?;
            let plain = g.all_gather(&mine, 0)?;
            let b = broadcast(g.as_ref(), &(&mine + 100.0)?, 2)?;
            Ok((once.to_vec2::<f32>()?, plain.to_vec2::<f32>()?, storage_key(&once), b.to_vec2::<f32>()?))
        });
        let out: Vec<_> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
        for (once, plain, _, b) in &out {
            assert_eq!(once, plain);
            assert_eq!(once, &vec![vec![0., 10.], vec![1., 11.], vec![2., 12.]]);
            assert_eq!(b, &vec![vec![102., 112.]]);
        }
        // One storage for the three ranks.
        assert!(out.iter().all(|o| o.2 == out[0].2), "each rank holds its own copy");
    }

    /// Tensors that do not join fail on rank 0, and the other ranks, waiting for the joined tensor, stop at
    /// once with rank 0's error instead of at their timeout.
    #[test]
    fn tensors_that_do_not_join_stop_every_rank_at_once() {
        let start = std::time::Instant::now();
        let out = run_ranks(2, Duration::from_secs(30), |g| {
            let mine = Tensor::zeros((1, 2 + g.rank()), candle_core::DType::F32, &Device::Cpu)?;
            all_gather_once(g.as_ref(), &mine, 0).map(|_| ())
        });
        let errors: Vec<String> = out.into_iter().map(|r| r.unwrap().unwrap_err().to_string()).collect();
        assert!(errors[0].contains("do not join along dim 0"), "{errors:?}");
        assert!(errors[1].contains("rank 0") && errors[1].contains("do not join"), "{errors:?}");
        assert!(start.elapsed() < Duration::from_secs(10), "rank 1 waited for its timeout: {errors:?}");
    }
}
