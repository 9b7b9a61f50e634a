//! MPI back end (feature `mpi`, the `mpi` crate over OpenMPI): one process per rank, started by `mpirun`.
//!
//! MPI's own collectives cannot time out, so every collective here is built from non-blocking point-to-point
//! messages (`MPI_Isend`, `MPI_Improbe` + `MPI_Mrecv`) polled against the group's deadline: a rank that never
//! arrives gives the others `CommError::Timeout` naming it, never a hang. A tensor travels in the [`wire`]
//! format: a header message (dtype and shape), so receivers need not know shapes in advance, then an elements
//! message received straight into the tensor's storage (no byte buffer, no decoding copy); one message is
//! limited to 2 GiB. Collective rounds use tags 1..=32000 (cycling, each round
//! completes before the next starts); point-to-point messages use tag 0, so the two never mix. Every message's
//! header carries its [`Stamp`] (operation and call number): a round whose ranks are in different collectives
//! fails on every rank with `CommError::OutOfStep` once all its messages arrived.
//!
//! # A failing rank tells the others
//!
//! `abort(message)` (called by a rank that gives up on an error) sends `message` to every other process of
//! the job on a private duplicate of `MPI_COMM_WORLD`, with synchronous sends (`MPI_Issend`), and waits until
//! every process has taken it: every wait of every call here also polls for such notices, so a process that
//! is in a collective (or enters one) fails within milliseconds with `CommError::PeerFailed` carrying the
//! message, returns its own error, and finalises. Why not just `MPI_Abort`: the other processes would be
//! killed without saying why they stopped. Why not just return: OpenMPI's `MPI_Finalize` waits for every
//! process (a PMIx fence), so the failed process would hang in it while the others wait in their collective
//! for the whole timeout. The notice is the fix; `MPI_Abort` stays the fallback: a process that has not taken
//! the notice within [`ABORT_GRACE`] (busy outside any collective, stuck in `MPI_Comm_split`, or gone) is
//! ended by `MPI_Abort` of the whole job, after the failed rank printed its error, so the job never outlives
//! a failure by more than that.
//!
//! Use: `let world = MpiGroup::init(timeout)?;` once per process, keep it (and any subgroup) alive while
//! communicating, and drop them all before `main` returns: MPI is finalised when the last handle goes, and
//! `mpirun` reports a process that exits without finalising. A rank whose timed-out send never completed
//! leaks that message's buffer (MPI may still read it); the group is poisoned afterwards anyway.
//! `split` uses `MPI_Comm_split`, which has no timeout; it runs right after the ranks agreed on the groups.
//! Sending to oneself with `send` completes only for small messages (MPI's eager limit); use `send_recv`.
//!
//! # Two threads, two handles
//!
//! MPI runs at thread level `Serialized` (any thread may call, one call at a time): one process-wide lock
//! serialises the calls. A collective holds it for one polling round (probe, receive what arrived, test the
//! sends, take notices) and releases it while it backs off between rounds and while it decodes, so a second
//! handle's collective on another thread (a [`duplicate`](super::ProcessGroup::duplicate): its own
//! `MPI_Comm_split` communicator, so the two never match each other's messages) progresses meanwhile:
//! [`concurrent_handles`](super::ProcessGroup::concurrent_handles) is true, and a gradient reduction or a
//! gather prefetch overlaps the step as on thread ranks. Messages of both move only while one of the two
//! threads polls (MPI has no progress thread at this level). `split` and `duplicate` hold the lock for the
//! whole `MPI_Comm_split`: make them before another thread of the process starts communicating.

use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor, TensorId};
use mpi::environment::Universe;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator as _, Destination as _, Equivalence as _, Source as _};
use mpi::Threading;

use super::collective::Collective;
use super::communicator::Communicator;
use super::error::{CommError, ErrCtx, Result};
use super::process_group::{nanos, PendingRecv};
use super::stamp::{check_message, check_round, PairCounter, Stamp};
use super::transport::Transport;
use super::wire;

/// A process's handle on an MPI group.
pub type MpiGroup = Communicator<MpiTransport>;

