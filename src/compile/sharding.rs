//! Model states per rank at each sharding level, and the level a compile picks when none is asked for.
//!
//! Per rank, for N parameters of `b` bytes each (4 for f32, 2 for bf16/f16) over W ranks, `n` = N (whole) or
//! about N/W (a slice) as the level keeps them ([`autosp_core::shard`]):
//! parameters `n·b`; gradients in the reduction dtype, `n·4` (whole below `Gradients`: the tape holds them
//! whole until they are reduced); AdamW's two moments `n·8`; f32 masters of bf16/f16 weights `n·4`. At `Parameters` a whole weight exists only while an op
//! uses it: the largest block's weights, frozen ones included (or the largest single weight outside the blocks
//! other than the `[vocab, hidden]` embedding and head, which are never whole: the embedding moves the rows its
//! tokens use and the loss gathers the head one vocabulary tile of at most a block's size at a time), counted
//! as `gathered`, once, or twice where the gather prefetch runs ([`gathered_blocks`]). Frozen parameters (LoRA's base weights) count `N·b` and nothing else: whole on every rank
//! below `Parameters`, a slice (`ceil(N/W)·b` each) at `Parameters`.

use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::module::{all_params, visit_mut};
use autosp_core::optim::AdamW;
use autosp_core::shard::{ShardLayout, ShardLevel};
use autosp_core::{Gradients, LmDims, Module, Param, Precision};
use candle_core::DType;

use super::CompileError;

/// Below this many bytes of unsharded model state the default level is `None` (per rank; over thread ranks,
/// for the process: see [`default_level`]).
pub const SHARD_FROM_BYTES: usize = 1 << 30;

/// The model-state bytes of one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelStateBytes {
    /// Parameters as stored.
    pub params: usize,
    /// Gradients at their most, in the reduction dtype (f32 for bf16/f16/f32 weights): whole below
    /// `Gradients` (the tape's, until the reduction; at `Optimizer` the optimiser then gets a slice), this
    /// rank's slice at `Gradients` and `Parameters` (each use's gradient is reduce-scattered in backward).
    pub grads: usize,
    /// AdamW's two moments.
    pub moments: usize,
    /// f32 master weights of bf16/f16 parameters.
    pub masters: usize,
    /// Whole weights gathered for their use (`Parameters` only): the most alive at once.
    pub gathered: usize,
}

impl ModelStateBytes {
    /// Everything a rank holds for the model state at its peak (the gathered weights included).
    pub fn total(&self) -> usize {
        self.params + self.grads + self.moments + self.masters + self.gathered
    }
}

impl ModelStateBytes {
    /// What this rank holds of `params` (pass every parameter: frozen ones count as stored, with nothing
    /// else), measured from the tensors' storages, each counted once (a view counts the whole
    /// storage it keeps alive; gradients that are views of one reduced bucket count the bucket once): `params`
    /// as stored (a slice at `Parameters`), `grads` as a step returned them, AdamW's moments and master
    /// weights; `gathered` is 0 (the gathered weights live only inside a step: the tape's bytes count them).
    pub fn held(params: &[Param], grads: &Gradients, opt: &AdamW) -> Self {
        let mut seen = std::collections::HashSet::new();
        let mut bytes = |t: &candle_core::Tensor| {
            if seen.insert(autosp_core::memory::storage_key(t)) {
                autosp_core::memory::storage_bytes(t)
            } else {
                0
            }
        };
        let mut held = Self::default();
        for p in params {
            held.params += bytes(&p.tensor());
            held.grads += grads.get(p).map_or(0, &mut bytes);
            if let Some((m, v)) = opt.moments(p) {
                held.moments += bytes(m) + bytes(v);
            }
            held.masters += opt.master(p).map_or(0, &mut bytes);
        }
        held
    }
}

/// `{total} per rank: parameters {..}, gradients {..}, moments {..}, masters {..}, gathered weights {..}` (MiB).
impl std::fmt::Display for ModelStateBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} per rank: parameters {}, gradients {}, moments {}, masters {}, gathered weights {}",
            mib(self.total()),
            mib(self.params),
            mib(self.grads),
            mib(self.moments),
            mib(self.masters),
            mib(self.gathered)
        )
    }
}

