//! `Communicator`: the collectives of `ProcessGroup` built from a back end's `Transport` exchange, with the
//! argument checks, the rank-order reductions and the call/byte counting shared by every back end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{Device, Tensor};

use super::collective::{Collective, ReduceOp};
use super::error::{ErrCtx, Result};
use super::groups;
use super::process_group::{PendingRecv, ProcessGroup};
use super::reduce::{chunk_sizes, reduce_in_rank_order};
use super::stamp::Stamp;
use super::stats::{all_reduce_bytes, tensor_bytes, CommStats, StatsCounter};
use super::transport::Transport;

/// A process group over transport `T` (see [`ThreadGroup`](super::ThreadGroup) and, with feature `mpi`,
/// `MpiGroup`).
#[derive(Debug)]
pub struct Communicator<T: Transport> {
    transport: T,
    /// Shared with the handles [`ProcessGroup::duplicate`] made from this one.
    stats: Arc<StatsCounter>,
    /// Collective calls this rank made on this group (numbers each call's [`Stamp`]).
    calls: AtomicU64,
}

impl<T: Transport> Communicator<T> {
    /// Wraps a transport; counters start at zero.
    pub fn new(transport: T) -> Self {
        Self { transport, stats: Arc::default(), calls: AtomicU64::new(0) }
    }

    /// The underlying transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    fn ctx(&self, collective: Collective) -> ErrCtx<'_> {
        ErrCtx { collective, group: self.transport.name(), rank: self.transport.rank() }
    }

    /// The stamp of this rank's next collective call (numbering it).
    fn stamp(&self, collective: Collective) -> Stamp {
        Stamp::new(collective, self.calls.fetch_add(1, Ordering::Relaxed))
    }

    fn check_peer(&self, collective: Collective, peer: usize, role: &str) -> Result<()> {
        let size = self.transport.size();
        if peer >= size {
            return Err(self
                .ctx(collective)
                .invalid(format!("{role} rank {peer} does not exist: the group has {size} ranks (0..{size})")));
        }
        Ok(())
    }

    /// Runs one exchange round even when this rank's arguments were rejected (sending nothing), so that the
    /// peers fail promptly; then returns this rank's own error, or every peer's tensor.
    fn round(
        &self,
        stamp: Stamp,
        prepared: Result<Vec<Tensor>>,
        bytes: impl FnOnce(&[Tensor]) -> u64,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let (size, collective) = (self.transport.size(), stamp.collective);
        let outgoing = match &prepared {
            Ok(parts) => {
                self.stats.record(collective, bytes(parts));
                parts.iter().cloned().map(Some).collect()
            }
            Err(_) => vec![None; size],
        };
        let incoming = self.transport.exchange(stamp, outgoing, device)?;
        prepared?;
        self.all_present(collective, incoming)
    }

    fn all_present(&self, collective: Collective, incoming: Vec<Option<Tensor>>) -> Result<Vec<Tensor>> {
        incoming
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                t.ok_or_else(|| {
                    self.ctx(collective).mismatch(format!(
                        "rank {i} sent nothing: it rejected its own arguments or found the ranks' inputs \
                         inconsistent (see rank {i}'s error)"
                    ))
                })
            })
            .collect()
    }

    /// Checks that every part has the dtype and shape of `parts[0]`.
    fn same_layout(&self, collective: Collective, parts: &[Tensor]) -> Result<()> {
        for (i, t) in parts.iter().enumerate().skip(1) {
            if t.dtype() != parts[0].dtype() || t.dims() != parts[0].dims() {
                return Err(self.ctx(collective).mismatch(format!(
                    "rank {i} sent {:?} {:?} where rank 0 sent {:?} {:?}",
                    t.dtype(),
                    t.dims(),
                    parts[0].dtype(),
                    parts[0].dims()
                )));
            }
        }
        Ok(())
    }

    fn bytes_to_others(&self, parts: &[Tensor]) -> u64 {
        let rank = self.transport.rank();
        parts.iter().enumerate().filter(|(j, _)| *j != rank).map(|(_, t)| tensor_bytes(t)).sum()
    }
}

impl<T: Transport> ProcessGroup for Communicator<T> {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn size(&self) -> usize {
        self.transport.size()
    }

    fn name(&self) -> &str {
        self.transport.name()
    }