impl Communicator<MpiTransport> {
    /// Initialises MPI (thread level `Serialized` or better) and returns this process's handle on the world:
    /// every process of the `mpirun` job, ranked as MPI ranks them. Call once per process.
    pub fn init(timeout: Duration) -> Result<MpiGroup> {
        let config = |detail: String| CommError::Config { detail };
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized).ok_or_else(|| {
            config(
                "MPI is already initialised in this process: call MpiGroup::init once and split the \
                     world it returns"
                    .to_string(),
            )
        })?;
        if !matches!(threading, Threading::Serialized | Threading::Multiple) {
            return Err(config(format!(
                "the MPI library offers only {threading:?} threading; autosp needs Serialized (calls from \
                 any thread, one at a time): use an MPI built with thread support"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let notices = Comm(world.duplicate());
        let runtime =
            Runtime { notices, rank, size, failed: Mutex::new(None), _universe: universe, lock: Mutex::new(()) };
        Ok(Communicator::new(MpiTransport {
            comm: ManuallyDrop::new(Comm(world)),
            runtime: Arc::new(runtime),
            name: "world".to_string(),
            rank,
            members: (0..size).collect(),
            timeout_ns: AtomicU64::new(nanos(timeout)),
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            failure: Mutex::new(None),
            sent: PairCounter::default(),
            received: PairCounter::default(),
        }))
    }
}

/// Tag of point-to-point messages; collective rounds use `1 + seq % COLLECTIVE_TAGS`.
const P2P_TAG: i32 = 0;
const COLLECTIVE_TAGS: u64 = 32_000;
/// Tag of failure notices on `Runtime::notices`.
const NOTICE_TAG: i32 = 1;
/// The longest failure message sent to the other processes (longer ones are cut).
const NOTICE_BYTES: usize = 8192;
/// How long a failing rank waits for every other process to take its failure notice before it ends the job
/// with `MPI_Abort`.
pub const ABORT_GRACE: Duration = Duration::from_secs(5);
/// How long a failing rank keeps taking other ranks' notices after its own were all taken (ranks that fail
/// at the same moment send each other notices; each must be taken for its sender to finish).
const NOTICE_LINGER: Duration = Duration::from_millis(250);

/// Keeps MPI initialised while any handle lives, serialises all MPI calls of this process (`lock`, taken for
/// one call or one polling round at a time), and holds what
/// is known about failed ranks (for every group of the process).
struct Runtime {
    /// Failure notices travel here (a duplicate of the world), apart from every group's messages. Dropped
    /// (freed) before `_universe`.
    notices: Comm,
    /// This process's rank and the number of processes in `MPI_COMM_WORLD`.
    rank: usize,
    size: usize,
    /// The first failure of the job this process learned of: (world rank, message); this rank's own included.
    failed: Mutex<Option<(usize, String)>>,
    /// Finalises MPI when dropped.
    _universe: Universe,
    lock: Mutex<()>,
}

impl Runtime {
    fn failed(&self) -> MutexGuard<'_, Option<(usize, String)>> {
        self.failed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes every failure notice that has arrived, remembers the first, and returns the job's failure if
    /// one is known. Call with the MPI lock held.
    fn take_notices(&self) -> Option<(usize, String)> {
        while let Some((message, status)) = self.notices.0.any_process().immediate_matched_probe_with_tag(NOTICE_TAG) {
            let len = status.count(u8::equivalent_datatype()).max(0) as usize;
            let mut buf = vec![0u8; len];
            message.matched_receive_into(&mut buf[..]);
            let text = String::from_utf8_lossy(&buf).into_owned();
            self.failed().get_or_insert((status.source_rank() as usize, text));
        }
        self.failed().clone()
    }
}

/// An MPI communicator that may be moved between threads.
struct Comm(SimpleCommunicator);

// SAFETY: MPI was initialised with at least `Threading::Serialized`, so any thread may call MPI as long as no
// two calls overlap; every use of the communicator happens while holding `Runtime::lock`.
unsafe impl Send for Comm {}
// SAFETY: as above; shared references only reach MPI under `Runtime::lock`.
unsafe impl Sync for Comm {}

/// One process's view of one MPI group.
pub struct MpiTransport {
    /// Freed (`MPI_Comm_free`) under the MPI lock when the transport drops, before `runtime`, which may
    /// finalise MPI.
    comm: ManuallyDrop<Comm>,
    runtime: Arc<Runtime>,
    name: String,
    rank: usize,
    /// World rank of each rank of this group (for names).
    members: Vec<usize>,
    timeout_ns: AtomicU64,
    seq: AtomicU64,
    splits: AtomicU64,
    /// Why the group is unusable, once it is.
    failure: Mutex<Option<String>>,
    /// Numbers of the point-to-point messages sent to / received from each rank.
    sent: PairCounter,
    received: PairCounter,
}

impl fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiTransport")
            .field("group", &self.name)
            .field("rank", &self.rank)
            .field("world_ranks", &self.members)
            .field("timeout", &self.timeout())
            .finish()
    }
}

/// A non-blocking send in flight. If dropped unfinished (the peer never received), the request and its
/// buffer are leaked rather than freed, because MPI may still read the buffer.
struct PendingSend {
    dst: usize,
    request: Option<Request<'static, [u8], StaticScope>>,
    buffer: Option<Arc<Vec<u8>>>,
}

impl PendingSend {
    /// A standard send (`MPI_Isend`), or with `synchronous` one that completes only once `dst` has matched
    /// it (`MPI_Issend`).
    fn start(comm: &SimpleCommunicator, buffer: Arc<Vec<u8>>, dst: usize, tag: i32, synchronous: bool) -> Self {
        // SAFETY: `data` points into the heap allocation of `buffer`, which is never mutated and lives at least
        // as long as the request: `self.buffer` is released only after `test` saw the request complete, and is
        // leaked together with the request otherwise (see `Drop`).
        let data: &'static [u8] = unsafe { &*(buffer.as_slice() as *const [u8]) };
        let process = comm.process_at_rank(dst as i32);
        let request = if synchronous {
            process.immediate_synchronous_send_with_tag(StaticScope, data, tag)
        } else {
            process.immediate_send_with_tag(StaticScope, data, tag)
        };
        Self { dst, request: Some(request), buffer: Some(buffer) }
    }

