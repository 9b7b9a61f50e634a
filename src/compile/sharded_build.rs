//! Building a model whose whole weights do not fit on every rank at once (DeepSpeed's `zero.Init`, FSDP's
//! deferred initialisation): the ranks build it in turn, each sharding its parameters before the next rank
//! starts, so the ranks of one machine hold one whole model at a time besides their slices. [`compile`]
//! takes the model as it is sharded.
//!
//! [`compile`]: super::compile

use std::sync::Arc;

use autosp_core::comm::{ProcessGroup, ReduceOp};
use autosp_core::module::all_params;
use autosp_core::{Module, ShardLevel};
use candle_core::{Device, Tensor};

use super::CompileError;

/// Builds the model with `build` on one rank of `world` at a time, in rank order, sharding every parameter
/// at `level` over `world` right after (collective: every rank calls it; on one rank nothing is sharded). At `Parameters` a rank keeps 1/W of
/// each weight, so the peak of building on a machine of k ranks is one whole model plus k slices instead of
/// k whole models; at lower levels the weights stay whole and building in turn only takes longer. Pass the
/// model to [`compile`](super::compile) with the same world and level (or none: it takes the model's).
///
/// Each turn ends with the ranks agreeing that it worked, so an error on one rank stops every rank at once:
/// that rank returns its own error, the others one naming it, and no rank builds after it.
pub fn build_sharded<M, E>(
    world: &Arc<dyn ProcessGroup>,
    level: ShardLevel,
    build: impl FnOnce() -> Result<M, E>,
) -> Result<M, E>
where
    M: Module,
    E: From<CompileError>,
{
    let (rank, size) = (world.rank(), world.size());
    let mut build = Some(build);
    let mut mine: Option<Result<M, E>> = None;
    for turn in 0..size {
        if turn == rank {
            let built = (build.take().expect("one turn per rank"))().and_then(|model| {
                // One rank has nothing to shard (as `compile` says).
                // Frozen weights (LoRA's base) too: sliced at `Parameters`, whole below (Param::shard_over).
                for p in all_params(&model).into_iter().filter(|_| size > 1) {
                    p.shard_over(level, world.clone()).map_err(|e| E::from(CompileError::from(e)))?;
                }
                Ok(model)
            });
            mine = Some(built);
        }
        let failed = turn == rank && mine.as_ref().is_some_and(|m| m.is_err());
        let flag =
            Tensor::new(&[f64::from(u8::from(failed))], &Device::Cpu).map_err(|e| E::from(CompileError::from(e)))?;
        let any = world.all_reduce(&flag, ReduceOp::Max).map_err(|e| E::from(CompileError::from(e)))?;
        // host data: a flag made on the host.
        if any.to_vec1::<f64>().map_err(|e| E::from(CompileError::from(e)))?[0] > 0.0 {
            return match mine {
                Some(Err(e)) => Err(e),
                _ => Err(E::from(CompileError::Input(format!(
                    "rank {turn} of {size} failed building its model (its own error says why); no rank went on"
                )))),
            };
        }
    }
    mine.expect("every rank had its turn")
}
