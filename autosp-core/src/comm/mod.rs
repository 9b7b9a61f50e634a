//! Communication between the ranks of a sequence-parallel job.
//!
//! [`ProcessGroup`] is the interface the sharded attention strategies and the loss/gradient reductions call:
//! `all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`, `send`/`recv`/`send_recv` (the ring step;
//! `start_send_recv` returns a [`PendingRecv`] so compute can overlap the transfer),
//! `barrier`, `split` into subgroups (for 2D layouts: [`contiguous_groups`], [`strided_groups`]) and
//! `duplicate` (a second handle for a communication thread; [`ProcessGroup::concurrent_handles`] says whether
//! the two may run at once: threads and MPI yes, NCCL where `nccl.rs` says). Back ends:
//!
//! - [`ThreadGroup`] (always built): P ranks as threads of one process; start them with [`run_ranks`].
//! - `MpiGroup` (feature `mpi`, the `mpi` crate over OpenMPI): one process per rank under `mpirun`; see
//!   `autosp-core/examples/mpi_collectives.rs`.
//! - `NcclGroup` (feature `nccl`, NCCL through cudarc): one rank per GPU; all-reduce, reduce-scatter and
//!   all-gather are NCCL's own (the shape header travels in the same NCCL group and is checked after),
//!   all-to-all and send/recv are grouped `ncclSend`/`ncclRecv` after a header round; bootstrapped over another
//!   group (`NcclId::share`); see `nccl.rs` for what its timeouts cover. Type-checked only: it has not run on a
//!   GPU.
//!
//! Every back end provides a small [`Transport`] (one synchronising personalised exchange plus point-to-point
//! transfers, and optionally its own all-reduce, reduce-scatter and all-gather) and shares [`Communicator`],
//! which builds the collectives, checks arguments, reduces in rank order and counts. The threads and MPI back
//! ends give the same bits: reductions run in rank order 0, 1, ..., P-1 (bf16/f16 accumulated in f32), and every
//! rank of `all_reduce` receives the very chunks their owners reduced; NCCL's sums are in its own order (the
//! same bits on every rank, not rank order).
//!
//! # Failures
//!
//! Every call waits at most the group's `timeout()` (default [`DEFAULT_TIMEOUT`]). A rank that never arrives
//! gives the others [`CommError::Timeout`] naming the collective, the group and the missing ranks; with
//! threads, a rank that returned or panicked is reported at once as [`CommError::PeerGone`]. The group is
//! then poisoned: later calls fail at once with [`CommError::Poisoned`]. A rank whose own arguments are
//! invalid still takes part, sending nothing, so its peers fail at once with [`CommError::Mismatch`].
//!
//! Every message carries a [`Stamp`]: the operation and the caller's collective call number on the group
//! (point-to-point: the message's number between the two ranks). Ranks that reach a round in different
//! collectives (one skipped or added a call) all fail with [`CommError::OutOfStep`], naming both operations
//! and call numbers, and the group is poisoned; without the stamp they would pair the wrong operations.
//!
//! A rank that gives up on an error calls [`ProcessGroup::abort`] with it ([`run_ranks_fallible`] does for
//! thread ranks): every other rank of the job stops at once with [`CommError::PeerFailed`] carrying that
//! error, on every group, instead of waiting for the timeout (MPI: see `mpi.rs`).
//!
//! # What the statistics count
//!
//! [`ProcessGroup::stats`] counts, per kind of call, the calls this rank made on this group handle
//! (subgroups count on their own handles) and the tensor payload bytes it sent to *other* ranks (message
//! headers and empty markers are not counted; a tensor's bytes are `elem_count * dtype.size_in_bytes()`,
//! whether or not the back end copies it). With P ranks, this rank r, `s` bytes per element:
//!
//! | call | bytes sent by rank r |
//! |---|---|
//! | `all_reduce(x)`, `x` of n elements | `(n + (P-2)·c_r)·s`, chunk `c_r = n/P + (r < n%P)`; `2·(P-1)/P·n·s` when P divides n |
//! | `all_gather(x, dim)` | `(P-1)·bytes(x)` |
//! | `reduce_scatter(x, dim)` | `(P-1)/P·bytes(x)` |
//! | `all_to_all(inputs)` | `sum over j != r of bytes(inputs[j])` |
//! | `send(x, dst)`, `send_recv(x, dst, src)`, `start_send_recv` | `bytes(x)`, or 0 when `dst == r` (both send_recv forms count as `SendRecv`) |
//! | `recv`, `barrier` | 0 |
//! | `split(groups)` | `(P-1)·8·(1 + G + P)` (the group list, G groups, as i64, to compare across ranks) |
//!
//! [`RecordingGroup`] wraps any group and logs every call (group, kind, elements, dtype, thread, and the
//! [`BackwardMark`](crate::progress::BackwardMark) of the backward pass that posted it), for tests that
//! assert the order of a step's collectives.
//!
//! A call counts once it passed this rank's own argument checks, before any waiting, so a call that then
//! fails (timeout, mismatch) is still counted.

pub mod collective;
pub mod communicator;
pub mod error;
pub mod groups;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(any(feature = "nccl", test))]
mod nccl_header;
pub mod process_group;
pub mod rank_failure;
pub mod recording;
mod reduce;
pub mod schedule;
pub mod shared;
pub mod stamp;
pub mod stats;
pub mod threads;
pub mod transport;
pub mod wire;

pub use collective::{Collective, ReduceOp};
pub use communicator::Communicator;
pub use error::{CommError, Departure, PeerCall, Result};
pub use groups::{contiguous_groups, strided_groups};
#[cfg(feature = "mpi")]
pub use mpi::{MpiGroup, MpiTransport};
#[cfg(feature = "nccl")]
pub use nccl::{NcclGroup, NcclId, NcclTransport};
pub use process_group::{PendingRecv, ProcessGroup, DEFAULT_TIMEOUT};
pub use rank_failure::{abort_on_error, with_causes};
pub use recording::{CallRecord, RecordingGroup};
pub use schedule::{pairwise_schedule, PairStep};
pub use shared::{all_gather_once, broadcast};
pub use stamp::Stamp;
pub use stats::{all_reduce_bytes, tensor_bytes, CommStats};
pub use threads::{run_ranks, run_ranks_fallible, ThreadGroup, ThreadTransport};
pub use transport::Transport;