/// The parameters of a model as model-state accounting needs them: every distinct parameter's whole element
/// count, the elements of the largest set whole at once at `Parameters` (a block's, or the largest single
/// parameter outside the blocks), which parameters belong to a checkpointed block, and the embedding tied to
/// the LM head (a causal LM's only `[vocab, hidden]` parameter), which a step uses twice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamCounts {
    /// Whole element counts, one per distinct parameter that trains.
    pub elems: Vec<usize>,
    /// The elements of the frozen parameters (LoRA's base weights), with no gradient, moments or masters:
    /// whole on every rank below `Parameters`, sliced at it.
    pub frozen: usize,
    /// Each frozen parameter's whole element count (their sum is `frozen`), for their slices at `Parameters`.
    pub frozen_elems: Vec<usize>,
    /// The largest unit gathered at once (a block's weights, frozen ones included).
    pub largest_unit: usize,
    /// The parameters of modules with a checkpoint region.
    pub in_block: std::collections::HashSet<autosp_core::ParamId>,
    /// The tied embedding, when there is one.
    pub tied: Option<autosp_core::ParamId>,
}

impl ParamCounts {
    /// The counts of `model` (its blocks are the modules with a checkpoint region; `dims` its vocabulary and
    /// hidden size).
    pub fn of(model: &mut dyn Module, dims: &LmDims) -> Self {
        let mut in_blocks = std::collections::HashSet::new();
        let mut largest = 0;
        visit_mut(model, "", &mut |_, m| {
            if m.region_slot().is_some() {
                // Gathered whole for the block's use at `Parameters`, the frozen weights as well.
                let ps = all_params(m);
                largest = largest.max(ps.iter().map(|p| p.shape().elem_count()).sum::<usize>());
                in_blocks.extend(ps.iter().map(Param::id));
            }
        });
        let all = all_params(model);
        let frozen_elems: Vec<usize> = all.iter().filter(|p| p.is_frozen()).map(|p| p.shape().elem_count()).collect();
        // Outside the blocks: the largest weight gathered whole for one use (the final norm's); the
        // [vocab, hidden] embedding and head never are (their ops move rows and vocabulary tiles).
        let vocab_sized = |p: &Param| p.shape().dims() == [dims.vocab, dims.hidden];
        let outside = all
            .iter()
            .filter(|p| !in_blocks.contains(&p.id()) && !vocab_sized(p))
            .map(|p| p.shape().elem_count())
            .max()
            .unwrap_or(0);
        let params: Vec<Param> = all.into_iter().filter(|p| !p.is_frozen()).collect();
        let heads: Vec<&Param> = params.iter().filter(|p| vocab_sized(p)).collect();
        let tied = if heads.len() == 1 { Some(heads[0].id()) } else { None };
        Self {
            elems: params.iter().map(|p| p.shape().elem_count()).collect(),
            frozen: frozen_elems.iter().sum(),
            frozen_elems,
            largest_unit: largest.max(outside),
            in_block: in_blocks,
            tied,
        }
    }

    /// Every parameter's elements together (the frozen ones included).
    pub fn total(&self) -> usize {
        self.elems.iter().sum::<usize>() + self.frozen
    }
}

/// How many blocks' weights are whole at once at `level` over `world` ranks, where `prefetch` says whether the
/// gather prefetch is asked for on a back end that allows it ([`CompileConfig::prefetch_gathers`] and
/// [`ProcessGroup::concurrent_handles`]): none below `Parameters` or on one rank (nothing is gathered); two
/// where the prefetch runs (the block computing and the next one, gathered for it:
/// [`autosp_core::gather_prefetch`]); one otherwise. What the compile, the accounting
/// ([`model_state_bytes_with`]), [`default_level`] and the resume check count.
///
/// [`CompileConfig::prefetch_gathers`]: super::CompileConfig::prefetch_gathers
pub fn gathered_blocks(level: ShardLevel, world: usize, prefetch: bool) -> usize {
    match (level == ShardLevel::Parameters && world > 1, prefetch) {
        (false, _) => 0,
        (true, true) => 2,
        (true, false) => 1,
    }
}

/// Whether the gather prefetch runs at `level` over `world` ranks (`prefetch` as [`gathered_blocks`] takes
/// it): two blocks gathered at once.
pub fn prefetch_runs(level: ShardLevel, world: usize, prefetch: bool) -> bool {
    gathered_blocks(level, world, prefetch) == 2
}

/// The model-state bytes per rank of a model with these parameters (stored in `dtype`) at `level` over
/// `world` ranks, with one block's weights gathered at `Parameters` (as without the gather prefetch:
/// [`model_state_bytes_with`] counts it).
pub fn model_state_bytes(counts: &ParamCounts, dtype: DType, level: ShardLevel, world: usize) -> ModelStateBytes {
    model_state_bytes_with(counts, dtype, level, world, false)
}