    fn timeout(&self) -> Duration {
        self.transport.timeout()
    }

    fn set_timeout(&self, timeout: Duration) {
        self.transport.set_timeout(timeout)
    }

    fn shares_memory(&self) -> bool {
        self.transport.shares_memory()
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let c = Collective::AllReduce;
        let stamp = self.stamp(c);
        let ctx = self.ctx(c);
        let (size, rank) = (self.size(), self.rank());
        let elem = x.dtype().size_in_bytes();
        if let Some(reduced) = self.transport.all_reduce(stamp, x, op) {
            self.stats.record(c, all_reduce_bytes(x.elem_count(), size, rank, elem));
            return reduced;
        }
        // Phase 1, reduce-scatter: rank j receives chunk j of every rank's flattened tensor and reduces it.
        let flat = x.flatten_all().map_err(|e| ctx.candle(e))?;
        let sizes = chunk_sizes(flat.elem_count(), size);
        let mut chunks = Vec::with_capacity(size);
        let mut offset = 0;
        for &len in &sizes {
            chunks.push(flat.narrow(0, offset, len).map_err(|e| ctx.candle(e))?);
            offset += len;
        }
        let elem = elem as u64;
        // Bytes: every chunk but its own in phase 1, its reduced chunk to P-1 ranks in phase 2.
        let bytes = |parts: &[Tensor]| self.bytes_to_others(parts) + (size as u64 - 1) * sizes[rank] as u64 * elem;
        let mine = self.round(stamp, Ok(chunks), bytes, x.device())?;
        let reduced =
            self.same_layout(c, &mine).and_then(|()| reduce_in_rank_order(&mine, op).map_err(|e| ctx.candle(e)));
        // Phase 2, all-gather of the reduced chunks. A rank that failed sends nothing so the others stop too.
        let outgoing = match &reduced {
            Ok(t) => vec![Some(t.clone()); size],
            Err(_) => vec![None; size],
        };
        let incoming = self.transport.exchange(stamp, outgoing, x.device())?;
        reduced?;
        let parts = self.all_present(c, incoming)?;
        Tensor::cat(&parts, 0).and_then(|t| t.reshape(x.shape())).map_err(|e| ctx.candle(e))
    }

    fn all_gather(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let c = Collective::AllGather;
        let stamp = self.stamp(c);
        let ctx = self.ctx(c);
        let size = self.size();
        if dim < x.rank() {
            if let Some(gathered) = self.transport.all_gather(stamp, x, dim) {
                self.stats.record(c, (size as u64 - 1) * tensor_bytes(x));
                return gathered;
            }
        }
        let prepared = if dim < x.rank() {
            Ok(vec![x.clone(); size])
        } else {
            Err(ctx.invalid(format!("dim {dim} is out of range for a tensor of shape {:?}", x.dims())))
        };
        let parts = self.round(stamp, prepared, |p| self.bytes_to_others(p), x.device())?;
        for (i, t) in parts.iter().enumerate() {
            let same_rest =
                t.rank() == x.rank() && (0..x.rank()).all(|d| d == dim || t.dims()[d] == parts[0].dims()[d]);
            if t.dtype() != parts[0].dtype() || !same_rest {
                return Err(ctx.mismatch(format!(
                    "rank {i} sent {:?} {:?} where rank 0 sent {:?} {:?} (only dim {dim} may differ)",
                    t.dtype(),
                    t.dims(),
                    parts[0].dtype(),
                    parts[0].dims()
                )));
            }
        }
        Tensor::cat(&parts, dim).map_err(|e| ctx.candle(e))
    }

    fn reduce_scatter(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let c = Collective::ReduceScatter;
        let stamp = self.stamp(c);
        let ctx = self.ctx(c);
        let size = self.size();
        let prepared = if dim >= x.rank() {
            Err(ctx.invalid(format!("dim {dim} is out of range for a tensor of shape {:?}", x.dims())))
        } else if !x.dims()[dim].is_multiple_of(size) {
            Err(ctx.invalid(format!(
                "dim {dim} of shape {:?} has size {} which does not divide by the group size {size}; pad it",
                x.dims(),
                x.dims()[dim]
            )))
        } else {
            if let Some(reduced) = self.transport.reduce_scatter(stamp, x, dim, op) {
                self.stats.record(c, (size as u64 - 1) * tensor_bytes(x) / size as u64);
                return reduced;
            }
            let len = x.dims()[dim] / size;
            (0..size).map(|j| x.narrow(dim, j * len, len).map_err(|e| ctx.candle(e))).collect()
        };
        let parts = self.round(stamp, prepared, |p| self.bytes_to_others(p), x.device())?;
        self.same_layout(c, &parts)?;
        reduce_in_rank_order(&parts, op).map_err(|e| ctx.candle(e))
    }

