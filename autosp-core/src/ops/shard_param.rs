//! A sharded parameter made whole for one use, as a tape op of kind [`NodeKind::Gather`]: its input is this
//! rank's slice (the parameter's leaf on the tape), its output the whole weight, and its backward
//! reduce-scatters the whole weight's gradient over the shard's group into the slice's gradient. Each use of
//! a parameter records its own node, so the whole weight lives only while its block runs: regions drop
//! `Gather` outputs when they close under every policy, and backward replays the node where it needs the
//! weight again. [`crate::Tape::param`] records it for parameters sharded at `Gradients` or `Parameters`.
//!
//! - `Parameters`: the forward all-gathers every rank's slice (collective), or takes the weight a
//!   [`GatherPrefetch`](crate::gather_prefetch::GatherPrefetch) gathered ahead on another thread.
//! - `Gradients`: the forward hands out the replicated whole weight, which every rank holds; only the gradient
//!   is reduce-scattered.
//!
//! The reduce-scatter runs inline in f32, or through a [`GradScatter`](crate::grad_scatter::GradScatter)
//! installed by the step: in its wire dtype, and on a communication thread while backward goes on (the
//! leaf then gets no gradient from this node; the step adds the thread's slices).

use candle_core::Tensor;

use crate::shard::{ParamShard, ShardLevel};
use crate::{NodeKind, Op, Param, Result, SavedTensors, Saves};

/// The op: `slice: [chunk]` -> the whole parameter; backward: the whole gradient reduce-scattered into
/// `[chunk]` (in the reduction dtype, f32 for bf16/f16 weights).
#[derive(Debug)]
pub struct ShardedParam {
    /// The parameter (at `Gradients`, its stored whole tensor is the output).
    pub param: Param,
    /// Its sharding.
    pub shard: std::sync::Arc<ParamShard>,
}

impl Op for ShardedParam {
    fn name(&self) -> &'static str {
        match self.shard.level {
            ShardLevel::Parameters => "gather_param",
            _ => "sharded_grad",
        }
    }

    fn kind(&self) -> NodeKind {
        NodeKind::Gather
    }

    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![match self.shard.level {
            // The block's weights gathered ahead by a running prefetch, else gathered now.
            ShardLevel::Parameters => match crate::gather_prefetch::take(&self.param)? {
                Some(whole) => whole,
                None => self.shard.gather(i[0])?,
            },
            _ => self.param.tensor(),
        }])
    }

    fn saves(&self) -> Saves {
        Saves::NONE
    }

    fn backward(&self, _s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None]) };
        // Reduced now, or posted to a communication thread whose slices the step adds after backward.
        Ok(vec![crate::grad_scatter::reduce_or_post(&self.param, &self.shard, g)?])
    }
}
