//! The gradient of each use of a parameter sharded at `Gradients` or `Parameters` ([`crate::shard`]),
//! reduce-scattered during backward into this rank's slice: by a [`GradScatter`] installed on the thread that
//! runs backward, either on a communication thread over a second handle of the world
//! ([`ProcessGroup::duplicate`]) while backward goes on, or inline, in the dtype the gradients travel in
//! ([`wire_dtype`](crate::shard::wire_dtype): f32, or bf16 for half the bytes). Without one installed,
//! [`ShardedParam`](crate::ops::shard_param::ShardedParam) reduce-scatters inline in f32 as before.
//!
//! On the thread, uses are reduce-scattered in the order backward posts them (the same on every rank, so the
//! collectives match), each carrying the [`BackwardMark`] of its posting, and each parameter's slices are
//! summed in that order (the order the tape sums a leaf's gradients in, so the bits equal the inline path's).
//! Whole gradients in flight are held to [`GradScatter::start`]'s byte limit: backward waits before posting
//! one that would pass it while others are in flight, so at most the limit, or one gradient larger than it,
//! is held beside what backward holds.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use candle_core::{DType, Tensor};

use crate::comm::ProcessGroup;
use crate::handoff::HandOff;
use crate::progress::{current_mark, with_mark, BackwardMark};
use crate::shard::{ParamShard, ShardLayout};
use crate::{Error, Param, ParamId, Result};

/// One use's whole gradient posted to the thread: its parameter, layout, bytes, where backward stood, and the
/// work that made it ([`HandOff`]).
type Job = (ParamId, ShardLayout, Tensor, usize, Option<BackwardMark>, HandOff);

/// The bytes of whole gradients posted and not reduced yet, and whether the thread has ended.
#[derive(Default)]
struct InFlight {
    bytes: usize,
    ended: bool,
}

type Shared = Arc<(Mutex<InFlight>, Condvar)>;

/// A parameter's slice of one use, reduced by the thread, with the work that made it.
type Done = (ParamId, Tensor, HandOff);

/// What backward's thread holds while a [`GradScatter`] is installed.
struct Active {
    /// The group reduced over inline (no thread), and the wire dtype.
    group: Arc<dyn ProcessGroup>,
    wire: DType,
    /// The thread's inbox, its outbox and the bytes in flight, when overlapped.
    jobs: Option<(mpsc::Sender<Job>, mpsc::Receiver<Done>, Shared)>,
    limit: usize,
    /// The slices taken from the thread so far, each parameter's uses summed in posting order.
    sums: HashMap<ParamId, Tensor>,
}

impl Active {
    /// Adds a slice the thread reduced to the sums, in this (the step's) thread's own memory: the thread's
    /// copy goes back to the thread's allocator arena at once, where its next buffers reuse it (glibc keeps
    /// a thread's freed memory for that thread: slices kept there until the step's end would leave the
    /// thread's temporaries unreusable beside them, resident memory no tensor holds).
    fn absorb(sums: &mut HashMap<ParamId, Tensor>, (id, slice, made): Done) -> Result<()> {
        made.wait()?;
        let sum = match sums.remove(&id) {
            Some(before) => before.add(&slice)?,
            None => slice.copy()?,
        };
        sums.insert(id, sum);
        Ok(())
    }
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// A per-use gradient reduce-scatter installed on the thread that started it (see the module doc); its
/// results come from [`finish`](Self::finish). Dropping it unfinished uninstalls it and waits for its thread.
pub struct GradScatter {
    worker: Option<JoinHandle<Result<()>>>,
}

impl GradScatter {
    /// Installs the reduce-scatter on this thread: over `group` (the world the parameters are sharded over,
    /// or a [`duplicate`](ProcessGroup::duplicate) of it when `overlap`: then on a thread named
    /// `grad-scatter`), f32 gradients sent in `wire`, at most `limit_bytes` of whole gradients in flight
    /// (or one larger gradient). Fails if one is installed on this thread already or the thread cannot start.
    pub fn start(group: Arc<dyn ProcessGroup>, wire: DType, overlap: bool, limit_bytes: usize) -> Result<Self> {
        if ACTIVE.with(|a| a.borrow().is_some()) {
            return Err(Error::InvalidArgument {
                op: "grad_scatter",
                msg: "a gradient reduce-scatter is installed on this thread already: finish it first".into(),
            });
        }
        let (jobs, worker) = if overlap {
            let shared: Shared = Arc::default();
            let (post, inbox) = mpsc::channel::<Job>();
            let (reduced, outbox) = mpsc::channel::<Done>();
            let (thread_group, thread_shared) = (group.clone(), shared.clone());
            let worker = std::thread::Builder::new()
                .name("grad-scatter".into())
                .spawn(move || reduce_posted(inbox, reduced, thread_group.as_ref(), wire, &thread_shared))
                .map_err(|e| Error::InvalidArgument {
                    op: "grad_scatter",
                    msg: format!(
                        "could not start the gradient reduce-scatter thread: {e}; set GradReduction::overlap to false"
                    ),
                })?;
            (Some((post, outbox, shared)), Some(worker))
        } else {
            (None, None)
        };
        let active = Active { group, wire, jobs, limit: limit_bytes.max(1), sums: HashMap::new() };
        ACTIVE.with(|a| *a.borrow_mut() = Some(active));
        Ok(Self { worker })
    }