/// [`model_state_bytes`] with the gather prefetch asked for or not (`prefetch` as [`gathered_blocks`] takes
/// it): `gathered` counts the largest block's weights [`gathered_blocks`] times.
pub fn model_state_bytes_with(
    counts: &ParamCounts,
    dtype: DType,
    level: ShardLevel,
    world: usize,
    prefetch: bool,
) -> ModelStateBytes {
    let sum = |sliced: bool| -> usize {
        counts.elems.iter().map(|&n| if sliced { ShardLayout::new(n, 0, world).chunk } else { n }).sum()
    };
    let b = dtype.size_in_bytes();
    let precision = Precision::float(dtype);
    let wide = precision.reduce().size_in_bytes();
    let sharded = level != ShardLevel::None && world > 1;
    let state = sum(sharded);
    let zero3 = level == ShardLevel::Parameters && world > 1;
    let gathered = counts.largest_unit * b * gathered_blocks(level, world, prefetch);
    let frozen: usize = if zero3 {
        counts.frozen_elems.iter().map(|&n| ShardLayout::new(n, 0, world).chunk).sum()
    } else {
        counts.frozen
    };
    ModelStateBytes {
        params: (sum(zero3) + frozen) * b,
        grads: sum(level >= ShardLevel::Gradients && world > 1) * wide,
        moments: 2 * state * precision.master().size_in_bytes(),
        masters: if precision.needs_master() { state * precision.master().size_in_bytes() } else { 0 },
        gathered,
    }
}

/// The level a compile uses when none is asked for, and why: `None` on one rank and below
/// [`SHARD_FROM_BYTES`] of unsharded model state, `Gradients` from it. Over one process per rank the bytes
/// are one rank's; over thread ranks (`shares_memory`) the process's, W copies of it: sharded, thread ranks
/// hold one copy of the parameters between them (they gather into one tensor) and 1/W each of the rest. Frozen
/// parameters, which only `Parameters` shards (never chosen by default), are left out of the decision. What
/// `Parameters` would hold, which the reason names, counts the gathered blocks [`gathered_blocks`] says
/// (`prefetch` as it takes it).
pub fn default_level(
    counts: &ParamCounts,
    dtype: DType,
    world: usize,
    shares_memory: bool,
    prefetch: bool,
) -> (ShardLevel, String) {
    if world == 1 {
        return (ShardLevel::None, "one rank: nothing to shard".into());
    }
    // Frozen parameters (LoRA's base) are sliced at `Parameters` only: only what trains decides the level.
    let whole =
        model_state_bytes(counts, dtype, ShardLevel::None, world).total() - counts.frozen * dtype.size_in_bytes();
    let (held, whose) = if shares_memory {
        (whole * world, format!("{} for this process's {world} thread ranks", mib(whole * world)))
    } else {
        (whole, format!("{} per rank", mib(whole)))
    };
    if held < SHARD_FROM_BYTES {
        return (
            ShardLevel::None,
            format!(
                "the model state is {whose} unsharded, below {}: sharding would save little and add collectives",
                mib(SHARD_FROM_BYTES)
            ),
        );
    }
    let zero2 = model_state_bytes(counts, dtype, ShardLevel::Gradients, world).total();
    let zero3 = model_state_bytes_with(counts, dtype, ShardLevel::Parameters, world, prefetch).total();
    (
        ShardLevel::Gradients,
        format!(
            "the model state would be {whose} unsharded; `gradients` keeps 1/{world} of the gradients, moments \
             and masters ({} per rank{}) for the communication of an all-reduce; `parameters` would bring it to {} \
             but gathers every weight for each use",
            mib(zero2),
            if shares_memory { ", the parameters one copy all ranks share" } else { "" },
            mib(zero3)
        ),
    )
}

