//! [`RecordingGroup`]: a process group that passes every call on to another and records it (which group,
//! which collective, the tensor's elements and dtype, the calling thread, and where the backward or forward
//! pass that posted it stood, [`BackwardMark`] and [`ForwardMark`]), so that tests can assert the order and
//! number of a step's collectives: one gradient reduction round per step, the first bucket posted before
//! backward ended, a block's weights gathered before the block began.
//! Groups split or duplicated from it record into the same log.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Tensor};

use super::collective::{Collective, ReduceOp};
use super::error::Result;
use super::process_group::{PendingRecv, ProcessGroup};
use super::stats::CommStats;
use crate::progress::{current_forward_mark, current_mark, BackwardMark, ForwardMark};

/// One call a [`RecordingGroup`] passed on.
#[derive(Clone, Debug, PartialEq)]
pub struct CallRecord {
    /// The group's name (see [`ProcessGroup::name`]).
    pub group: String,
    /// The kind of call.
    pub collective: Collective,
    /// Elements of the tensor passed (summed over an all-to-all's; 0 for a barrier or a split).
    pub elems: usize,
    /// Its dtype (`None` where no tensor is passed).
    pub dtype: Option<DType>,
    /// The calling thread's name (`None` for an unnamed thread).
    pub thread: Option<String>,
    /// Where the backward pass that made or posted the call stood ([`crate::progress::current_mark`]).
    pub mark: Option<BackwardMark>,
    /// Where the forward pass that made or asked for the call stood
    /// ([`crate::progress::current_forward_mark`]).
    pub forward: Option<ForwardMark>,
}

/// A process group that records every call this rank makes on it (and on the groups split or duplicated
/// from it) into one shared log, then makes it on the group it wraps.
pub struct RecordingGroup {
    inner: Arc<dyn ProcessGroup>,
    log: Arc<Mutex<Vec<CallRecord>>>,
}

impl fmt::Debug for RecordingGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordingGroup").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl RecordingGroup {
    /// Wraps `inner` with an empty log.
    pub fn new(inner: Arc<dyn ProcessGroup>) -> Arc<Self> {
        Arc::new(Self { inner, log: Arc::default() })
    }

    /// Every call recorded so far, in the order they were made (on this rank, over every thread).
    pub fn records(&self) -> Vec<CallRecord> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets the calls recorded so far.
    pub fn clear(&self) {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    fn note(&self, collective: Collective, elems: usize, dtype: Option<DType>) {
        let record = CallRecord {
            group: self.inner.name().to_string(),
            collective,
            elems,
            dtype,
            thread: std::thread::current().name().map(str::to_string),
            mark: current_mark(),
            forward: current_forward_mark(),
        };
        self.log.lock().unwrap_or_else(|e| e.into_inner()).push(record);
    }

    fn wrap(&self, inner: Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> {
        Arc::new(Self { inner, log: self.log.clone() })
    }
}

impl ProcessGroup for RecordingGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }

    fn shares_memory(&self) -> bool {
        self.inner.shares_memory()
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.note(Collective::AllReduce, x.elem_count(), Some(x.dtype()));
        self.inner.all_reduce(x, op)
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        self.note(Collective::AllGather, x.elem_count(), Some(x.dtype()));
        self.inner.all_gather(x, dim)
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.note(Collective::ReduceScatter, x.elem_count(), Some(x.dtype()));
        self.inner.reduce_scatter(x, dim, op)
    }

    fn all_to_all(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let elems = inputs.iter().map(Tensor::elem_count).sum();
        self.note(Collective::AllToAll, elems, inputs.first().map(Tensor::dtype));
        self.inner.all_to_all(inputs)
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        self.note(Collective::Send, x.elem_count(), Some(x.dtype()));
        self.inner.send(x, dst)
    }

    fn recv(&self, src: usize) -> Result<Tensor> {
        self.note(Collective::Recv, 0, None);
        self.inner.recv(src)
    }

    fn send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Tensor> {
        self.note(Collective::SendRecv, x.elem_count(), Some(x.dtype()));
        self.inner.send_recv(x, dst, src)
    }

    fn start_send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv + '_>> {
        self.note(Collective::SendRecv, x.elem_count(), Some(x.dtype()));
        self.inner.start_send_recv(x, dst, src)
    }

    fn barrier(&self) -> Result<()> {
        self.note(Collective::Barrier, 0, None);
        self.inner.barrier()
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>> {
        self.note(Collective::Split, 0, None);
        Ok(self.wrap(self.inner.split(groups)?))
    }

    fn duplicate(&self) -> Result<Arc<dyn ProcessGroup>> {
        self.note(Collective::Split, 0, None);
        Ok(self.wrap(self.inner.duplicate()?))
    }

    fn concurrent_handles(&self) -> bool {
        self.inner.concurrent_handles()
    }

    fn abort(&self, message: &str) {
        self.inner.abort(message)
    }

    fn stats(&self) -> CommStats {
        self.inner.stats()
    }

    fn reset_stats(&self) {
        self.inner.reset_stats()
    }
}