    /// Uninstalls it and waits for every posted reduce-scatter: each posted parameter's slice `[chunk]`, its
    /// uses summed, in the reduction dtype (empty when inline: the slices went to the tape). The thread's
    /// error, if it stopped on one.
    pub fn finish(mut self) -> Result<HashMap<ParamId, Tensor>> {
        let Some(active) = ACTIVE.with(|a| a.borrow_mut().take()) else { return Ok(HashMap::new()) };
        let Some(worker) = self.worker.take() else { return Ok(active.sums) };
        let Active { jobs, mut sums, .. } = active;
        let mut absorbed = Ok(());
        if let Some((post, outbox, _)) = jobs {
            // Closing the inbox ends the thread once it reduced what was posted; take what it hands over.
            drop(post);
            for done in outbox.iter() {
                if absorbed.is_ok() {
                    absorbed = Active::absorb(&mut sums, done);
                }
            }
        }
        worker.join().map_err(|panic| {
            let what = panic.downcast_ref::<String>().cloned().or(panic.downcast_ref::<&str>().map(|s| s.to_string()));
            Error::Internal(format!("the gradient reduce-scatter thread panicked: {}", what.unwrap_or_default()))
        })??;
        absorbed?;
        Ok(sums)
    }
}

impl Drop for GradScatter {
    fn drop(&mut self) {
        // Closing the inbox and the outbox ends the thread once it reduced what was posted.
        ACTIVE.with(|a| a.borrow_mut().take());
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The thread: reduce-scatters each posted gradient over `group` and hands each slice over in posting order.
/// Marks itself ended (waking a waiting poster) however it stops.
fn reduce_posted(
    inbox: mpsc::Receiver<Job>,
    reduced: mpsc::Sender<Done>,
    group: &dyn ProcessGroup,
    wire: DType,
    shared: &Shared,
) -> Result<()> {
    struct Ended<'a>(&'a Shared);
    impl Drop for Ended<'_> {
        fn drop(&mut self) {
            self.0 .0.lock().unwrap_or_else(|e| e.into_inner()).ended = true;
            self.0 .1.notify_all();
        }
    }
    let _ended = Ended(shared);
    for (id, layout, g, bytes, mark, made) in inbox {
        made.wait()?;
        let slice = with_mark(mark, || layout.reduce_scatter_as(group, &g, wire))?;
        let done = HandOff::record(slice.device())?;
        drop(g);
        {
            let (lock, wake) = &**shared;
            lock.lock().unwrap_or_else(|e| e.into_inner()).bytes -= bytes;
            wake.notify_all();
        }
        if reduced.send((id, slice, done)).is_err() {
            // The step stopped taking slices (dropped unfinished): nothing more is wanted.
            return Ok(());
        }
    }
    Ok(())
}

/// One use's whole gradient `g` of `param` (sharded as `shard`) through the [`GradScatter`] installed on this
/// thread: `Some(slice)` reduced now (inline, or f32 over the shard's group when none is installed), or
/// `None` when posted to the thread (its slice comes from [`GradScatter::finish`]). Collective.
pub(crate) fn reduce_or_post(param: &Param, shard: &ParamShard, g: &Tensor) -> Result<Option<Tensor>> {
    let posted = ACTIVE.with(|a| -> Result<Option<Option<Tensor>>> {
        let mut guard = a.borrow_mut();
        let Some(active) = guard.as_mut() else { return Ok(None) };
        let Some((jobs, outbox, shared)) = &active.jobs else {
            return Ok(Some(Some(shard.layout.reduce_scatter_as(active.group.as_ref(), g, active.wire)?)));
        };
        // The slices reduced since the last post, into this thread's memory.
        for done in outbox.try_iter() {
            Active::absorb(&mut active.sums, done)?;
        }
        let bytes = crate::memory::storage_bytes(g);
        {
            let (lock, wake) = &**shared;
            let mut state = lock.lock().unwrap_or_else(|e| e.into_inner());
            while !state.ended && state.bytes > 0 && state.bytes + bytes > active.limit {
                state = wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            state.bytes += bytes;
        }
        // A closed inbox means the thread stopped on an error: backward stops here, and `finish` reports it.
        let made = HandOff::record(g.device())?;
        jobs.send((param.id(), shard.layout, g.clone(), bytes, current_mark(), made))
            .map_err(|_| Error::Internal("the gradient reduce-scatter thread stopped before backward ended".into()))?;
        Ok(Some(None))
    })?;
    match posted {
        Some(result) => Ok(result),
        None => Ok(Some(shard.reduce_scatter(g)?)),
    }
}