/// The level the parameters were sharded at before compiling ([`super::build_sharded`]), if they were: every
/// parameter must be, at one level, over a group of the world's size, and a level asked for must be the same
/// ([`CompileError::Input`] naming the mismatch otherwise).
pub fn built_level(
    params: &[Param],
    world: &Arc<dyn ProcessGroup>,
    asked: Option<ShardLevel>,
) -> Result<Option<ShardLevel>, CompileError> {
    let Some(first) = params.iter().find_map(Param::shard) else { return Ok(None) };
    for p in params {
        match p.shard() {
            Some(s) if s.layout.rank != world.rank() => {
                return Err(CompileError::Input(format!(
                    "parameter `{}` was sharded for rank {} but this is rank {}: the ranks share one parameter \
                     object (a model cloned for each thread rank shares its parameters); give each rank its own \
                     model (LlamaModel::from_weights, or build_sharded)",
                    p.name(),
                    s.layout.rank,
                    world.rank()
                )))
            }
            Some(s) if s.level == first.level && s.layout.size == world.size() => {}
            other => {
                return Err(CompileError::Input(format!(
                    "parameter `{}` is {} but others are sharded at `{}` over {} ranks: shard the whole model \
                     once, over the world compile is given (build_sharded)",
                    p.name(),
                    other.map_or("not sharded".to_string(), |s| format!(
                        "sharded at `{}` over {} ranks",
                        s.level, s.layout.size
                    )),
                    first.level,
                    first.layout.size
                )))
            }
        }
    }
    if first.layout.size != world.size() {
        return Err(CompileError::Input(format!(
            "the model is sharded over {} ranks but compile is given {}: build it with the same world",
            first.layout.size,
            world.size()
        )));
    }
    match asked {
        Some(level) if level != first.level => Err(CompileError::Input(format!(
            "CompileConfig asks for sharding at `{level}` but the model was built sharded at `{}`: ask for the \
             same level, or none",
            first.level
        ))),
        _ => Ok(Some(first.level)),
    }
}

/// `bytes` in MiB, for messages.
fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(elems: usize) -> ParamCounts {
        ParamCounts { elems: vec![elems], largest_unit: elems, ..Default::default() }
    }

    #[test]
    fn the_default_level_counts_what_the_process_holds() {
        // 40M f32 parameters: 640 MB of model state per rank unsharded.
        let c = counts(40 << 20);
        assert_eq!(default_level(&c, DType::F32, 1, true, true).0, ShardLevel::None);
        let (level, why) = default_level(&c, DType::F32, 2, false, true);
        assert_eq!(level, ShardLevel::None, "one process per rank: 640 MB each is below the line: {why}");
        let (level, why) = default_level(&c, DType::F32, 2, true, true);
        assert_eq!(level, ShardLevel::Gradients, "two thread ranks hold 1280 MB in one process: {why}");
        assert!(why.contains("thread ranks") && why.contains("one copy all ranks share"), "{why}");
        // 80M: 1280 MB per rank, above the line either way.
        assert_eq!(default_level(&counts(80 << 20), DType::F32, 2, false, true).0, ShardLevel::Gradients);
        // A LoRA model: 80M frozen, 1M training: nothing worth sharding.
        let lora = ParamCounts { elems: vec![1 << 20], frozen: 80 << 20, largest_unit: 1 << 20, ..Default::default() };
        assert_eq!(default_level(&lora, DType::F32, 2, true, true).0, ShardLevel::None);
    }

    /// Two blocks whole at once where the prefetch runs (asked for, `Parameters`, W > 1), one where it is not
    /// asked for, none below `Parameters` or on one rank; the accounting and the default level's reason count
    /// them so.
    #[test]
    fn the_gathered_weights_are_two_blocks_where_the_prefetch_runs() {
        use ShardLevel::*;
        assert_eq!(gathered_blocks(Parameters, 2, true), 2);
        assert_eq!(gathered_blocks(Parameters, 2, false), 1);
        assert_eq!(gathered_blocks(Parameters, 1, true), 0);
        assert_eq!(gathered_blocks(Gradients, 2, true), 0);
        assert!(prefetch_runs(Parameters, 4, true) && !prefetch_runs(Parameters, 4, false));
        // 80M f32 parameters in blocks of 4M.
        let c = ParamCounts { elems: vec![80 << 20], largest_unit: 4 << 20, ..Default::default() };
        let block = (4 << 20) * 4;
        for (prefetch, blocks) in [(true, 2), (false, 1)] {
            let bytes = model_state_bytes_with(&c, DType::F32, Parameters, 2, prefetch);
            assert_eq!(bytes.gathered, blocks * block, "prefetch {prefetch}");
            let (_, why) = default_level(&c, DType::F32, 2, false, prefetch);
            assert!(why.contains(&format!("would bring it to {}", mib(bytes.total()))), "{why}");
        }
        assert_eq!(model_state_bytes(&c, DType::F32, Parameters, 2).gathered, block, "without the prefetch");
    }
}
