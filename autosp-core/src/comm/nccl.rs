//! NCCL back end (feature `nccl`, through cudarc): one rank per GPU, in one process (a thread per GPU) or in
//! several (e.g. one per rank under `mpirun`). Built on [`Communicator`] like the other back ends, so the
//! argument checks and statistics are the same code.
//!
//! How calls map onto NCCL (all on the group's own CUDA stream: see "Streams, threads and overlap" below):
//!
//! - `all_reduce` and `reduce_scatter`: NCCL's own `ncclAllReduce` / `ncclReduceScatter` (ring or tree, 2(P-1)/P
//!   of the bytes per rank), with no header round: every rank passes the same shape and dtype, so every
//!   receiver knows the sizes. The call's header (its [`Stamp`], dtype and shape; `nccl_header.rs`) is
//!   all-gathered in the same NCCL group as the payload, so ranks in different collectives, or with different
//!   shapes, fail with `CommError::OutOfStep` / `CommError::Mismatch` once the group is done (a shape mismatch
//!   can also end in the timeout: NCCL itself cannot tell). bf16/f16 sums are widened to f32 before and
//!   rounded once after (as the rank-order reduction of the other back ends accumulates them); the sum is in
//!   NCCL's order, not rank order, so every rank gets the same bits but not the other back ends' bits. Dtypes
//!   NCCL cannot reduce (i16, the f8 kinds) take the header path below.
//! - `all_gather`: the shapes are not known to the receivers (the sizes along `dim` may differ between
//!   ranks), so the headers go first, as one `ncclAllGather` of fixed-size headers; then the payload as one
//!   `ncclAllGather` when every rank's shape is the same, else as grouped sends and receives of the announced
//!   sizes.
//! - The header path (headers, then payloads, each a grouped round of `ncclSend`/`ncclRecv` in the order of
//!   [`pairwise_schedule`], inside `ncclGroupStart`/`ncclGroupEnd`), where a receiver does not know what
//!   arrives: `all_to_all` (each rank may send each peer another shape), `send`/`recv`/`send_recv` (the
//!   receiver names only the sender), `barrier` (headers only) and `split`'s agreement. Point-to-point calls
//!   use a second communicator (an `ncclCommSplit` duplicate), so they never pair with collective rounds.
//!
//! Each call waits for its NCCL work from the host (polling an event against the timeout, below): one wait
//! for `all_reduce` and `reduce_scatter`, two for the header path and `all_gather`.
//!
//! # Bootstrapping
//!
//! NCCL needs one unique id shared by all ranks before the group exists. Create it on one rank and pass it
//! over any group you already have with [`NcclId::share`]: the MPI back end (`MpiGroup`, one process per
//! GPU) or the thread back end ([`run_ranks`](super::run_ranks), one process driving several GPUs, a thread
//! per GPU). Then every rank calls [`NcclGroup::init`] with its CUDA device, its rank, the size and the id.
//!
//! # Timeouts: what NCCL can and cannot time out
//!
//! - Transfers: NCCL kernels wait on the GPU for their peers forever. Each call here records a CUDA event
//!   after its transfers and polls it (and `ncclCommGetAsyncError`) against the group's timeout; when the
//!   time is up it aborts the communicator (`ncclCommAbort`, which ends the waiting kernels), poisons the
//!   group and returns [`CommError::Timeout`]. NCCL does not tell which peer is missing, so the error's
//!   `missing` lists every peer this rank was still exchanging with (all peers, for a collective).
//! - Not covered: `ncclCommInitRank` (in [`NcclGroup::init`]) and `ncclCommSplit` (in `split`) are
//!   blocking NCCL calls that wait for every rank with no timeout; so is connection set-up (the round in which
//!   `init` and `split` connect every pair of ranks, and, from NCCL 2.22 on unless `NCCL_RUNTIME_CONNECT=0`,
//!   a collective algorithm's first use inside `ncclGroupEnd`). A rank that dies before or during these hangs
//!   the others (NCCL's own `NCCL_*` timeouts of its network transports aside).
//! - [`PendingRecv`] steps (`start_send_recv`) complete before they return: a ring step does not overlap the
//!   compute of the thread that calls it (collectives on a [`duplicate`](super::ProcessGroup::duplicate) run
//!   beside that thread's compute: below).
//!
//! # Streams, threads and overlap
//!
//! Every transport (the group [`NcclGroup::init`] makes, each `split` and each `duplicate`) has a CUDA stream
//! of its own (`nccl_stream`, non-blocking, in the device's context) and queues all its NCCL work there, never
//! on candle's stream. candle's stream is the calling thread's: `Device::new_cuda` computes on CUDA's
//! per-thread default stream, so a communication thread's candle work (widening bf16 to f32, the zeroed
//! output, the result's conversion) runs on that thread's stream, not the main thread's. A call is ordered
//! with all of them in three steps:
//!
//! 1. On entry it makes the legacy default stream wait for the calling thread's stream. A wait queued on the
//!    legacy stream first waits for every blocking stream of the context (every thread's per-thread stream),
//!    and all their later work waits for it: the inputs, whichever thread's kernels made them, are written
//!    before the call's own candle work reads them.
//! 2. Before queuing NCCL work, the group's stream waits for the calling thread's stream (an event): NCCL
//!    reads the converted inputs and writes the zeroed outputs after candle made them. The call then waits for
//!    its NCCL work from the host, as above (the event is recorded on the group's stream).
//! 3. On return, the legacy stream waits for the calling thread's stream again, so that the result's
//!    conversion is done before any thread's later work reads it (the main thread reading what a
//!    communication thread returned).
//!
//! So the main thread's stream never holds an NCCL kernel that waits for a peer, and a group and its
//! `duplicate` used from two threads run their collectives at once: each handle holds its own lock for its
//! whole call (one call at a time per handle, as NCCL wants per communicator), and the GPU's launch lock (one
//! per device in the process, shared by every transport on it) only while NCCL work is queued
//! (`ncclGroupStart` to `ncclGroupEnd`): NCCL's thread-safety rules forbid queuing on two communicators of one
//! device from two threads at once. `ncclCommInitRank` and `ncclCommSplit`, which wait for every rank, are
//! made without it: they are set-up, made while no other thread of the rank queues NCCL work (compile makes
//! its duplicates before its threads start). `init` and `split` then connect every pair of ranks on both new
//! communicators (one grouped send and receive of 8 bytes), so that no later `ncclGroupEnd` waits for a peer
//! to connect while it holds the launch lock.
//!
//! [`concurrent_handles`](Transport::concurrent_handles) is `true` when all of these hold, `false` otherwise
//! (then compile reduces after backward and gathers inline, as before):
//!
//! - the context allocates stream-ordered (`cuMemAllocAsync`, which cudarc then uses): a plain `cuMemFree`
//!   synchronises the device, i.e. would wait for an NCCL kernel that waits for a peer;
//! - NCCL connects every collective algorithm's peers when a communicator is made: always before NCCL 2.22;
//!   from 2.22 on only with `NCCL_RUNTIME_CONNECT=0` (its default connects an algorithm on first use, inside
//!   `ncclGroupEnd`, so a first bucket's all-reduce would wait for the peers with the launch lock held while
//!   the other thread needs it; under `mpirun` pass `-x NCCL_RUNTIME_CONNECT=0`);
//! - `NCCL_LAUNCH_ORDER_IMPLICIT` is not set to a non-zero value (below).
//!
//! What else this relies on (NCCL's documentation, "Using multiple NCCL communicators concurrently", says that
//! using two communicators at once is not guaranteed to work: its kernels wait on the GPU for their peers, so
//! two of them launched in different orders on different ranks deadlock if a GPU cannot run both at once):
//!
//! - Both kernels fit on the GPU together. An NCCL kernel takes one block per channel (a few dozen of an
//!   H100's 132 SMs); compute kernels may delay an NCCL kernel's start, but they end without waiting for
//!   anyone. MPS or MIG partitions with few SMs, `NCCL_MIN_NCHANNELS`/`NCCL_MAX_NCHANNELS` or a CTA count
//!   raised to the whole GPU, or `CUDA_LAUNCH_BLOCKING=1` break this.
//! - Kernels of different communicators are not ordered by their launch on the host: NCCL's
//!   `NCCL_LAUNCH_ORDER_IMPLICIT` (NCCL 2.26 and later; off by default, as we read NCCL's notes) would order
//!   them, and the host order of two threads differs between ranks; with it set, `concurrent_handles` is
//!   `false`.
//! - The handles are separate communicators (`ncclCommSplit` with the parent's configuration: `splitShare`
//!   off; with shared resources NCCL forbids using parent and child at once).
//! - One NCCL job per GPU in the process: two jobs' groups on the same GPUs (two tests at once) share the
//!   launch locks, and one job's lazy connection inside `ncclGroupEnd` could wait for a peer that waits for
//!   the lock; run such tests one at a time (`--test-threads=1`).
//!
//! Two handles' collectives run at once, but each rank must still call each handle's collectives in the same
//! order (every group's rule). What a second thread gains is the overlap with compute; each of its calls
//! waits for everything the other threads queued before it (step 1 cannot tell which kernel made the inputs).
//!
//! # Stamps and failures
//!
//! Every header carries the message's [`Stamp`] (operation and call number): a collective round whose ranks
//! are in different collectives fails on every rank with `CommError::OutOfStep` right after the header round
//! (before any payload moves; for `all_reduce` and `reduce_scatter`, whose headers travel with the payload,
//! once the round is done), and the group is poisoned. `abort` poisons this rank's group and aborts its
//! NCCL communicators; NCCL has no way to carry a message to the other ranks, so tell them through the group
//! the NCCL group was bootstrapped over as well (e.g. `abort` on the `MpiGroup`, which notifies every
//! process); until then they stop at their timeout.
//!
//! Sending to oneself with `send` is refused (NCCL would block until a receive that cannot come); use
//! `send_recv`. Tensors may be on any device; they travel through this rank's GPU, and what is received
//! lands on the device the call names (`recv`: the group's GPU). Dtypes: those of the MPI wire format; at
//! most `nccl_header::MAX_DIMS` dimensions.
//!
//! Unverified: written against cudarc 0.19 and candle 0.11 and type-checked only; no test here has run on a
//! GPU (see README, "Building with CUDA").

