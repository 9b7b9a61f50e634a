//! `CommError`: every way a collective or a point-to-point transfer can fail, each naming the collective,
//! the group and the rank(s) involved, and saying what to do about it.

use std::fmt;
use std::time::Duration;

use super::collective::Collective;

/// Result of a communication call.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// How a peer rank left its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Departure {
    /// The rank's function returned (or its last handle on the group was dropped) without joining.
    Returned,
    /// The rank's thread panicked.
    Panicked,
}

impl fmt::Display for Departure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Departure::Returned => f.write_str("returned (dropped its group handles)"),
            Departure::Panicked => f.write_str("panicked"),
        }
    }
}

/// A communication failure. Ranks are ranks *within the named group*.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Some ranks did not take part in time.
    #[error(
        "{collective} on group `{group}`: rank {rank} of {size} waited {waited:?} (timeout {timeout:?}) and \
         rank(s) {missing:?} never arrived; check that every rank of the group calls the same collectives in \
         the same order and that none died or hung, or give the group a longer timeout if the work between \
         collectives is legitimately slower"
    )]
    Timeout {
        collective: Collective,
        group: String,
        rank: usize,
        size: usize,
        missing: Vec<usize>,
        waited: Duration,
        timeout: Duration,
    },
    /// A rank that this call needs has left the group (returned or panicked) without taking part.
    #[error(
        "{collective} on group `{group}`: rank {peer} {how} before taking part, so rank {rank} cannot finish \
         (noticed after {waited:?}); look at rank {peer}'s own result or panic message for the cause"
    )]
    PeerGone { collective: Collective, group: String, rank: usize, peer: usize, how: Departure, waited: Duration },
    /// An earlier failure left the group's ranks out of step; the group cannot be used again.
    #[error(
        "{collective} on group `{group}` (rank {rank}): the group is unusable after an earlier failure \
         ({cause}); start a new group to go on"
    )]
    Poisoned { collective: Collective, group: String, rank: usize, cause: String },
    /// The ranks are in different collectives: this rank's call `call` on the group is `collective`, but in the
    /// same round other ranks are in another collective or another call (`others`). Some rank skipped or added
    /// a collective; the group is poisoned.
    #[error(
        "{collective} on group `{group}`: the ranks are out of step: rank {rank} is in its collective call #{call} \
         ({collective}) but {}; every rank must call the same collectives in the same order, so look for a \
         collective that only some ranks reach (a branch on the rank or on data only one rank holds, an early \
         return, an error that one rank swallowed)",
        list_calls(.others)
    )]
    OutOfStep { collective: Collective, group: String, rank: usize, call: u64, others: Vec<PeerCall> },
    /// A rank of the job failed and told the others ([`ProcessGroup::abort`](super::ProcessGroup::abort)):
    /// every rank's call in progress and every later call, on every group of the job, fails at once with this.
    /// `peer` is the failed rank's rank in the whole job (the thread world or `MPI_COMM_WORLD`).
    #[error(
        "{collective} on group `{group}` (rank {rank}): rank {peer} of the job failed, so this rank stops too; \
         rank {peer}'s error: {message}"
    )]
    PeerFailed { collective: Collective, group: String, rank: usize, peer: usize, message: String },
    /// This rank's own arguments are wrong (a dimension out of range, a size that does not divide, ...).
    #[error("{collective} on group `{group}` (rank {rank}): {detail}")]
    InvalidArgument { collective: Collective, group: String, rank: usize, detail: String },
    /// Ranks passed inputs that do not fit together (shapes, dtypes, group lists), or a peer rejected its own.
    #[error(
        "{collective} on group `{group}` (rank {rank}): the ranks' inputs disagree: {detail}; every rank \
         must pass matching shapes and dtypes"
    )]
    Mismatch { collective: Collective, group: String, rank: usize, detail: String },
    /// A tensor operation inside the collective failed.
    #[error("{collective} on group `{group}` (rank {rank}): tensor operation failed: {source}")]
    Candle {
        collective: Collective,
        group: String,
        rank: usize,
        #[source]
        source: Box<candle_core::Error>,
    },
    /// The MPI back end failed (bad message, unsupported dtype, MPI setup).
    #[error("{collective} on group `{group}` (rank {rank}): MPI: {detail}")]
    Mpi { collective: Collective, group: String, rank: usize, detail: String },
    /// The NCCL back end failed (an NCCL or CUDA call returned an error, a bad header, a non-CUDA device).
    #[error("{collective} on group `{group}` (rank {rank}): NCCL: {detail}")]
    Nccl { collective: Collective, group: String, rank: usize, detail: String },
    /// A rank's function panicked (reported by the thread launcher for that rank).
    #[error("rank {rank} panicked: {message}")]
    RankPanicked { rank: usize, message: String },
    /// A group could not be created as asked.
    #[error("cannot create the process group: {detail}")]
    Config { detail: String },
}

/// Where another rank was when the ranks were found out of step (see [`CommError::OutOfStep`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCall {
    /// The rank, within the group.
    pub rank: usize,
    /// The collective it called.
    pub collective: Collective,
    /// Its collective call number on the group (0 for its first).
    pub call: u64,
}

impl fmt::Display for PeerCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} is in its call #{} ({})", self.rank, self.call, self.collective)
    }
}

fn list_calls(others: &[PeerCall]) -> String {
    others.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
}

/// Where an error happened: builds `CommError`s that name the collective, the group and the rank.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ErrCtx<'a> {
    pub collective: Collective,
    pub group: &'a str,
    pub rank: usize,
}

impl ErrCtx<'_> {
    pub fn invalid(&self, detail: impl Into<String>) -> CommError {
        CommError::InvalidArgument {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            detail: detail.into(),
        }
    }

    pub fn mismatch(&self, detail: impl Into<String>) -> CommError {
        CommError::Mismatch {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            detail: detail.into(),
        }
    }

    pub fn candle(&self, source: candle_core::Error) -> CommError {
        CommError::Candle {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            source: Box::new(source),
        }
    }

    pub fn poisoned(&self, cause: impl Into<String>) -> CommError {
        CommError::Poisoned {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            cause: cause.into(),
        }
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub fn mpi(&self, detail: impl Into<String>) -> CommError {
        CommError::Mpi {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            detail: detail.into(),
        }
    }

    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub fn nccl(&self, detail: impl Into<String>) -> CommError {
        CommError::Nccl {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            detail: detail.into(),
        }
    }

    pub fn timeout(&self, size: usize, missing: Vec<usize>, waited: Duration, timeout: Duration) -> CommError {
        CommError::Timeout {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            size,
            missing,
            waited,
            timeout,
        }
    }

    pub fn out_of_step(&self, call: u64, others: Vec<PeerCall>) -> CommError {
        CommError::OutOfStep {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            call,
            others,
        }
    }

    pub fn peer_failed(&self, peer: usize, message: impl Into<String>) -> CommError {
        CommError::PeerFailed {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            peer,
            message: message.into(),
        }
    }

    pub fn peer_gone(&self, peer: usize, how: Departure, waited: Duration) -> CommError {
        CommError::PeerGone {
            collective: self.collective,
            group: self.group.to_string(),
            rank: self.rank,
            peer,
            how,
            waited,
        }
    }
}