    fn all_to_all(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let c = Collective::AllToAll;
        let stamp = self.stamp(c);
        let size = self.size();
        let device = inputs.first().map_or(Device::Cpu, |t| t.device().clone());
        let prepared = if inputs.len() == size {
            Ok(inputs)
        } else {
            Err(self.ctx(c).invalid(format!("got {} tensors, need one per rank ({size})", inputs.len())))
        };
        self.round(stamp, prepared, |p| self.bytes_to_others(p), &device)
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        let c = Collective::Send;
        self.check_peer(c, dst, "destination")?;
        let bytes = if dst == self.rank() { 0 } else { tensor_bytes(x) };
        self.stats.record(c, bytes);
        self.transport.send(x, dst)
    }

    fn recv(&self, src: usize) -> Result<Tensor> {
        let c = Collective::Recv;
        self.check_peer(c, src, "source")?;
        self.stats.record(c, 0);
        self.transport.recv(src)
    }

    fn send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Tensor> {
        self.start_send_recv(x, dst, src)?.wait()
    }

    fn start_send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv + '_>> {
        let c = Collective::SendRecv;
        self.check_peer(c, dst, "destination")?;
        self.check_peer(c, src, "source")?;
        let bytes = if dst == self.rank() { 0 } else { tensor_bytes(x) };
        self.stats.record(c, bytes);
        self.transport.start_send_recv(x, dst, src)
    }

    fn barrier(&self) -> Result<()> {
        let c = Collective::Barrier;
        let stamp = self.stamp(c);
        self.stats.record(c, 0);
        self.transport.exchange(stamp, vec![None; self.size()], &Device::Cpu).map(|_| ())
    }

    fn split(&self, groups: &[Vec<usize>]) -> Result<Arc<dyn ProcessGroup>> {
        Ok(Arc::new(Communicator::new(self.split_transport(groups)?)))
    }

    fn duplicate(&self) -> Result<Arc<dyn ProcessGroup>> {
        let transport = self.split_transport(&[(0..self.size()).collect()])?;
        Ok(Arc::new(Communicator { transport, stats: self.stats.clone(), calls: AtomicU64::new(0) }))
    }

    fn concurrent_handles(&self) -> bool {
        self.transport.concurrent_handles()
    }

    fn abort(&self, message: &str) {
        self.transport.abort(message)
    }

    fn stats(&self) -> CommStats {
        self.stats.snapshot()
    }

    fn reset_stats(&self) {
        self.stats.reset()
    }
}

impl<T: Transport> Communicator<T> {
    /// The transport of this rank's subgroup of `groups` (the collective part of `split`).
    fn split_transport(&self, groups: &[Vec<usize>]) -> Result<T> {
        let c = Collective::Split;
        let stamp = self.stamp(c);
        let ctx = self.ctx(c);
        let (size, rank) = (self.size(), self.rank());
        let spec = groups::encode(groups);
        let located = groups::locate(groups, size, rank);
        let prepared = match &located {
            Ok(_) => Tensor::new(spec.as_slice(), &Device::Cpu).map(|t| vec![t; size]).map_err(|e| ctx.candle(e)),
            Err(detail) => Err(ctx.invalid(detail.clone())),
        };
        let parts = self.round(stamp, prepared, |p| self.bytes_to_others(p), &Device::Cpu)?;
        let (group, index) = located.map_err(|d| ctx.invalid(d))?;
        for (i, t) in parts.iter().enumerate() {
            let theirs = t.to_vec1::<i64>().map_err(|e| ctx.candle(e))?;
            if theirs != spec {
                return Err(ctx.mismatch(format!(
                    "rank {i} passed other groups than this rank's {groups:?} (encoded {theirs:?})"
                )));
            }
        }
        self.transport.split(groups, group, index)
    }
}
