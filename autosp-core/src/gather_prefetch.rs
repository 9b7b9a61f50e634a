//! The weights of the next block gathered while the current block computes, at `Parameters`
//! ([`crate::shard`]): a communication thread gathers every block's weights on a second handle of the world
//! ([`ProcessGroup::duplicate`]), strictly in the order the step uses them (forward: first block to last;
//! backward's replay: last to first), and hands each block over to the thread that runs the step, which
//! [`ShardedParam`](crate::ops::shard_param::ShardedParam) asks first ([`take`]). The thread gathers block
//! k + 1 only once block k was handed over, so at most two blocks' weights are whole at once (the one the
//! step uses, the one gathered for it next), and every rank makes the same collectives in the same order.
//! Each gather carries the [`ForwardMark`] and [`BackwardMark`] of the hand-off that let it start, so a
//! recording process group shows a block gathered while the block before it computed in the forward, and
//! before the backward of the block after it ended. A weight outside the plan,
//! or asked for out of the plan's order, is gathered inline as without a prefetch.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::Tensor;

use crate::comm::ProcessGroup;
use crate::progress::{current_forward_mark, current_mark, with_forward_mark, with_mark, BackwardMark, ForwardMark};
use crate::shard::{note_gathered, ShardLevel};
use crate::{Error, Param, ParamId, Result};

/// One block's gathered weights, by parameter: whole, the parameter's shape.
type Block = HashMap<ParamId, Tensor>;

/// Where the step thread's forward and backward stood at a hand-off.
type Marks = (Option<ForwardMark>, Option<BackwardMark>);

/// The step thread's side of a running prefetch.
struct Active {
    /// The block of each planned parameter.
    block_of: HashMap<ParamId, usize>,
    /// Blocks handed over: (block, its weights, or the error that stopped the gathering).
    inbox: mpsc::Receiver<(usize, Result<Block>)>,
    /// Tells the thread a block was taken, with where forward and backward stood then: it may gather the next.
    taken: mpsc::Sender<Marks>,
    /// The block in use and the weights of it not asked for yet.
    current: Option<(usize, Block)>,
    /// Blocks the thread has still to hand over: its inbox closing before then means it died.
    left: usize,
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
    /// order forward then backward use them: blocks `0, 1, .., n-1`, then `n-1, .., 0`. Installs it on this
    /// thread for [`take`]. Fails if a prefetch is already installed on this thread or the thread cannot start.
    pub fn start(blocks: &[Vec<Param>], group: Arc<dyn ProcessGroup>) -> Result<Self> {
        if ACTIVE.with(|a| a.borrow().is_some()) {
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
        let order: Vec<usize> = (0..n).chain((0..n).rev()).collect();
        let (post, inbox) = mpsc::sync_channel::<(usize, Result<Block>)>(0);
        let (taken, wait) = mpsc::channel::<Marks>();
        let worker = std::thread::Builder::new()
            .name("gather-prefetch".into())
            .spawn(move || {
                let mut marks = (None, None);
                for (k, &b) in order.iter().enumerate() {
                    if k > 0 {
                        // The step took the block before: this one may be gathered (two whole at most).
                        match wait.recv() {
                            Ok(m) => marks = m,
                            Err(_) => return,
                        }
                    }
                    let gathered =
                        with_forward_mark(marks.0, || with_mark(marks.1, || gather_block(&blocks[b], group.as_ref())));
                    let failed = gathered.is_err();
                    if post.send((b, gathered)).is_err() || failed {
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
        ACTIVE.with(|a| *a.borrow_mut() = Some(Active { block_of, inbox, taken, current: None, left: 2 * n }));
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

/// Every parameter of one block gathered whole over `group` (collective, in the block's order).
fn gather_block(params: &[Param], group: &dyn ProcessGroup) -> Result<Block> {
    let mut out = Block::with_capacity(params.len());
    for p in params {
        let shard = p.shard().expect("the plan keeps sharded parameters only");
        out.insert(p.id(), shard.layout.gather(group, &p.tensor(), &shard.shape)?);
    }
    Ok(out)
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
        // The next block handed over; its weights are whole now, the previous block's go.
        active.current = None;
        let Ok((b, weights)) = active.inbox.recv() else {
            if active.left == 0 {
                // Every planned block was handed over: later asks are gathered inline.
                return Ok(None);
            }
            // The thread died (a panic) in a gather its peers' threads wait in: gathering inline would
            // leave every rank waiting for the timeout.
            return Err(Error::InvalidArgument {
                op: "gather_prefetch",
                msg: "the gather prefetch thread stopped before handing over every block; set \
                      CompileConfig::prefetch_gathers to false"
                    .into(),
            });
        };
        active.left -= 1;
        let mut weights = weights?;
        // The thread may gather the next block while this one computes.
        let _ = active.taken.send((current_forward_mark(), current_mark()));
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
    use candle_core::Device;
    use std::time::Duration;

    /// Two blocks of two parameters sharded at `Parameters` over two thread ranks: taken in forward then
    /// backward order, every weight comes whole from the prefetch; a weight outside the plan, or of a block
    /// asked for out of order, is left to the caller; none comes once the prefetch is dropped.
    #[test]
    fn blocks_come_whole_in_plan_order_and_the_rest_is_left_inline() {
        let out = crate::comm::run_ranks(2, Duration::from_secs(20), |g| -> Result<()> {
            let whole = |k: usize| Tensor::arange(k as f32, k as f32 + 6., &Device::Cpu)?.reshape((2, 3));
            let make = |k: usize| -> Result<Param> {
                let p = Param::new(format!("p{k}"), whole(k)?);
                p.shard_over(ShardLevel::Parameters, g.clone())?;
                Ok(p)
            };
            let blocks = vec![vec![make(0)?, make(10)?], vec![make(20)?, make(30)?]];
            let outside = make(40)?;
            let prefetch = GatherPrefetch::start(&blocks, g.duplicate()?)?;
            assert!(take(&outside)?.is_none(), "outside the plan: gathered inline");
            let expect = |p: &Param, k: usize| -> Result<()> {
                let got = take(p)?.expect("prefetched");
                assert_eq!(got.to_vec2::<f32>()?, whole(k)?.to_vec2::<f32>()?, "{}", p.name());
                Ok(())
            };
            // Forward: block 0 then 1; backward: block 1 then 0.
            for (b, ks) in [(0, [0, 10]), (1, [20, 30]), (1, [20, 30]), (0, [0, 10])] {
                for (p, k) in blocks[b].iter().zip(ks) {
                    expect(p, k)?;
                }
            }
            drop(prefetch);
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
