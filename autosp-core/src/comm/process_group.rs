//! The `ProcessGroup` trait every back end implements, and the default timeout. The kinds of call and the
//! reduction ops it takes are in `collective.rs`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Tensor;

use super::collective::ReduceOp;
use super::error::Result;
use super::stats::CommStats;

/// Timeout a group gets when its constructor is not given one.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A timeout in whole nanoseconds, clamped to a year so that `Instant + timeout` cannot overflow.
pub(crate) fn nanos(d: Duration) -> u64 {
    const YEAR_NS: u64 = 365 * 24 * 3600 * 1_000_000_000;
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).min(YEAR_NS)
}

/// A ring step in flight (see [`ProcessGroup::start_send_recv`]).
pub trait PendingRecv {
    /// Finishes the step: waits (at most the group's timeout, counted from this call) until the send is done
    /// and the tensor from the source rank has arrived, and returns it.
    fn wait(self: Box<Self>) -> Result<Tensor>;
}

/// A group of `size()` ranks that exchange candle tensors. Each rank holds its own handle and calls the
/// collectives on it; every rank of the group must call the same collectives in the same order (point-to-point
/// calls excepted), and one rank's calls on one handle must not overlap.
///
/// Tensors may have any shape and any dtype the back end carries (the thread back end: all; MPI: u8, u32,
/// i16, i32, i64, bf16, f16, f32, f64), may be non-contiguous, and live on any device (results come back on the
/// input's device; `recv` on the back end's device). Every call waits at most `timeout()` for the other
/// ranks and otherwise fails with [`CommError::Timeout`](super::CommError::Timeout) (or
/// [`PeerGone`](super::CommError::PeerGone) as soon as a needed rank is known to have left): never a hang.
/// After such a failure the group is poisoned and every later call fails at once.
///
/// A rank whose own arguments are invalid still takes part (sending nothing) so that the others fail
/// promptly with `Mismatch` instead of waiting for the timeout.
pub trait ProcessGroup: Send + Sync + fmt::Debug {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// Label of the group, used in errors (e.g. `world`, `world/split0:[0,1]`).
    fn name(&self) -> &str;

    /// How long any call waits for the other ranks.
    fn timeout(&self) -> Duration;

    /// Changes this rank's timeout for later calls on this handle (give every rank the same value; values
    /// above a year count as a year).
    fn set_timeout(&self, timeout: Duration);

    /// Whether the ranks are threads of one process that pass tensors by handle: a tensor one rank sends is
    /// the very tensor the others receive (see [`shared`](super::shared)). `false` for one process per rank.
    fn shares_memory(&self) -> bool {
        false
    }

    /// Element-wise reduction of `x` over all ranks; every rank gets the same bits.
    /// `x`: any shape, the same shape and dtype on every rank. Returns that shape.
    /// Algorithm: reduce-scatter of the flattened tensor in P nearly equal chunks (chunk j reduced by rank j
    /// in rank order), then all-gather of the reduced chunks.
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Concatenation along `dim` of every rank's `x`, in rank order. `x`: the same shape on every rank except
    /// along `dim`, where sizes may differ; the result has size `sum_r x_r.dim(dim)` there.
    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor>;

    /// Reduction over all ranks, of which rank r keeps chunk r along `dim`.
    /// `x`: `[.., n, ..]` with `n` (at `dim`) divisible by `size()`, the same shape on every rank;
    /// returns `[.., n / size(), ..]`.
    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor>;

    /// Personalised exchange: `inputs[j]` goes to rank j; output `j` is what rank j sent to this rank.
    /// `inputs.len() == size()`; shapes and dtypes may differ per pair. Own entry is returned as is.
    fn all_to_all(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>>;

    /// Sends `x` to rank `dst`. May return before `dst` receives (thread back end: buffered) or block until
    /// it does (MPI, large messages): a correct program relies on neither; use `send_recv` for a ring step.
    fn send(&self, x: &Tensor, dst: usize) -> Result<()>;

    /// Receives the next tensor that rank `src` sent to this rank (messages from one rank arrive in order).
    fn recv(&self, src: usize) -> Result<Tensor>;

    /// Sends `x` to `dst` while receiving from `src`: one ring step (`dst = rank+1`, `src = rank-1`, mod P).
    /// Never deadlocks when every rank calls it at once.
    fn send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Tensor>;

    /// Starts a ring step and returns at once: the send to `dst` is under way and the receive from `src` is
    /// completed by [`PendingRecv::wait`], so that work can run in between (overlap). Counts as a `send_recv`.
    /// Until it is waited, do not receive from `src` on this group in any other way (messages from one rank
    /// arrive in order); a step that is dropped unwaited leaves its message to the next receive from `src`.
    fn start_send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv + '_>>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Splits the group into subgroups; a collective call (every rank passes the same `groups`).
    /// `groups` must partition `0..size()`: each rank in exactly one list. Returns the subgroup that holds
    /// this rank, whose ranks are numbered in list order (`groups[g][i]` becomes rank `i`). For 2D layouts see
    /// [`contiguous_groups`](super::contiguous_groups) and [`strided_groups`](super::strided_groups).
    /// The subgroup keeps its own statistics and inherits the timeout.
    fn split(&self, groups: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>>;

    /// A second handle on the same ranks, for collectives that run on another thread beside this handle's
    /// (a gradient reduction overlapped with backward); a collective call, like `split`. Its calls have their
    /// own sequence (they never pair with this handle's), and they count in this handle's
    /// [`stats`](Self::stats) (back ends built on [`Communicator`](super::Communicator); the default, a
    /// one-group `split`, counts apart). Whether the two may really run at once is
    /// [`concurrent_handles`](Self::concurrent_handles).
    fn duplicate(&self) -> Result<Arc<dyn ProcessGroup>> {
        self.split(&[(0..self.size()).collect()])
    }

    /// Whether this handle and a [`duplicate`](Self::duplicate) of it may run collectives from two threads at
    /// once. Threads: yes. MPI: yes (the process-wide MPI lock is held for one polling round at a time, so
    /// the two threads' collectives interleave; see `mpi.rs`). NCCL: yes where `nccl.rs` says (each handle on
    /// its own CUDA stream; stream-ordered allocation, `NCCL_RUNTIME_CONNECT=0` from NCCL 2.22 on).
    fn concurrent_handles(&self) -> bool {
        false
    }

    /// Tells every rank of the job (every rank of the world this group was split from) that this rank
    /// failed, with `message` (its error): the other ranks' calls in progress and all their later calls, on
    /// every group of the job, fail within moments with [`CommError::PeerFailed`](super::CommError::PeerFailed)
    /// naming this rank and `message`, instead of waiting for the timeout. This rank's own later calls fail
    /// too. Call it when a rank gives up on an error (a rank whose error came from a peer's failure need not;
    /// it is then harmless). Thread ranks: [`run_ranks_fallible`](super::run_ranks_fallible) calls it for a
    /// rank function that returns `Err`. MPI: see `mpi.rs` for how the other processes are told.
    fn abort(&self, message: &str);

    /// Calls and bytes sent by this rank on this group (subgroups count separately) since the last reset.
    fn stats(&self) -> CommStats;

    /// Sets this rank's counters back to zero.
    fn reset_stats(&self);
}
