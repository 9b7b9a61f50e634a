//! The weights of the next block gathered while the current block computes, at `Parameters`
//! ([`crate::shard`]): a communication thread gathers blocks' weights on a second handle of the world
//! ([`ProcessGroup::duplicate`]), one block at a time as the thread that runs the step asks, and hands each
//! over to it; [`ShardedParam`](crate::ops::shard_param::ShardedParam) asks the prefetch first ([`take`]).
//! The step asks for a block at the hand-off of the one before it, in the order it uses them: in the forward
//! every weight of blocks `0, 1, .., n-1`; in backward's replay, last to first, the weights of each block that
//! a recorded node read in the forward (the tape reports them as each region ends, [`region_ended`]), which
//! are the ones the replay gathers again (LoRA's first block: not the frozen projections of an input that
//! takes no gradient), and no block none was read of. Backward's first block is asked for when the forward's
//! last region ends. So at most two blocks' weights are whole at once (the one the step uses, the one gathered
//! for it next), the gathers are those of gathering at each use, and every rank makes the same collectives in
//! the same order. Each gather carries the [`ForwardMark`] and [`BackwardMark`] of the ask that started it,
//! so a recording process group shows a block gathered while the block before it computed in the forward,
//! and before the backward of the block after it ended. A weight outside the plan, or asked for out of the
//! plan's order, is gathered inline as without a prefetch.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};

use crate::comm::ProcessGroup;
use crate::handoff::{settle, HandOff};
use crate::progress::{current_forward_mark, current_mark, with_forward_mark, with_mark, BackwardMark, ForwardMark};
use crate::shard::{note_gathered, ShardLevel};
use crate::{Error, Param, ParamId, Result};

/// One block's gathered weights, by parameter: whole, the parameter's shape.
type Block = HashMap<ParamId, Tensor>;

/// What the step asks the thread to gather: a block, the weights of it wanted (`None`: all), and where the
/// step's forward and backward stood when it asked.
struct Ask {
    block: usize,
    only: Option<HashSet<ParamId>>,
    marks: (Option<ForwardMark>, Option<BackwardMark>),
}

/// Where the step is in the plan: what it asks for at the next hand-off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Forward: the next hand-off asks for the block after the one handed over.
    Forward,
    /// The forward's last block was handed over: backward's first block is asked for once its region ends.
    ForwardEnding,
    /// Backward's replay: the next hand-off asks for the next block below with weights backward reads.
    Backward,
}

/// The step thread's side of a running prefetch.
struct Active {
    /// The block of each planned parameter.
    block_of: HashMap<ParamId, usize>,
    /// Each block's weights that a recorded node read in the forward: what backward's replay gathers.
    read: Vec<HashSet<ParamId>>,
    /// Blocks handed over: (block, its weights, or the error that stopped the gathering).
    inbox: mpsc::Receiver<(usize, Result<Block>)>,
    /// Asks the thread for a block.
    asks: mpsc::Sender<Ask>,
    /// The block in use and the weights of it not asked for yet.
    current: Option<(usize, Block)>,
    /// The block asked for and not handed over yet: the inbox closing while there is one means the thread
    /// died.
    outstanding: Option<usize>,
    phase: Phase,
}

impl Active {
    /// Asks the thread for `block` (the weights in `only`; `None`: all).
    fn ask(&mut self, block: usize, only: Option<HashSet<ParamId>>) {
        self.outstanding = Some(block);
        let marks = (current_forward_mark(), current_mark());
        // A thread gone is found at the next take (the inbox closes with a block outstanding).
        let _ = self.asks.send(Ask { block, only, marks });
    }

    /// Asks for the next block backward replays below `above` (the highest with weights read, from the top
    /// when `above` is the block count), if any.
    fn ask_backward_below(&mut self, above: usize) {
        if let Some(b) = (0..above).rev().find(|&b| !self.read[b].is_empty()) {
            let only = self.read[b].clone();
            self.ask(b, Some(only));
        }
    }

    /// The forward is past its last block: its leftover weights go (backward gathers its own, as at each use)
    /// and backward's first block is asked for.
    fn start_backward(&mut self) {
        self.phase = Phase::Backward;
        self.current = None;
        self.ask_backward_below(self.read.len());
    }