    /// True once the send has completed.
    fn test(&mut self) -> bool {
        let Some(request) = self.request.take() else {
            return true;
        };
        match request.test() {
            Ok(_) => {
                self.buffer = None;
                true
            }
            Err(request) => {
                self.request = Some(request);
                false
            }
        }
    }
}

impl Drop for PendingSend {
    fn drop(&mut self) {
        if let Some(request) = self.request.take() {
            std::mem::forget(request);
            std::mem::forget(self.buffer.take());
        }
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        // Another handle of this process may be communicating on another thread: freeing the communicator is
        // an MPI call like any other.
        let _mpi = self.runtime.lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: `comm` is dropped exactly once, here, and never used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.comm) };
    }
}

impl MpiTransport {
    fn ctx(&self, collective: Collective) -> ErrCtx<'_> {
        ErrCtx { collective, group: &self.name, rank: self.rank }
    }

    fn mpi_lock(&self) -> MutexGuard<'_, ()> {
        self.runtime.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fails if a rank of the job failed (`PeerFailed`) or this group is unusable (`Poisoned`).
    fn check_healthy(&self, collective: Collective) -> Result<()> {
        if let Some((peer, message)) = self.runtime.failed().clone() {
            return Err(self.ctx(collective).peer_failed(peer, message));
        }
        match &*self.failure.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(cause) => Err(self.ctx(collective).poisoned(cause.clone())),
            None => Ok(()),
        }
    }

    fn poison(&self, cause: String) {
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(cause);
    }

    /// The messages that carry `t` (`None`: an empty marker) stamped with `stamp`: its header, then (for a
    /// tensor) its elements; see [`wire`].
    fn messages(&self, stamp: Stamp, t: Option<&Tensor>) -> Result<Vec<Arc<Vec<u8>>>> {
        let collective = stamp.collective;
        let wire_err = |e: wire::WireError| self.ctx(collective).mpi(e.to_string());
        let mut out = vec![Arc::new(wire::header_of(t, stamp).map_err(wire_err)?)];
        if let Some(t) = t {
            let bytes = t.elem_count() * t.dtype().size_in_bytes();
            if bytes > i32::MAX as usize {
                return Err(self
                    .ctx(collective)
                    .mpi(format!("a message of {bytes} bytes exceeds MPI's 2 GiB count limit; split the tensor")));
            }
            out.push(Arc::new(wire::elements(t).map_err(wire_err)?));
        }
        Ok(out)
    }

    /// Starts sending `messages` to `dst` with `tag`, in order. Call with the MPI lock held.
    fn start_sends(&self, messages: &[Arc<Vec<u8>>], dst: usize, tag: i32) -> Vec<PendingSend> {
        messages.iter().map(|m| PendingSend::start(&self.comm.0, m.clone(), dst, tag, false)).collect()
    }

    /// Polls `sends` and the receives from `sources` (with `tag`) until all are done, the timeout passed, or
    /// a failure notice came (then `PeerFailed`). Returns the received stamps and tensors by source. A tensor
    /// comes as a header and then its elements, which are received straight into the tensor's storage
    /// ([`wire::Inbox`]). Takes the MPI lock for each polling round only, never while it waits between rounds,
    /// parses a header or allocates, so that another thread's collective on another handle (a
    /// [`duplicate`](super::ProcessGroup::duplicate)) progresses meanwhile.
    fn complete(
        &self,
        collective: Collective,
        mut sends: Vec<PendingSend>,
        sources: Vec<usize>,
        tag: i32,
        device: &Device,
    ) -> Result<Vec<(usize, Stamp, Option<Tensor>)>> {
        let ctx = self.ctx(collective);
        let timeout = self.timeout();
        let start = Instant::now();
        let mut received = Vec::with_capacity(sources.len());
        let mut pending: Vec<(usize, Inbound)> = sources.into_iter().map(|src| (src, Inbound::Header)).collect();
        let mut idle_rounds = 0u32;
        let malformed = |src: usize, detail: String| {
            let detail = format!("bad message from rank {src}: {detail}");
            self.poison(format!("rank {} got a {detail}", self.rank));
            ctx.mpi(detail)
        };
        loop {
            let mut headers = Vec::new();
            let mut filled = Vec::new();
            let (sends_done, failure) = {
                let _mpi = self.mpi_lock();
                let mut k = 0;
                while k < pending.len() {
                    let src = pending[k].0;
                    let probe = self.comm.0.process_at_rank(src as i32).immediate_matched_probe_with_tag(tag);
                    let Some((message, status)) = probe else {
                        k += 1;
                        continue;
                    };
                    let len = status.count(u8::equivalent_datatype()).max(0) as usize;
                    match pending.swap_remove(k) {
                        (_, Inbound::Header) => {
                            let mut buf = vec![0u8; len];
                            message.matched_receive_into(&mut buf[..]);
                            headers.push((src, buf));
                        }
                        (_, Inbound::Elements { stamp, mut inbox }) => {
                            if len != inbox.byte_len() {
                                let mut sink = vec![0u8; len];
                                message.matched_receive_into(&mut sink[..]);
                                let want = inbox.byte_len();
                                return Err(malformed(src, format!("{len} element bytes where {want} were announced")));
                            }
                            message.matched_receive_into(inbox.bytes_mut());
                            filled.push((src, stamp, inbox));
                        }
                    }
                }
                let before = sends.len();
                sends.retain_mut(|s| !s.test());
                (before - sends.len(), self.runtime.take_notices())
            };
            let progressed = sends_done > 0 || !headers.is_empty() || !filled.is_empty();
            for (src, buf) in headers {
                let header = wire::parse_header(&buf).map_err(|e| malformed(src, e.to_string()))?;
                match header.tensor {
                    None => received.push((src, header.stamp, None)),
                    Some((dtype, dims)) => {
                        let inbox = wire::Inbox::new(dtype, &dims).map_err(|e| malformed(src, e.to_string()))?;
                        pending.push((src, Inbound::Elements { stamp: header.stamp, inbox }));
                    }
                }
            }
            for (src, stamp, inbox) in filled {
                let tensor = inbox.into_tensor(device).map_err(|e| {
                    self.poison(format!("rank {} could not place a received tensor: {e}", self.rank));
                    ctx.mpi(e.to_string())
                })?;
                received.push((src, stamp, Some(tensor)));
            }
            if pending.is_empty() && sends.is_empty() {
                return Ok(received);
            }
            if let Some((peer, message)) = failure {
                self.poison(format!("rank {peer} of the job failed: {message}"));
                return Err(ctx.peer_failed(peer, message));
            }
            let waited = start.elapsed();
            if waited >= timeout {
                let mut missing: Vec<usize> = if pending.is_empty() {
                    sends.iter().map(|s| s.dst).collect()
                } else {
                    pending.iter().map(|&(src, _)| src).collect()
                };
                missing.sort_unstable();
                missing.dedup();
                self.poison(format!("rank {} timed out in {collective} waiting for rank(s) {missing:?}", self.rank));
                return Err(ctx.timeout(self.members.len(), missing, waited, timeout));
            }
            if progressed {
                idle_rounds = 0;
            } else {
                // Spin briefly for latency, then back off so that oversubscribed ranks share the cores.
                idle_rounds += 1;
                if idle_rounds < 64 {
                    std::thread::yield_now();
                } else {
                    let micros = (idle_rounds as u64 - 63).min(1000);
                    std::thread::sleep(Duration::from_micros(micros));
                }
            }
        }
    }

    /// Sends `x` to `dst` (if given) and receives from `src` (if given), on the point-to-point tag.
    fn p2p(
        &self,
        collective: Collective,
        send: Option<(Vec<PendingSend>, Device)>,
        src: Option<usize>,
    ) -> Result<Option<Tensor>> {
        self.check_healthy(collective)?;
        let (sends, device) = send.unwrap_or((vec![], Device::Cpu));
        let received = self.complete(collective, sends, src.into_iter().collect(), P2P_TAG, &device)?;
        if let Some(&(from, stamp, _)) = received.first() {
            check_message(self.ctx(collective), from, stamp, self.received.next(from))?;
        }
        match received.into_iter().next() {
            None => Ok(None),
            Some((_, _, Some(t))) => Ok(Some(t)),
            Some((from, _, None)) => {
                Err(self.ctx(collective).mpi(format!("rank {from} sent an empty marker where a tensor was expected")))
            }
        }
    }

    /// Serialises `x` and starts sending it to `dst` on the point-to-point tag.
    fn start_send(&self, collective: Collective, x: &Tensor, dst: usize) -> Result<(Vec<PendingSend>, Device)> {
        self.check_healthy(collective)?;
        let messages = self.messages(Stamp::new(collective, self.sent.next(dst)), Some(x))?;
        let _mpi = self.mpi_lock();
        Ok((self.start_sends(&messages, dst, P2P_TAG), x.device().clone()))
    }
}

