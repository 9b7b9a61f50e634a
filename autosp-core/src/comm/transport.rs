//! `Transport`: the few primitives a back end provides (a synchronising personalised exchange and
//! point-to-point transfers); `Communicator` builds every collective of `ProcessGroup` on top of them.

use std::fmt;
use std::time::Duration;

use candle_core::{Device, Tensor};

use super::collective::ReduceOp;
use super::error::Result;
use super::process_group::PendingRecv;
use super::stamp::Stamp;

/// What a back end must provide. Ranks are ranks within this group. Every method waits at most `timeout()`
/// and reports missing ranks with `CommError::Timeout` / `CommError::PeerGone`; after such a failure the
/// transport is poisoned and fails every later call with `CommError::Poisoned`.
pub trait Transport: Send + Sync + fmt::Debug + Sized + 'static {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Group label used in errors.
    fn name(&self) -> &str;
    /// How long a call waits for the other ranks.
    fn timeout(&self) -> Duration;
    /// Changes the timeout of later calls.
    fn set_timeout(&self, timeout: Duration);
    /// Whether the ranks share one address space, so that a tensor passed in [`exchange`](Self::exchange)
    /// arrives as the sender's own handle, not a copy (thread ranks). `false` unless a back end says so.
    fn shares_memory(&self) -> bool {
        false
    }
    /// Whether two handles on this rank (a group and its [`duplicate`](super::ProcessGroup::duplicate)) may
    /// run collectives from two threads at once without either waiting for the other's to finish. `false`
    /// unless a back end says so.
    fn concurrent_handles(&self) -> bool {
        false
    }

    /// One synchronising round of the collective call `stamp`: `outgoing[j]` (`outgoing.len() == size()`) goes to rank j, and entry i of the
    /// result is what rank i put at this rank's index. `None` entries carry no payload but the round still
    /// waits for every rank. The own entry is passed through untouched. Received tensors land on `device`
    /// where the back end has to materialise them. Every rank's `stamp` travels with its messages; when the
    /// ranks' stamps differ, every rank fails with `CommError::OutOfStep` and the group is poisoned.
    fn exchange(&self, stamp: Stamp, outgoing: Vec<Option<Tensor>>, device: &Device) -> Result<Vec<Option<Tensor>>>;

    /// The back end's own all-reduce of `x` (the call `stamp`; `x` valid, the same shape and dtype on every
    /// rank), or `None` (the default) to have `Communicator` build it from [`exchange`](Self::exchange). A back
    /// end answers alike on every rank for the same dtype, so that all ranks take the same path. The result
    /// is on `x`'s device; the timeout, poisoning and stamp rules are [`exchange`](Self::exchange)'s.
    fn all_reduce(&self, _stamp: Stamp, _x: &Tensor, _op: ReduceOp) -> Option<Result<Tensor>> {
        None
    }

    /// The back end's own reduce-scatter of `x` along `dim` (valid, dividing by the group size, the same shape
    /// and dtype on every rank), or `None` (the default); as [`all_reduce`](Self::all_reduce).
    fn reduce_scatter(&self, _stamp: Stamp, _x: &Tensor, _dim: usize, _op: ReduceOp) -> Option<Result<Tensor>> {
        None
    }

    /// The back end's own all-gather of every rank's `x` along `dim` (valid; the sizes along `dim` may differ
    /// between ranks), or `None` (the default); as [`all_reduce`](Self::all_reduce).
    fn all_gather(&self, _stamp: Stamp, _x: &Tensor, _dim: usize) -> Option<Result<Tensor>> {
        None
    }

    /// Sends `x` to rank `dst` (see `ProcessGroup::send` for the blocking rules).
    fn send(&self, x: &Tensor, dst: usize) -> Result<()>;

    /// Receives the next tensor from rank `src`.
    fn recv(&self, src: usize) -> Result<Tensor>;

    /// Starts sending `x` to `dst` and returns the pending receive from `src`; waiting on it must not deadlock
    /// when all ranks do the same.
    fn start_send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv + '_>>;

    /// Tells every rank of the job that this rank failed with `message` (see `ProcessGroup::abort`).
    fn abort(&self, message: &str);

    /// The transport of subgroup `groups[group]` in which this rank is number `index`. Called by every rank
    /// after the ranks agreed on `groups` (a partition of `0..size()`).
    fn split(&self, groups: &[Vec<usize>], group: usize, index: usize) -> Result<Self>;
}