use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::nccl::{result, sys};

use super::collective::{Collective, ReduceOp};
use super::communicator::Communicator;
use super::error::{CommError, ErrCtx, Result};
use super::nccl_header::{decode_header, encode_header, Announced, HEADER_WORDS};
use super::process_group::{nanos, PendingRecv, ProcessGroup};
use super::schedule::pairwise_schedule;
use super::stamp::{check_message, check_round, PairCounter, Stamp};
use super::transport::Transport;

/// A rank's handle on an NCCL group.
pub type NcclGroup = Communicator<NcclTransport>;

/// The unique id every rank of a new NCCL group must pass to [`NcclGroup::init`] (NCCL's `ncclUniqueId`,
/// 128 bytes). Create it on one rank ([`NcclId::new`]) and send it to the others, e.g. with
/// [`NcclId::share`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; 128]);

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`; it also starts NCCL's bootstrap listener on this host). Call on one
    /// rank only.
    pub fn new() -> Result<Self> {
        let id = result::get_uniqueid().map_err(|e| config(format!("ncclGetUniqueId failed: {:?}", e.0)))?;
        Ok(Self(id.internal.map(|c| c as u8)))
    }

    /// The id from its 128 bytes (as [`as_bytes`](Self::as_bytes) gave them on the creating rank).
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        Self(bytes)
    }

    /// The id's 128 bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; 128] {
        &self.0
    }

    /// Creates the id on rank `root` of `group` and hands it to every rank of `group` (one `all_gather` of
    /// 128 bytes on the CPU). A collective on `group`: every rank calls it. `group` is any back end: the MPI
    /// group for one process per GPU, a thread group for one process with a thread per GPU.
    pub fn share(group: &dyn ProcessGroup, root: usize) -> Result<Self> {
        let mine = if group.rank() == root { Some(Self::new()) } else { None };
        // The root takes part even when it failed (sending zeros), so that nobody waits for it.
        let bytes = match &mine {
            Some(Ok(id)) => id.0,
            _ => [0u8; 128],
        };
        let x = Tensor::new(&bytes[..], &Device::Cpu).map_err(|e| config(format!("building the id tensor: {e}")))?;
        let all = group.all_gather(&x, 0)?;
        if let Some(Err(e)) = mine {
            return Err(e);
        }
        let chunk = all
            .narrow(0, root * 128, 128)
            .and_then(|t| t.to_vec1::<u8>())
            .map_err(|e| config(format!("reading the id: {e}")))?;
        if chunk.iter().all(|&b| b == 0) {
            return Err(config(format!("rank {root} could not create the NCCL id; see its own error")));
        }
        let mut id = [0u8; 128];
        id.copy_from_slice(&chunk);
        Ok(Self(id))
    }
}

fn config(detail: String) -> CommError {
    CommError::Config { detail }
}

impl Communicator<NcclTransport> {
    /// This rank's handle on a new NCCL group of `size` ranks: `rank` in `0..size`, `device` this rank's
    /// GPU (`Device::new_cuda(i)`, one GPU per rank), `id` the same [`NcclId`] on every rank. Blocks until
    /// every rank has called it (`ncclCommInitRank`, no timeout: see the module doc); `timeout` bounds every
    /// later call.
    pub fn init(device: &Device, rank: usize, size: usize, id: NcclId, timeout: Duration) -> Result<NcclGroup> {
        let Device::Cuda(cuda) = device else {
            return Err(config(format!("NcclGroup::init needs a CUDA device, got {:?}", device.location())));
        };
        if rank >= size {
            return Err(config(format!("rank {rank} is outside a group of {size} ranks")));
        }
        let stream = cuda.cuda_stream();
        stream.context().bind_to_thread().map_err(|e| config(format!("binding the CUDA context: {e:?}")))?;
        let raw = sys::ncclUniqueId { internal: id.0.map(|b| b as ::core::ffi::c_char) };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is the 128 bytes NCCL produced on the root.
        unsafe { result::comm_init_rank(&mut comm, size as i32, raw, rank as i32) }
            .map_err(|e| config(format!("ncclCommInitRank (rank {rank} of {size}) failed: {:?}", e.0)))?;
        let coll = RawComm::new(comm);
        let p2p = coll.split(0, rank).map_err(|e| config(format!("duplicating the communicator: {e}")))?;
        let nccl_stream =
            stream.context().new_stream().map_err(|e| config(format!("creating the group's CUDA stream: {e:?}")))?;
        let concurrent = stream.context().has_async_alloc() && !launch_order_implicit() && connects_up_front();
        let launch = launch_lock(stream.context().ordinal());
        let transport = NcclTransport {
            coll,
            p2p,
            device: device.clone(),
            stream,
            nccl_stream,
            lock: Mutex::new(()),
            launch,
            concurrent,
            name: "nccl".to_string(),
            rank,
            members: (0..size).collect(),
            timeout_ns: AtomicU64::new(nanos(timeout)),
            splits: AtomicU64::new(0),
            failure: Mutex::new(None),
            sent: PairCounter::default(),
            received: PairCounter::default(),
        };
        transport.connect_peers().map_err(|e| config(format!("connecting rank {rank} to its peers: {e}")))?;
        Ok(Communicator::new(transport))
    }
}

/// An NCCL communicator handle; aborted once (on a timeout, or when dropped).
struct RawComm {
    comm: sys::ncclComm_t,
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls do not overlap; every use goes
// through `NcclTransport`, which holds its `lock` around all NCCL calls on its communicators (and its shared
// launch lock while it queues work), and `Drop` has `&mut self`.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

impl RawComm {
    fn new(comm: sys::ncclComm_t) -> Self {
        Self { comm, aborted: AtomicBool::new(false) }
    }

    /// `ncclCommSplit` with this rank's `color` and `key` (a collective of the whole communicator).
    fn split(&self, color: usize, key: usize) -> std::result::Result<RawComm, String> {
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `self.comm` is a live communicator; a null config means "inherit the parent's". (cudarc's
        // `result::comm_split` exists only in its CUDA 12.2-12.5 builds; the binding is in every one.)
        unsafe { sys::ncclCommSplit(self.comm, color as i32, key as i32, &mut comm, std::ptr::null_mut()) }
            .result()
            .map_err(|e| format!("ncclCommSplit failed: {:?}", e.0))?;
        if comm.is_null() {
            return Err("ncclCommSplit gave this rank no communicator".to_string());
        }
        Ok(RawComm::new(comm))
    }

    /// The first asynchronous error NCCL recorded on this communicator, if any.
    fn async_error(&self) -> Option<String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `self.comm` is live; `state` is a valid out-pointer.
        let queried = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        match (queried, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) => {
                None
            }
            (sys::ncclResult_t::ncclSuccess, e) => Some(format!("{e:?}")),
            (q, _) => Some(format!("ncclCommGetAsyncError failed: {q:?}")),
        }
    }

    /// Ends every pending operation of the communicator; it cannot be used afterwards.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the communicator is live and aborted only once (the flag above).
            let _ = unsafe { result::comm_abort(self.comm) };
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // Every call waited for its transfers, so nothing is pending: abort just frees the resources, and it
        // cannot block on a peer that is gone (ncclCommDestroy could).
        self.abort();
    }
}

/// One transfer of a grouped round: `bytes` at device address `ptr` to or from `peer`.
#[derive(Clone, Copy)]
struct Transfer {
    peer: usize,
    ptr: u64,
    bytes: usize,
}

/// One rank's view of one NCCL group.
pub struct NcclTransport {
    /// Collective rounds.
    coll: RawComm,
    /// Point-to-point transfers (a duplicate of `coll`).
    p2p: RawComm,
    /// This rank's GPU; every transfer goes through it.
    device: Device,
    /// candle's stream for `device`: with `Device::new_cuda`, CUDA's per-thread default stream (the handle
    /// names the calling thread's stream), where the call's own candle work (conversions, zeroed buffers) runs.
    stream: Arc<CudaStream>,
    /// This transport's own stream (non-blocking): all its NCCL work and header copies. See the module doc,
    /// "Streams, threads and overlap".
    nccl_stream: Arc<CudaStream>,
    /// Serialises this rank's calls on this group (held for the whole call).
    lock: Mutex<()>,
    /// Held while NCCL work is queued on any communicator of this GPU (one per device in the process:
    /// [`launch_lock`]): NCCL does not allow two threads to queue on two communicators of one device at once.
    launch: Arc<Mutex<()>>,
    /// What [`Transport::concurrent_handles`] answers (stream-ordered allocation, connections made up front,
    /// no implicit launch order).
    concurrent: bool,
    name: String,
    rank: usize,
    /// Rank in the first group of each rank of this group (for names).
    members: Vec<usize>,
    timeout_ns: AtomicU64,
    splits: AtomicU64,
    /// Why the group is unusable, once it is.
    failure: Mutex<Option<String>>,
    /// Numbers of the point-to-point messages sent to / received from each rank.
    sent: PairCounter,
    received: PairCounter,
}

impl fmt::Debug for NcclTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclTransport")
            .field("group", &self.name)
            .field("rank", &self.rank)
            .field("world_ranks", &self.members)
            .field("device", &self.device.location())
            .field("timeout", &self.timeout())
            .finish()
    }
}

/// The device address of `t`'s first element; `t` must be contiguous and on the group's GPU.
fn device_address(t: &Tensor, stream: &CudaStream) -> std::result::Result<u64, String> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(format!("a tensor on {:?} reached the NCCL transfer", t.device().location()));
    };
    fn base<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
        // The event guard is dropped at once: all work is on `stream`, which orders it.
        s.device_ptr(stream).0
    }
    let ptr = match &cuda.slice {
        CudaStorageSlice::U8(s) => base(s, stream),
        CudaStorageSlice::U32(s) => base(s, stream),
        CudaStorageSlice::I16(s) => base(s, stream),
        CudaStorageSlice::I32(s) => base(s, stream),
        CudaStorageSlice::I64(s) => base(s, stream),
        CudaStorageSlice::BF16(s) => base(s, stream),
        CudaStorageSlice::F16(s) => base(s, stream),
        CudaStorageSlice::F32(s) => base(s, stream),
        CudaStorageSlice::F64(s) => base(s, stream),
        CudaStorageSlice::F8E4M3(s) => base(s, stream),
        CudaStorageSlice::F6E2M3(s)
        | CudaStorageSlice::F6E3M2(s)
        | CudaStorageSlice::F4(s)
        | CudaStorageSlice::F8E8M0(s) => base(s, stream),
    };
    Ok(ptr + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

fn payload_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// NCCL's element type for `dtype`, where NCCL can reduce it.
fn nccl_dtype(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as T;
    Some(match dtype {
        DType::U8 => T::ncclUint8,
        DType::U32 => T::ncclUint32,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        _ => return None,
    })
}

/// The dtype a native reduction of `dtype` runs in (bf16/f16 sums in f32, as the rank-order reduction) and
/// NCCL's type for it; `None` where NCCL cannot reduce it.
fn reduction_dtype(dtype: DType, op: ReduceOp) -> Option<(DType, sys::ncclDataType_t)> {
    let wide = match (op, dtype) {
        (ReduceOp::Sum, DType::BF16 | DType::F16) => DType::F32,
        (_, d) => d,
    };
    nccl_dtype(wide).map(|t| (wide, t))
}

/// Whether `NCCL_LAUNCH_ORDER_IMPLICIT` asks NCCL to order the kernels of different communicators by their
/// launch on the host (then two handles used from two threads can deadlock: see the module doc).
fn launch_order_implicit() -> bool {
    std::env::var("NCCL_LAUNCH_ORDER_IMPLICIT").is_ok_and(|v| !matches!(v.trim(), "" | "0"))
}

/// Whether NCCL connects a communicator's peers for every collective algorithm when the communicator is made
/// (`ncclCommInitRank`, `ncclCommSplit`): always before NCCL 2.22; from 2.22 on only with
/// `NCCL_RUNTIME_CONNECT=0` (by default it connects on an algorithm's first use, inside `ncclGroupEnd`, waiting
/// for the peers with the launch lock held).
fn connects_up_front() -> bool {
    let lazy = result::get_nccl_version().map_or(true, |v| v >= 22200);
    !lazy || std::env::var("NCCL_RUNTIME_CONNECT").is_ok_and(|v| v.trim() == "0")
}

/// The launch lock of CUDA device `ordinal`: one per GPU in this process, shared by every NCCL transport on it.
fn launch_lock(ordinal: usize) -> Arc<Mutex<()>> {
    static LOCKS: Mutex<Vec<Arc<Mutex<()>>>> = Mutex::new(Vec::new());
    let mut locks = LOCKS.lock().unwrap_or_else(|e| e.into_inner());
    while locks.len() <= ordinal {
        locks.push(Arc::default());
    }
    locks[ordinal].clone()
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

impl NcclTransport {
    fn ctx(&self, collective: Collective) -> ErrCtx<'_> {
        ErrCtx { collective, group: &self.name, rank: self.rank }
    }

    fn nccl_lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_healthy(&self, collective: Collective) -> Result<()> {
        match &*self.failure.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(cause) => Err(self.ctx(collective).poisoned(cause.clone())),
            None => Ok(()),
        }
    }

    /// Marks the group unusable and ends NCCL's pending work on both communicators. The calling thread's
    /// stream then waits for the group's stream (whose aborted kernels end), so that the buffers the failed
    /// call drops are freed after NCCL stopped using them.
    fn fail(&self, cause: String) {
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(cause);
        self.coll.abort();
        self.p2p.abort();
        let _ = self.stream.join(&self.nccl_stream);
    }

    /// Makes the legacy default stream wait for the calling thread's stream: a wait queued there waits for
    /// every blocking stream of the context (each thread's per-thread stream) and all their later work waits
    /// for it, so work of other threads is ordered with this call's (see the module doc).
    fn fence(&self, collective: Collective) -> Result<()> {
        let legacy = self.stream.context().default_stream();
        legacy.join(&self.stream).map_err(|e| {
            self.ctx(collective).nccl(format!("ordering the CUDA streams of this process's threads: {e:?}"))
        })
    }

    /// `call` between two [`fence`](Self::fence)s: its inputs are written before its candle work reads them
    /// (whichever thread wrote them), and its result before any thread's later work reads it.
    fn fenced<R>(&self, collective: Collective, call: impl FnOnce() -> Result<R>) -> Result<R> {
        self.fence(collective)?;
        let result = call();
        let fenced = self.fence(collective);
        let result = result?;
        fenced.map(|_| result)
    }

    /// Connects this rank to every peer on both communicators (a grouped send and receive of 8 bytes with each,
    /// waited for), so that no later call makes NCCL's lazy point-to-point connection inside `ncclGroupEnd`,
    /// where it would wait for the peer with the launch lock held. A collective of the new group: `init` and
    /// `split` call it on every rank.
    fn connect_peers(&self) -> Result<()> {
        let (size, c) = (self.members.len(), Collective::Split);
        if size < 2 {
            return Ok(());
        }
        let err =
            |e: candle_core::cuda_backend::cudarc::driver::DriverError| self.fatal(c, format!("8-byte buffers: {e:?}"));
        let ns = &self.nccl_stream;
        let send = ns.alloc_zeros::<u64>(1).map_err(err)?;
        let recv = ns.alloc_zeros::<u64>(size).map_err(err)?;
        let (sp, rp) = (send.device_ptr(ns).0, recv.device_ptr(ns).0);
        let peers = (0..size).filter(|&i| i != self.rank);
        let sends: Vec<Transfer> = peers.clone().map(|peer| Transfer { peer, ptr: sp, bytes: 8 }).collect();
        let recvs: Vec<Transfer> = peers.map(|peer| Transfer { peer, ptr: rp + 8 * peer as u64, bytes: 8 }).collect();
        let _nccl = self.nccl_lock();
        self.grouped(c, &self.coll, &sends, &recvs)?;
        self.grouped(c, &self.p2p, &sends, &recvs)
    }

    /// Queues NCCL work on the group's stream as one NCCL group: the stream first waits for the calling
    /// thread's stream (the buffers candle made), then `issue` runs between `ncclGroupStart` and `ncclGroupEnd`
    /// with the launch lock held (the group is ended even when `issue` failed). A failure poisons the group.
    /// Call with the lock held.
    fn launch(
        &self,
        collective: Collective,
        issue: impl FnOnce(sys::cudaStream_t) -> std::result::Result<(), String>,
    ) -> Result<()> {
        let ordered = self.nccl_stream.join(&self.stream);
        ordered.map_err(|e| self.fatal(collective, format!("ordering the NCCL stream after candle's: {e:?}")))?;
        let _launch = self.launch.lock().unwrap_or_else(|e| e.into_inner());
        self.stream.context().bind_to_thread().map_err(|e| self.fatal(collective, format!("{e:?}")))?;
        let stream = self.nccl_stream.cu_stream() as sys::cudaStream_t;
        let mut failed = result::group_start().err().map(|e| format!("ncclGroupStart: {:?}", e.0));
        if failed.is_none() {
            if let Err(detail) = issue(stream) {
                failed = Some(detail);
            }
            if let Err(e) = result::group_end() {
                failed.get_or_insert(format!("ncclGroupEnd: {:?}", e.0));
            }
        }
        match failed {
            Some(detail) => Err(self.fatal(collective, detail)),
            None => Ok(()),
        }
    }

    /// An NCCL error that leaves the ranks out of step: poisons the group.
    fn fatal(&self, collective: Collective, detail: String) -> CommError {
        self.fail(format!("rank {} failed in {collective}: {detail}", self.rank));
        self.ctx(collective).nccl(detail)
    }

    /// Runs `sends` and `recvs` on `comm` as one NCCL group, then waits for them against the timeout.
    /// Call with the lock held.
    fn grouped(&self, collective: Collective, comm: &RawComm, sends: &[Transfer], recvs: &[Transfer]) -> Result<()> {
        self.launch(collective, |stream| {
            let mut failed = None;
            for t in sends.iter().filter(|t| t.bytes > 0) {
                // SAFETY: `ptr` addresses `bytes` bytes of a live device buffer that the caller keeps until
                // `wait_done` returned; the communicator is live (checked healthy, lock held).
                let r = unsafe {
                    result::send(
                        t.ptr as *const c_void,
                        t.bytes,
                        sys::ncclDataType_t::ncclUint8,
                        t.peer as i32,
                        comm.comm,
                        stream,
                    )
                };
                if let Err(e) = r {
                    failed.get_or_insert(format!("ncclSend to rank {}: {:?}", t.peer, e.0));
                }
            }
            for t in recvs.iter().filter(|t| t.bytes > 0) {
                // SAFETY: as above; the receive buffer is owned by the caller and written only by NCCL.
                let r = unsafe {
                    result::recv(
                        t.ptr as *mut c_void,
                        t.bytes,
                        sys::ncclDataType_t::ncclUint8,
                        t.peer as i32,
                        comm.comm,
                        stream,
                    )
                };
                if let Err(e) = r {
                    failed.get_or_insert(format!("ncclRecv from rank {}: {:?}", t.peer, e.0));
                }
            }
            failed.map_or(Ok(()), Err)
        })?;
        let mut peers: Vec<usize> = sends.iter().chain(recvs).map(|t| t.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        self.wait_done(collective, comm, peers)
    }

    /// Waits until the work queued on the group's stream so far is done, at most the timeout; on timeout or an
    /// asynchronous NCCL error aborts the communicators and poisons the group.
    fn wait_done(&self, collective: Collective, comm: &RawComm, peers: Vec<usize>) -> Result<()> {
        let event = self.nccl_stream.record_event(None);
        let event = event.map_err(|e| self.fatal(collective, format!("recording an event: {e:?}")))?;
        let (timeout, start) = (self.timeout(), Instant::now());
        let mut idle_rounds = 0u64;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.fatal(collective, format!("querying the event: {e:?}"))),
            }
            if let Some(e) = comm.async_error() {
                return Err(self.fatal(collective, format!("asynchronous error: {e}")));
            }
            let waited = start.elapsed();
            if waited >= timeout {
                self.fail(format!(
                    "rank {} timed out in {collective} waiting for NCCL transfers with rank(s) {peers:?}",
                    self.rank
                ));
                return Err(self.ctx(collective).timeout(self.members.len(), peers, waited, timeout));
            }
            idle_rounds += 1;
            if idle_rounds < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros((idle_rounds - 63).min(1000)));
            }
        }
    }

    /// `x` on the group's GPU, contiguous, with its header stamped `stamp`.
    fn outgoing(&self, stamp: Stamp, x: &Tensor) -> Result<(Tensor, [u64; HEADER_WORDS])> {
        let ctx = self.ctx(stamp.collective);
        let header = encode_header(Some((x.dtype(), x.dims())), stamp).map_err(|d| ctx.invalid(d))?;
        let t = x.to_device(&self.device).and_then(|t| t.contiguous()).map_err(|e| ctx.candle(e))?;
        Ok((t, header))
    }

    /// One header round on `comm`: sends `headers[j]` to each `to` peer, returns the header from each
    /// `from` peer (in `from`'s order). Call with the lock held.
    fn header_round(
        &self,
        collective: Collective,
        comm: &RawComm,
        to: &[(usize, [u64; HEADER_WORDS])],
        from: &[usize],
    ) -> Result<Vec<Vec<u64>>> {
        if to.is_empty() && from.is_empty() {
            return Ok(vec![]);
        }
        let err = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
            self.fatal(collective, format!("header buffers: {e:?}"))
        };
        let flat: Vec<u64> = to.iter().flat_map(|(_, h)| h.iter().copied()).collect();
        let ns = &self.nccl_stream;
        let send_buf = ns.clone_htod(&flat).map_err(err)?;
        let recv_buf = ns.alloc_zeros::<u64>(from.len().max(1) * HEADER_WORDS).map_err(err)?;
        let (send_ptr, recv_ptr) = (send_buf.device_ptr(ns).0, recv_buf.device_ptr(ns).0);
        let hb = HEADER_WORDS * 8;
        let sends: Vec<Transfer> = to
            .iter()
            .enumerate()
            .map(|(i, (peer, _))| Transfer { peer: *peer, ptr: send_ptr + (i * hb) as u64, bytes: hb })
            .collect();
        let recvs: Vec<Transfer> = from
            .iter()
            .enumerate()
            .map(|(i, &peer)| Transfer { peer, ptr: recv_ptr + (i * hb) as u64, bytes: hb })
            .collect();
        self.grouped(collective, comm, &sends, &recvs)?;
        // A device-to-host copy: the host waits for the group's stream (counted as a host read).
        crate::host_read::count();
        let got = ns.clone_dtoh(&recv_buf).map_err(err)?;
        Ok(got.chunks(HEADER_WORDS).take(from.len()).map(|c| c.to_vec()).collect())
    }

    /// The stamp `header` carries, and a zeroed tensor on the group's GPU for the payload it announces
    /// (`None`: an empty marker).
    fn receive_buffer(&self, collective: Collective, from: usize, header: &[u64]) -> Result<(Stamp, Option<Tensor>)> {
        let (stamp, decoded) =
            decode_header(header).map_err(|d| self.fatal(collective, format!("bad header from rank {from}: {d}")))?;
        let buffer = decoded
            .map(|(dtype, dims)| Tensor::zeros(dims, dtype, &self.device).map_err(|e| self.ctx(collective).candle(e)))
            .transpose()?;
        Ok((stamp, buffer))
    }

    /// The payload transfers of a round; each tensor stays alive in the caller until `grouped` returned.
    fn payload_round(
        &self,
        collective: Collective,
        comm: &RawComm,
        sends: &[(usize, &Tensor)],
        recvs: &[(usize, &Tensor)],
    ) -> Result<()> {
        let transfer = |&(peer, t): &(usize, &Tensor)| -> Result<Transfer> {
            let ptr = device_address(t, &self.nccl_stream).map_err(|d| self.fatal(collective, d))?;
            Ok(Transfer { peer, ptr, bytes: payload_bytes(t) })
        };
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let s: Vec<Transfer> = sends.iter().map(transfer).collect::<Result<_>>()?;
        let r: Vec<Transfer> = recvs.iter().map(transfer).collect::<Result<_>>()?;
        self.grouped(collective, comm, &s, &r)
    }

    /// One round of NCCL's own collectives on the collective communicator: this rank's `header` all-gathered
    /// (every rank's, in rank order) in one NCCL group with what `issue` queues (given the communicator and
    /// the group's stream), then waited for. Checks every rank's stamp against `stamp` (`OutOfStep`, poisoning the
    /// group) and returns what every rank announced. Call with the lock held.
    fn native_round(
        &self,
        stamp: Stamp,
        header: [u64; HEADER_WORDS],
        issue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> std::result::Result<(), String>,
    ) -> Result<Vec<Announced>> {
        let collective = stamp.collective;
        let size = self.members.len();
        let err = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
            self.fatal(collective, format!("header buffers: {e:?}"))
        };
        let ns = &self.nccl_stream;
        let send_buf = ns.clone_htod(&header[..]).map_err(err)?;
        let recv_buf = ns.alloc_zeros::<u64>(size * HEADER_WORDS).map_err(err)?;
        let (send_ptr, recv_ptr) = (send_buf.device_ptr(ns).0, recv_buf.device_ptr(ns).0);
        let comm = self.coll.comm;
        self.launch(collective, |stream| {
            // SAFETY: both header buffers live until `wait_done` returned (they are dropped at the end of this
            // function); the communicator is live (checked healthy by the caller, lock held).
            let gathered = unsafe {
                result::all_gather(
                    send_ptr as *const c_void,
                    recv_ptr as *mut c_void,
                    HEADER_WORDS,
                    sys::ncclDataType_t::ncclUint64,
                    comm,
                    stream,
                )
            };
            match gathered {
                Err(e) => Err(format!("ncclAllGather of the headers: {:?}", e.0)),
                Ok(_) => issue(comm, stream),
            }
        })?;
        let peers: Vec<usize> = (0..size).filter(|&i| i != self.rank).collect();
        self.wait_done(collective, &self.coll, peers)?;
        // The group's stream is done: this copy only moves the headers (counted as a host read).
        crate::host_read::count();
        let words = ns.clone_dtoh(&recv_buf).map_err(err)?;
        let mut stamps = Vec::with_capacity(size);
        let mut announced = Vec::with_capacity(size);
        for (i, h) in words.chunks(HEADER_WORDS).enumerate() {
            let (got, what) =
                decode_header(h).map_err(|d| self.fatal(collective, format!("bad header from rank {i}: {d}")))?;
            if i != self.rank {
                stamps.push((i, got));
            }
            announced.push(what);
        }
        if let Err(e) = check_round(self.ctx(collective), stamp, &stamps) {
            self.fail(e.to_string());
            return Err(e);
        }
        Ok(announced)
    }

    /// Checks that every rank announced this rank's dtype and shape (a reduction's contract); a rank that did
    /// not poisons the group (the NCCL collective paired buffers of different sizes).
    fn check_same(&self, collective: Collective, announced: &[Announced], x: &Tensor) -> Result<()> {
        let mine = Some((x.dtype(), x.dims().to_vec()));
        for (i, a) in announced.iter().enumerate() {
            if *a != mine {
                let detail = format!(
                    "rank {i} passed {a:?} where rank {} passed {:?} {:?}: every rank must pass the same dtype and shape",
                    self.rank,
                    x.dtype(),
                    x.dims()
                );
                self.fail(detail.clone());
                return Err(self.ctx(collective).mismatch(detail));
            }
        }
        Ok(())
    }

    /// `x` on this rank's GPU in `dtype`, contiguous, and a zeroed output of `shape` there.
    fn on_gpu(&self, collective: Collective, x: &Tensor, dtype: DType, out: &[usize]) -> Result<(Tensor, Tensor)> {
        let ctx = self.ctx(collective);
        let input = x.to_device(&self.device).and_then(|t| t.to_dtype(dtype)).and_then(|t| t.contiguous());
        let input = input.map_err(|e| ctx.candle(e))?;
        let output = Tensor::zeros(out, dtype, &self.device).map_err(|e| ctx.candle(e))?;
        Ok((input, output))
    }

    /// `ncclAllReduce` of `x` in `wide` (NCCL type `datatype`), its header gathered alongside.
    fn native_all_reduce(
        &self,
        stamp: Stamp,
        x: &Tensor,
        op: ReduceOp,
        wide: DType,
        datatype: sys::ncclDataType_t,
    ) -> Result<Tensor> {
        let c = stamp.collective;
        self.check_healthy(c)?;
        let ctx = self.ctx(c);
        let header = encode_header(Some((x.dtype(), x.dims())), stamp).map_err(|d| ctx.invalid(d))?;
        let (input, output) = self.on_gpu(c, x, wide, x.dims())?;
        let _nccl = self.nccl_lock();
        let sp = device_address(&input, &self.nccl_stream).map_err(|d| self.fatal(c, d))?;
        let rp = device_address(&output, &self.nccl_stream).map_err(|d| self.fatal(c, d))?;
        let n = input.elem_count();
        let announced = self.native_round(stamp, header, |comm, stream| {
            // SAFETY: `input` and `output` are live device buffers of `n` elements of `datatype` on this
            // rank's GPU, kept until `native_round` waited for the group.
            unsafe {
                result::all_reduce(sp as *const c_void, rp as *mut c_void, n, datatype, nccl_op(op), comm, stream)
            }
            .map(|_| ())
            .map_err(|e| format!("ncclAllReduce: {:?}", e.0))
        })?;
        self.check_same(c, &announced, x)?;
        output.to_dtype(x.dtype()).and_then(|t| t.to_device(x.device())).map_err(|e| ctx.candle(e))
    }

    /// `ncclReduceScatter` of `x` along `dim` (which divides by the group size) in `wide`: the P blocks along
    /// `dim` are stacked first (NCCL's blocks are contiguous), block j reduced onto rank j.
    fn native_reduce_scatter(
        &self,
        stamp: Stamp,
        x: &Tensor,
        dim: usize,
        op: ReduceOp,
        wide: DType,
        datatype: sys::ncclDataType_t,
    ) -> Result<Tensor> {
        let c = stamp.collective;
        self.check_healthy(c)?;
        let ctx = self.ctx(c);
        let size = self.members.len();
        let header = encode_header(Some((x.dtype(), x.dims())), stamp).map_err(|d| ctx.invalid(d))?;
        let len = x.dims()[dim] / size;
        let mut block = x.dims().to_vec();
        block[dim] = len;
        let (whole, output) = self.on_gpu(c, x, wide, &block)?;
        let blocks: Vec<Tensor> = (0..size)
            .map(|j| whole.narrow(dim, j * len, len))
            .collect::<candle_core::Result<_>>()
            .map_err(|e| ctx.candle(e))?;
        let input = Tensor::stack(&blocks, 0).map_err(|e| ctx.candle(e))?;
        drop(whole);
        let _nccl = self.nccl_lock();
        let sp = device_address(&input, &self.nccl_stream).map_err(|d| self.fatal(c, d))?;
        let rp = device_address(&output, &self.nccl_stream).map_err(|d| self.fatal(c, d))?;
        let count = output.elem_count();
        let announced = self.native_round(stamp, header, |comm, stream| {
            // SAFETY: `input` holds `size * count` and `output` `count` elements of `datatype`, live on this
            // rank's GPU until `native_round` waited for the group.
            unsafe {
                result::reduce_scatter(
                    sp as *const c_void,
                    rp as *mut c_void,
                    count,
                    datatype,
                    nccl_op(op),
                    comm,
                    stream,
                )
            }
            .map(|_| ())
            .map_err(|e| format!("ncclReduceScatter: {:?}", e.0))
        })?;
        self.check_same(c, &announced, x)?;
        output.to_dtype(x.dtype()).and_then(|t| t.to_device(x.device())).map_err(|e| ctx.candle(e))
    }

    /// All-gather along `dim`: the headers as one `ncclAllGather` (the receivers do not know the other ranks'
    /// sizes along `dim`), then the payload as one `ncclAllGather` of bytes when every shape is the same, else
    /// grouped sends and receives of the announced shapes.
    fn native_all_gather(&self, stamp: Stamp, x: &Tensor, dim: usize) -> Result<Tensor> {
        let c = stamp.collective;
        self.check_healthy(c)?;
        let ctx = self.ctx(c);
        let size = self.members.len();
        let header = encode_header(Some((x.dtype(), x.dims())), stamp).map_err(|d| ctx.invalid(d))?;
        let input = x.to_device(&self.device).and_then(|t| t.contiguous()).map_err(|e| ctx.candle(e))?;
        let _nccl = self.nccl_lock();
        let announced = self.native_round(stamp, header, |_, _| Ok(()))?;
        let mut shapes = Vec::with_capacity(size);
        for (i, a) in announced.into_iter().enumerate() {
            let fits =
                |dims: &[usize]| dims.len() == x.rank() && (0..x.rank()).all(|d| d == dim || dims[d] == x.dims()[d]);
            match a {
                Some((dtype, dims)) if dtype == x.dtype() && fits(&dims) => shapes.push(dims),
                other => {
                    // Every rank saw the same headers and stops here alike: the group stays usable.
                    return Err(ctx.mismatch(format!(
                        "rank {i} sent {other:?} where rank {} sent {:?} {:?} (only dim {dim} may differ)",
                        self.rank,
                        x.dtype(),
                        x.dims()
                    )));
                }
            }
        }
        let parts: Vec<Tensor> = if shapes.iter().all(|s| s == x.dims()) {
            let mut all = vec![size];
            all.extend_from_slice(x.dims());
            let output = Tensor::zeros(all, x.dtype(), &self.device).map_err(|e| ctx.candle(e))?;
            let sp = device_address(&input, &self.nccl_stream).map_err(|d| self.fatal(c, d))?;
            let rp = device_address(&output, &self.nccl_stream).map_err(|d| self.fatal(c, d))?;
            let bytes = payload_bytes(&input);
            let comm = self.coll.comm;
            self.launch(c, |stream| {
                // SAFETY: `input` holds `bytes` bytes and `output` `size * bytes`, live on this rank's GPU until
                // `wait_done` returned; the communicator is live (healthy, lock held).
                unsafe {
                    result::all_gather(
                        sp as *const c_void,
                        rp as *mut c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        comm,
                        stream,
                    )
                }
                .map(|_| ())
                .map_err(|e| format!("ncclAllGather: {:?}", e.0))
            })?;
            let peers: Vec<usize> = (0..size).filter(|&i| i != self.rank).collect();
            self.wait_done(c, &self.coll, peers)?;
            (0..size).map(|i| output.get(i)).collect::<candle_core::Result<_>>().map_err(|e| ctx.candle(e))?
        } else {
            let received: Vec<Option<Tensor>> = shapes
                .iter()
                .enumerate()
                .map(|(i, dims)| {
                    (i != self.rank)
                        .then(|| Tensor::zeros(dims.as_slice(), x.dtype(), &self.device).map_err(|e| ctx.candle(e)))
                        .transpose()
                })
                .collect::<Result<_>>()?;
            let sends: Vec<(usize, &Tensor)> = (0..size).filter(|&i| i != self.rank).map(|i| (i, &input)).collect();
            let recvs: Vec<(usize, &Tensor)> =
                received.iter().enumerate().filter_map(|(i, t)| t.as_ref().map(|t| (i, t))).collect();
            self.payload_round(c, &self.coll, &sends, &recvs)?;
            received.into_iter().map(|t| t.unwrap_or_else(|| input.clone())).collect()
        };
        Tensor::cat(&parts, dim).and_then(|t| t.to_device(x.device())).map_err(|e| ctx.candle(e))
    }

    /// The personalised exchange of [`Transport::exchange`]: a header round in [`pairwise_schedule`] order,
    /// the stamps checked, then the payloads of the announced shapes.
    fn exchange_round(
        &self,
        stamp: Stamp,
        mut outgoing: Vec<Option<Tensor>>,
        device: &Device,
    ) -> Result<Vec<Option<Tensor>>> {
        let collective = stamp.collective;
        self.check_healthy(collective)?;
        let (size, rank) = (self.members.len(), self.rank);
        let schedule = pairwise_schedule(rank, size);
        // Prepare every payload before the first NCCL call, so that a bad argument fails before any transfer: a
        // part that cannot travel becomes an empty marker (the peers see it), and this rank's error is returned
        // after the round.
        let mut payloads: Vec<Option<Tensor>> = vec![None; size];
        let mut own_error = None;
        let mut to = Vec::with_capacity(size);
        for step in &schedule {
            let j = step.send_to;
            let mut header = encode_header(None, stamp).expect("an empty marker always encodes");
            if let Some(x) = &outgoing[j] {
                match self.outgoing(stamp, x) {
                    Ok((t, h)) => {
                        payloads[j] = Some(t);
                        header = h;
                    }
                    Err(e) => own_error = own_error.or(Some(e)),
                }
            }
            to.push((j, header));
        }
        let from: Vec<usize> = schedule.iter().map(|s| s.recv_from).collect();
        let _nccl = self.nccl_lock();
        let headers = self.header_round(collective, &self.coll, &to, &from)?;
        let mut received: Vec<Option<Tensor>> = vec![None; size];
        let mut stamps = Vec::with_capacity(from.len());
        for (&i, h) in from.iter().zip(&headers) {
            let (got, buffer) = self.receive_buffer(collective, i, h)?;
            stamps.push((i, got));
            received[i] = buffer;
        }
        // Ranks in different collectives stop here, before any payload moves: every rank got every header.
        stamps.sort_unstable_by_key(|&(i, _)| i);
        if let Err(e) = check_round(self.ctx(collective), stamp, &stamps) {
            self.fail(e.to_string());
            return Err(e);
        }
        let sends: Vec<(usize, &Tensor)> =
            schedule.iter().filter_map(|s| payloads[s.send_to].as_ref().map(|t| (s.send_to, t))).collect();
        let recvs: Vec<(usize, &Tensor)> = from.iter().filter_map(|&i| received[i].as_ref().map(|t| (i, t))).collect();
        self.payload_round(collective, &self.coll, &sends, &recvs)?;
        drop(payloads);
        if let Some(e) = own_error {
            return Err(e);
        }
        let mut incoming: Vec<Option<Tensor>> = Vec::with_capacity(size);
        for (i, t) in received.into_iter().enumerate() {
            incoming.push(match (i == rank, t) {
                (true, _) => outgoing[rank].take(),
                (false, Some(t)) => Some(t.to_device(device).map_err(|e| self.ctx(collective).candle(e))?),
                (false, None) => None,
            });
        }
        Ok(incoming)
    }

    /// Sends `x` to `dst` (if given) and receives from `src` (if given) on the point-to-point communicator.
    fn p2p(
        &self,
        collective: Collective,
        send: Option<(&Tensor, usize)>,
        src: Option<usize>,
    ) -> Result<Option<Tensor>> {
        self.check_healthy(collective)?;
        // A tensor that cannot travel still sends an empty marker, so the receiver fails at once.
        let stamp = send.map(|(_, dst)| Stamp::new(collective, self.sent.next(dst)));
        let prepared = send.zip(stamp).map(|((x, dst), stamp)| self.outgoing(stamp, x).map(|(t, h)| (dst, t, h)));
        let (out, own_error) = match prepared {
            Some(Err(e)) => (None, Some((e, send.map(|(_, dst)| dst)))),
            other => (other.transpose()?, None),
        };
        let _nccl = self.nccl_lock();
        let mut to: Vec<(usize, [u64; HEADER_WORDS])> = out.iter().map(|(dst, _, h)| (*dst, *h)).collect();
        if let (Some((_, Some(dst))), Some(stamp)) = (&own_error, stamp) {
            to.push((*dst, encode_header(None, stamp).expect("an empty marker always encodes")));
        }
        let from: Vec<usize> = src.into_iter().collect();
        let headers = self.header_round(collective, &self.p2p, &to, &from)?;
        let incoming = match (src, headers.first()) {
            (Some(s), Some(h)) => {
                let (got, buffer) = self.receive_buffer(collective, s, h)?;
                if let Err(e) = check_message(self.ctx(collective), s, got, self.received.next(s)) {
                    self.fail(e.to_string());
                    return Err(e);
                }
                buffer
            }
            _ => None,
        };
        let sends: Vec<(usize, &Tensor)> = out.iter().map(|(dst, t, _)| (*dst, t)).collect();
        let recvs: Vec<(usize, &Tensor)> = match (src, &incoming) {
            (Some(s), Some(t)) => vec![(s, t)],
            _ => vec![],
        };
        self.payload_round(collective, &self.p2p, &sends, &recvs)?;
        if let Some((e, _)) = own_error {
            return Err(e);
        }
        if let (Some(s), None) = (src, &incoming) {
            return Err(self
                .ctx(collective)
                .mismatch(format!("rank {s} sent an empty marker where a tensor was expected")));
        }
        Ok(incoming)
    }
}

/// A ring step that already completed (`start_send_recv` waits for its transfers; see the module doc).
struct Ready(Tensor);

impl PendingRecv for Ready {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        Ok(self.0)
    }
}

impl Transport for NcclTransport {
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

    /// Every transport queues its NCCL work on a stream of its own and fences the threads' streams around
    /// each call; `true` when the context allocates stream-ordered, NCCL connects when a communicator is made
    /// and does not order launches across communicators (see the module doc).
    fn concurrent_handles(&self) -> bool {
        self.concurrent
    }

    fn exchange(&self, stamp: Stamp, outgoing: Vec<Option<Tensor>>, device: &Device) -> Result<Vec<Option<Tensor>>> {
        self.fenced(stamp.collective, || self.exchange_round(stamp, outgoing, device))
    }

    fn all_reduce(&self, stamp: Stamp, x: &Tensor, op: ReduceOp) -> Option<Result<Tensor>> {
        let (wide, datatype) = reduction_dtype(x.dtype(), op)?;
        Some(self.fenced(stamp.collective, || self.native_all_reduce(stamp, x, op, wide, datatype)))
    }

    fn reduce_scatter(&self, stamp: Stamp, x: &Tensor, dim: usize, op: ReduceOp) -> Option<Result<Tensor>> {
        let (wide, datatype) = reduction_dtype(x.dtype(), op)?;
        Some(self.fenced(stamp.collective, || self.native_reduce_scatter(stamp, x, dim, op, wide, datatype)))
    }

    fn all_gather(&self, stamp: Stamp, x: &Tensor, dim: usize) -> Option<Result<Tensor>> {
        Some(self.fenced(stamp.collective, || self.native_all_gather(stamp, x, dim)))
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        if dst == self.rank {
            return Err(self
                .ctx(Collective::Send)
                .invalid("sending to oneself with `send` would block forever over NCCL; use `send_recv`"));
        }
        self.fenced(Collective::Send, || self.p2p(Collective::Send, Some((x, dst)), None)).map(|_| ())
    }

    fn recv(&self, src: usize) -> Result<Tensor> {
        self.fenced(Collective::Recv, || self.p2p(Collective::Recv, None, Some(src)))?
            .ok_or_else(|| self.ctx(Collective::Recv).nccl("nothing received".to_string()))
    }

    fn start_send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv + '_>> {
        let c = Collective::SendRecv;
        let t = self
            .fenced(c, || self.p2p(c, Some((x, dst)), Some(src)))?
            .ok_or_else(|| self.ctx(c).nccl("nothing received".to_string()))?;
        Ok(Box::new(Ready(t)))
    }

    fn abort(&self, message: &str) {
        self.fail(format!("rank {} aborted: {message}", self.rank));
    }

    fn split(&self, groups: &[Vec<usize>], group: usize, index: usize) -> Result<Self> {
        self.check_healthy(Collective::Split)?;
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let members: Vec<usize> = groups[group].iter().map(|&r| self.members[r]).collect();
        let (coll, p2p) = {
            let _nccl = self.nccl_lock();
            // Not under the launch lock: ncclCommSplit blocks until every rank called it (set-up, made while no
            // other thread of this rank queues NCCL work; see the module doc).
            let bind = self.stream.context().bind_to_thread();
            bind.map_err(|e| self.ctx(Collective::Split).nccl(format!("{e:?}")))?;
            let coll = self.coll.split(group, index).map_err(|d| self.fatal(Collective::Split, d))?;
            let p2p = self.p2p.split(group, index).map_err(|d| self.fatal(Collective::Split, d))?;
            (coll, p2p)
        };
        // Its own stream: a `duplicate` (a one-group split) runs on another thread beside this handle.
        let nccl_stream = self.stream.context().new_stream();
        let nccl_stream = nccl_stream.map_err(|e| self.ctx(Collective::Split).nccl(format!("a CUDA stream: {e:?}")))?;
        let transport = NcclTransport {
            coll,
            p2p,
            device: self.device.clone(),
            stream: self.stream.clone(),
            nccl_stream,
            lock: Mutex::new(()),
            launch: self.launch.clone(),
            concurrent: self.concurrent,
            name: format!("{}/split{n}:{:?}", self.name, members),
            rank: index,
            members,
            timeout_ns: AtomicU64::new(nanos(self.timeout())),
            splits: AtomicU64::new(0),
            failure: Mutex::new(None),
            sent: PairCounter::default(),
            received: PairCounter::default(),
        };
        transport.connect_peers()?;
        Ok(transport)
    }
}