    /// Block `b` was handed over: asks for the one after it in the plan.
    fn handed_over(&mut self, b: usize) {
        match self.phase {
            Phase::Forward if b + 1 < self.read.len() => self.ask(b + 1, None),
            Phase::Forward => self.phase = Phase::ForwardEnding,
            Phase::ForwardEnding => {}
            Phase::Backward => self.ask_backward_below(b),
        }
    }
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// A running prefetch, installed on the thread that started it: [`take`] reads from it until it is
/// dropped (which stops and joins its thread).
pub struct GatherPrefetch {
    worker: Option<JoinHandle<()>>,
}

impl GatherPrefetch {
    /// Starts gathering `blocks` (each block's parameters sharded at `Parameters`, in model order; others are
    /// left out) over `group`, a [`duplicate`](ProcessGroup::duplicate) of the parameters' group, in the
    /// order forward then backward use them (see the module doc), and asks for block 0. Installs it on this
    /// thread for [`take`] and [`region_ended`]. Fails if a prefetch is already installed on this thread or
    /// the thread cannot start.
    pub fn start(blocks: &[Vec<Param>], group: Arc<dyn ProcessGroup>) -> Result<Self> {
        if running() {
            return Err(Error::InvalidArgument {
                op: "gather_prefetch",
                msg: "a gather prefetch is running on this thread already: drop it before starting another".into(),
            });
        }
        let blocks: Vec<Vec<Param>> = blocks
            .iter()
            .map(|b| {
                b.iter().filter(|p| p.shard().is_some_and(|s| s.level == ShardLevel::Parameters)).cloned().collect()
            })
            .collect();
        let block_of = blocks.iter().enumerate().flat_map(|(i, b)| b.iter().map(move |p| (p.id(), i))).collect();
        let n = blocks.len();
        // The slices the step's thread last wrote (the optimizer's update) are complete before the first
        // gather reads them, and each gathered block before the step reads it (CUDA streams per thread).
        let device = blocks.iter().flatten().next().map_or(Device::Cpu, |p| p.tensor().device().clone());
        let written = HandOff::record(&device)?;
        let (post, inbox) = mpsc::sync_channel::<(usize, Result<Block>)>(0);
        let (asks, wait) = mpsc::channel::<Ask>();
        let worker = std::thread::Builder::new()
            .name("gather-prefetch".into())
            .spawn(move || {
                // Until the step stops asking (the prefetch dropped) or a gather fails.
                let mut written = Some(written);
                while let Ok(Ask { block, only, marks }) = wait.recv() {
                    let params: Vec<&Param> =
                        blocks[block].iter().filter(|p| only.as_ref().is_none_or(|o| o.contains(&p.id()))).collect();
                    let gathered = with_forward_mark(marks.0, || {
                        with_mark(marks.1, || {
                            if let Some(w) = written.take() {
                                w.wait()?;
                            }
                            let block = gather_block(&params, group.as_ref())?;
                            settle(&device)?;
                            Ok(block)
                        })
                    });
                    let failed = gathered.is_err();
                    if post.send((block, gathered)).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| Error::InvalidArgument {
                op: "gather_prefetch",
                msg: format!(
                    "could not start the gather prefetch thread: {e}; set CompileConfig::prefetch_gathers to false"
                ),
            })?;
        let mut active = Active {
            block_of,
            read: vec![HashSet::new(); n],
            inbox,
            asks,
            current: None,
            outstanding: None,
            phase: Phase::Forward,
        };
        if n > 0 {
            active.ask(0, None);
        }
        ACTIVE.with(|a| *a.borrow_mut() = Some(active));
        Ok(Self { worker: Some(worker) })
    }
}

impl Drop for GatherPrefetch {
    fn drop(&mut self) {
        // Closing both channels ends the thread: between blocks, or at its next hand-off.
        ACTIVE.with(|a| a.borrow_mut().take());
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// Every parameter of `params` gathered whole over `group` (collective, in their order).
fn gather_block(params: &[&Param], group: &dyn ProcessGroup) -> Result<Block> {
    let mut out = Block::with_capacity(params.len());
    for p in params {
        let shard = p.shard().expect("the plan keeps sharded parameters only");
        out.insert(p.id(), shard.layout.gather(group, &p.tensor(), &shard.shape)?);
    }
    Ok(out)
}

/// Whether a prefetch runs on this thread (the tape reports its regions' reads only then).
pub fn running() -> bool {
    ACTIVE.with(|a| a.borrow().is_some())
}

/// The forward ended a checkpoint region on this thread, whose recorded nodes read the gathered weights of
/// the parameters `read` (the tape, at each region's end): backward's replay gathers these again. After the
/// forward's last block, asks for backward's first block. Does nothing when no prefetch runs.
pub fn region_ended(read: &[ParamId]) {
    ACTIVE.with(|a| {
        let mut guard = a.borrow_mut();
        let Some(active) = guard.as_mut() else { return };
        for id in read {
            if let Some(&b) = active.block_of.get(id) {
                active.read[b].insert(*id);
            }
        }
        if active.phase == Phase::ForwardEnding {
            active.start_backward();
        }
    })
}

/// Parameter `p` whole from the prefetch running on this thread: `None` when none runs, `p` is outside its
/// plan, or its block was not the next one handed over (the caller then gathers it inline). Waits for the
/// block's gather to finish. Notes the weight for [`crate::shard::take_largest_gathered`] on this thread.
pub fn take(p: &Param) -> Result<Option<Tensor>> {
    ACTIVE.with(|a| {
        let mut guard = a.borrow_mut();
        let Some(active) = guard.as_mut() else { return Ok(None) };
        let Some(&block) = active.block_of.get(&p.id()) else { return Ok(None) };
        if let Some((b, weights)) = &mut active.current {
            if *b == block {
                if let Some(t) = weights.remove(&p.id()) {
                    note_gathered(&t);
                    return Ok(Some(t));
                }
            }
        }
        if active.phase == Phase::ForwardEnding {
            // Backward began without the forward's last region ending (no region reported it): ask now rather
            // than wait for a block never asked for.
            active.start_backward();
        }
        // The next block handed over; its weights are whole now, the previous block's go.
        active.current = None;
        let Some(asked) = active.outstanding else {
            // Nothing more is planned: later asks are gathered inline.
            return Ok(None);
        };
        let Ok((b, weights)) = active.inbox.recv() else {
            // The thread died (a panic) in a gather its peers' threads wait in: gathering inline would
            // leave every rank waiting for the timeout.
            return Err(Error::InvalidArgument {
                op: "gather_prefetch",
                msg: format!(
                    "the gather prefetch thread stopped before handing over block {asked}; set \
                     CompileConfig::prefetch_gathers to false"
                ),
            });
        };
        active.outstanding = None;
        let mut weights = weights?;
        // The thread may gather the next block while this one computes.
        active.handed_over(b);
        if b != block {
            // Out of the plan's order: keep the block handed over for its own weights, gather this one inline.
            active.current = Some((b, weights));
            return Ok(None);
        }
        let t = weights.remove(&p.id());
        active.current = Some((b, weights));
        Ok(t.inspect(note_gathered))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::RecordingGroup;
    use candle_core::Device;
    use std::time::Duration;

    /// Two blocks of two parameters sharded at `Parameters` over two thread ranks, taken as a step takes
    /// them, with the regions' reads reported as the tape reports them (block 1's second weight read by no
    /// recorded node): every forward weight comes whole from the prefetch, backward's block 1 gathers only the
    /// weight read, so the prefetch thread gathers 4 + 3 weights; a weight outside the plan, or of a block
    /// asked for out of order, is left to the caller; none comes once the prefetch is dropped.
    #[test]
    fn blocks_come_whole_in_plan_order_backward_gathers_what_was_read_and_the_rest_is_left_inline() {
        let out = crate::comm::run_ranks(2, Duration::from_secs(20), |g| -> Result<()> {
            let whole = |k: usize| Tensor::arange(k as f32, k as f32 + 6., &Device::Cpu)?.reshape((2, 3));
            let make = |k: usize| -> Result<Param> {
                let p = Param::new(format!("p{k}"), whole(k)?);
                p.shard_over(ShardLevel::Parameters, g.clone())?;
                Ok(p)
            };
            let blocks = vec![vec![make(0)?, make(10)?], vec![make(20)?, make(30)?]];
            let outside = make(40)?;
            // The calls one gather makes, to count the prefetch thread's gathers by.
            let recorder = RecordingGroup::new(g.duplicate()?);
            let shard = blocks[0][0].shard().expect("sharded");
            shard.layout.gather(recorder.as_ref(), &blocks[0][0].tensor(), &shard.shape)?;
            let per_gather = recorder.records().len();
            recorder.clear();
            let prefetch = GatherPrefetch::start(&blocks, recorder.clone())?;
            assert!(take(&outside)?.is_none(), "outside the plan: gathered inline");
            let expect = |p: &Param, k: usize| -> Result<()> {
                let got = take(p)?.expect("prefetched");
                assert_eq!(got.to_vec2::<f32>()?, whole(k)?.to_vec2::<f32>()?, "{}", p.name());
                Ok(())
            };
            // Forward: block 0 then 1, each region reporting its reads.
            let ids = |b: usize| blocks[b].iter().map(Param::id).collect::<Vec<_>>();
            expect(&blocks[0][0], 0)?;
            expect(&blocks[0][1], 10)?;
            region_ended(&ids(0));
            expect(&blocks[1][0], 20)?;
            expect(&blocks[1][1], 30)?;
            region_ended(&ids(1)[..1]);
            // Backward: block 1's weight read, then block 0.
            expect(&blocks[1][0], 20)?;
            expect(&blocks[0][1], 10)?;
            expect(&blocks[0][0], 0)?;
            assert!(take(&blocks[1][1])?.is_none(), "nothing more planned: inline");
            drop(prefetch);
            let gathered = recorder.records().iter().filter(|r| r.thread.as_deref() == Some("gather-prefetch")).count();
            assert_eq!(gathered, 7 * per_gather, "4 weights in the forward, 3 in backward");
            assert!(take(&blocks[0][0])?.is_none(), "no prefetch installed any more");
            // Block 1 asked for first: block 0 comes in its place, and block 1's weight is gathered inline.
            let prefetch = GatherPrefetch::start(&blocks, g.duplicate()?)?;
            assert!(take(&blocks[1][0])?.is_none(), "out of the plan's order");
            expect(&blocks[0][1], 10)?;
            drop(prefetch);
            Ok(())
        });
        for r in out {
            r.unwrap().unwrap();
        }
    }
}