/// The messages that carry one tensor (its header, then its elements), shared by every destination.
type Messages = Arc<[Arc<Vec<u8>>]>;

/// Where the receive from one source stands.
enum Inbound {
    /// Waiting for the header message.
    Header,
    /// The header said a tensor follows: its elements message goes straight into `inbox`.
    Elements { stamp: Stamp, inbox: wire::Inbox },
}

/// The rest of a ring step on the MPI back end: the send in flight and the receive still to do.
struct MpiRecv<'a> {
    transport: &'a MpiTransport,
    send: (Vec<PendingSend>, Device),
    src: usize,
}

impl PendingRecv for MpiRecv<'_> {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        let MpiRecv { transport, send, src } = *self;
        transport
            .p2p(Collective::SendRecv, Some(send), Some(src))?
            .ok_or_else(|| transport.ctx(Collective::SendRecv).mpi("nothing received".to_string()))
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout_ns.store(nanos(timeout), Ordering::Relaxed)
    }

    fn exchange(
        &self,
        stamp: Stamp,
        mut outgoing: Vec<Option<Tensor>>,
        device: &Device,
    ) -> Result<Vec<Option<Tensor>>> {
        let collective = stamp.collective;
        self.check_healthy(collective)?;
        let (size, rank) = (self.members.len(), self.rank);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let tag = 1 + (seq % COLLECTIVE_TAGS) as i32;
        // Serialise each distinct tensor once (all_gather sends the same tensor to everyone).
        let mut encoded: HashMap<Option<TensorId>, Messages> = HashMap::new();
        let mut payloads = Vec::with_capacity(size);
        for (j, t) in outgoing.iter().enumerate() {
            if j == rank {
                continue;
            }
            let key = t.as_ref().map(|t| t.id());
            let messages = match encoded.get(&key) {
                Some(m) => m.clone(),
                None => {
                    let m: Arc<[_]> = self.messages(stamp, t.as_ref())?.into();
                    encoded.insert(key, m.clone());
                    m
                }
            };
            payloads.push((j, messages));
        }
        let mut incoming: Vec<Option<Tensor>> = vec![None; size];
        incoming[rank] = outgoing[rank].take();
        let sends = {
            let _mpi = self.mpi_lock();
            payloads.into_iter().flat_map(|(j, m)| self.start_sends(&m, j, tag)).collect()
        };
        let sources = (0..size).filter(|&i| i != rank).collect();
        let mut stamps = Vec::with_capacity(size);
        for (src, s, t) in self.complete(collective, sends, sources, tag, device)? {
            stamps.push((src, s));
            incoming[src] = t;
        }
        stamps.sort_unstable_by_key(|&(src, _)| src);
        if let Err(e) = check_round(self.ctx(collective), stamp, &stamps) {
            self.poison(e.to_string());
            return Err(e);
        }
        Ok(incoming)
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        let send = self.start_send(Collective::Send, x, dst)?;
        self.p2p(Collective::Send, Some(send), None).map(|_| ())
    }

    fn recv(&self, src: usize) -> Result<Tensor> {
        self.p2p(Collective::Recv, None, Some(src))?
            .ok_or_else(|| self.ctx(Collective::Recv).mpi("nothing received".to_string()))
    }

    fn start_send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv + '_>> {
        let send = self.start_send(Collective::SendRecv, x, dst)?;
        Ok(Box::new(MpiRecv { transport: self, send, src }))
    }

    /// Yes: a call holds the process's MPI lock for one polling round at a time, so two threads' calls on two
    /// handles (each on its own communicator) interleave their rounds and both progress.
    fn concurrent_handles(&self) -> bool {
        true
    }

    fn abort(&self, message: &str) {
        let rt = &self.runtime;
        let mut sends: Vec<PendingSend> = {
            let _mpi = self.mpi_lock();
            // A known failure (a peer's, whose notice this rank's error may come from, or this rank's own
            // earlier abort, from this thread or another) has been announced already.
            if rt.take_notices().is_some() {
                return;
            }
            *rt.failed() = Some((rt.rank, message.to_string()));
            let mut cut = message.len().min(NOTICE_BYTES);
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            let buf = Arc::new(message.as_bytes()[..cut].to_vec());
            (0..rt.size)
                .filter(|&r| r != rt.rank)
                .map(|r| PendingSend::start(&rt.notices.0, buf.clone(), r, NOTICE_TAG, true))
                .collect()
        };
        let start = Instant::now();
        let mut all_taken: Option<Instant> = None;
        loop {
            {
                let _mpi = self.mpi_lock();
                rt.take_notices();
                sends.retain_mut(|s| !s.test());
            }
            let now = Instant::now();
            if sends.is_empty() {
                let since = *all_taken.get_or_insert(now);
                if now - since >= NOTICE_LINGER {
                    return;
                }
            } else if now - start >= ABORT_GRACE {
                let missing: Vec<usize> = sends.iter().map(|s| s.dst).collect();
                eprintln!(
                    "autosp: rank {} failed: {message}\nautosp: rank(s) {missing:?} did not take the failure notice \
                     within {ABORT_GRACE:?} (busy outside any collective, blocked, or gone); ending the whole job \
                     with MPI_Abort",
                    rt.rank
                );
                let _mpi = self.mpi_lock();
                rt.notices.0.abort(1);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn split(&self, groups: &[Vec<usize>], group: usize, index: usize) -> Result<Self> {
        self.check_healthy(Collective::Split)?;
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let members: Vec<usize> = groups[group].iter().map(|&r| self.members[r]).collect();
        let comm = {
            let _mpi = self.mpi_lock();
            self.comm.0.split_by_color_with_key(Color::with_value(group as i32), index as i32)
        }
        .ok_or_else(|| {
            self.ctx(Collective::Split).mpi("MPI_Comm_split returned no communicator for this rank".to_string())
        })?;
        Ok(MpiTransport {
            comm: ManuallyDrop::new(Comm(comm)),
            runtime: self.runtime.clone(),
            name: format!("{}/split{n}:{:?}", self.name, members),
            rank: index,
            members,
            timeout_ns: AtomicU64::new(nanos(self.timeout())),
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            failure: Mutex::new(None),
            sent: PairCounter::default(),
            received: PairCounter::default(),
        })
    }
}
