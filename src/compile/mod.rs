//! `autosp::compile`: rewrites an unmodified model (any [`CausalLm`] built from autosp modules) for a data ×
//! sequence mesh and sequence-aware checkpointing. It splits the world into sequence-parallel groups
//! ([`Mesh`]), walks the module tree by its named children, fills every attention slot with the chosen
//! strategy over its group, switches on every block's checkpoint region, shards the model states over the
//! world when asked or when the model is large ([`ShardLevel`]), and returns a [`Compiled`] model that takes
//! its replica's rows and its shard of each sequence, reduces the loss and gradients over the world, and
//! explains its plan.

pub mod config;
pub mod error;
mod grad_reduce;
pub mod mesh;
mod packed;
pub mod plan;
mod row_groups;
pub mod sharded_build;
pub mod sharding;
pub mod step;
pub mod strategy;
mod token_losses;

use std::sync::Arc;

use autosp_core::comm::{contiguous_groups, ProcessGroup};
use autosp_core::module::visit_mut;
use autosp_core::ops::AttentionSpec;
use autosp_core::shard::ShardLevel;
use autosp_core::{Attention, CausalLm, CheckpointPolicy};
use candle_core::DType;

pub use autosp_kernels::SeqLayout;
pub use config::{Checkpointing, CompileConfig, GradReduction, Strategy};
pub use error::CompileError;
pub use mesh::Mesh;
pub use plan::{Flops, LinearFit, Plan, PolicyMemory, PROBE_CAP};
pub use sharded_build::build_sharded;
pub use sharding::{gathered_blocks, model_state_bytes, model_state_bytes_with, ModelStateBytes, ParamCounts};
pub use step::{Accumulation, MicroStep, StepOutput};
pub use strategy::Resolved;

/// A model rewritten for a data × sequence mesh on one rank of its world.
pub struct Compiled<M> {
    model: M,
    /// Every rank of the run: the loss, the token count and the gradients are reduced over it, and model
    /// states are sharded over it.
    world: Arc<dyn ProcessGroup>,
    /// This rank's sequence-parallel group (its replica's S ranks; the world when D = 1).
    sp: Arc<dyn ProcessGroup>,
    mesh: Mesh,
    /// How model states are sharded over the world, and why.
    sharding: (ShardLevel, String),
    /// The parameters' element counts, for the model-state accounting.
    counts: ParamCounts,
    resolved: Resolved,
    checkpoint: Checkpointing,
    /// The compute dtype (the parameters' dtype).
    dtype: DType,
    /// The groups the attention communicates over (Hybrid's Ulysses and Ring subgroups).
    attention_groups: Vec<Arc<dyn ProcessGroup>>,
    /// The sliding attention window every attention slot applies.
    max_attention_distance: Option<usize>,
    /// How the gradients are reduced over the world.
    reduction: GradReduction,
    /// A second handle on the world for the communication thread that reduces the gradients while backward
    /// runs: buckets at `--shard none` and `optimizer`, each use's reduce-scatter at `gradients` and
    /// `parameters` (`Some` only where that happens: W > 1, overlap asked for and a back end with concurrent
    /// handles).
    reduce_group: Option<Arc<dyn ProcessGroup>>,
    /// A second handle on the world for the thread that gathers the next block's weights ahead, and each
    /// block's parameters in model order (`Some` only at `Parameters`, W > 1, prefetch asked for and a back end
    /// with concurrent handles; see [`CompileConfig::prefetch_gathers`]).
    prefetch: Option<PrefetchPlan>,
    /// Whether the gather prefetch was asked for on a back end that allows it (it runs at `Parameters` over
    /// more than one rank: [`sharding::gathered_blocks`]).
    prefetch_allowed: bool,
}

/// A second handle on the world for the gather prefetch thread, and each block's parameters in model order.
type PrefetchPlan = (Arc<dyn ProcessGroup>, Vec<Vec<autosp_core::Param>>);

impl<M: CausalLm> Compiled<M> {
    /// The model (its parameters are what the optimiser updates).
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The strategy chosen, its layout and why.
    pub fn resolved(&self) -> &Resolved {
        &self.resolved
    }

    /// The compute dtype: the parameters' and activations' dtype (see [`CompileConfig::dtype`]).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The sliding attention window (see [`CompileConfig::max_attention_distance`]); `None`: none.
    pub fn max_attention_distance(&self) -> Option<usize> {
        self.max_attention_distance
    }

    /// The sequence layout over the ranks.
    pub fn layout(&self) -> SeqLayout {
        self.resolved.layout
    }

    /// `n` padded up to what the layout needs over the sequence-parallel group.
    pub fn padded_len(&self, n: usize) -> usize {
        let m = self.layout().multiple(self.sp.size());
        n.div_ceil(m) * m
    }

    /// The global positions sequence rank `rank` (of the sequence-parallel group) holds of a padded sequence
    /// of `n_pad` tokens.
    pub fn positions(&self, n_pad: usize, rank: usize) -> Result<Vec<usize>, CompileError> {
        self.layout().positions(n_pad, self.sp.size(), rank).map_err(|e| CompileError::Core(e.into()))
    }

    /// The world: every rank of the run, the group `compile` was given.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.world
    }

    /// This rank's sequence-parallel group (its replica's ranks; the world when there is one replica).
    pub fn sp_group(&self) -> &Arc<dyn ProcessGroup> {
        &self.sp
    }

    /// The data × sequence mesh.
    pub fn mesh(&self) -> Mesh {
        self.mesh
    }

    /// How model states are sharded over the world.
    pub fn sharding(&self) -> ShardLevel {
        self.sharding.0
    }

    /// Why the sharding level is what it is (asked for, or chosen by the model's size).
    pub fn sharding_reason(&self) -> &str {
        &self.sharding.1
    }

    /// This rank's model-state bytes (parameters, gradients, AdamW moments and masters, gathered weights) at
    /// the compiled sharding level.
    pub fn model_state_bytes(&self) -> ModelStateBytes {
        self.model_state_bytes_at(self.sharding())
    }

    /// This rank's model-state bytes at `level` (to compare levels). With the gather prefetch
    /// ([`CompileConfig::prefetch_gathers`]) two blocks are whole at once at `Parameters`: `gathered` counts two
    /// ([`sharding::gathered_blocks`]).
    pub fn model_state_bytes_at(&self, level: ShardLevel) -> ModelStateBytes {
        model_state_bytes_with(&self.counts, self.dtype, level, self.world.size(), self.prefetch_allowed)
    }

    /// The groups the attention's collectives run over: the group itself for Ulysses and Ring, Hybrid's Ulysses
    /// group (u ranks) and Ring group (P/u ranks), none at P = 1. Their statistics count attention traffic
    /// ([`Plan::attention_comm_bytes`] predicts their `AllToAll` and `SendRecv` bytes).
    pub fn attention_groups(&self) -> &[Arc<dyn ProcessGroup>] {
        &self.attention_groups
    }

    /// Every parameter that trains, in model order (all of them, unless the model has frozen parameters:
    /// LoRA's base weights).
    pub fn params(&self) -> Vec<autosp_core::Param> {
        autosp_core::module::trainable_params(&self.model)
    }

    /// The tape's policy (blocks may override it under a byte budget).
    pub fn tape_policy(&self) -> CheckpointPolicy {
        match self.checkpoint {
            Checkpointing::Policy(p) => p,
            Checkpointing::Budget(_) => CheckpointPolicy::None,
        }
    }

    /// The device the model's parameters live on (where every step runs; inputs are moved there).
    pub fn device(&self) -> candle_core::Device {
        autosp_core::module::all_params(&self.model)
            .first()
            .map_or(candle_core::Device::Cpu, |p| p.tensor().device().clone())
    }

    /// How the gradients are reduced over the world (see [`GradReduction`]).
    pub fn reduction(&self) -> GradReduction {
        self.reduction
    }

    /// Whether a step reduces gradient buckets on a communication thread while backward runs (see
    /// [`GradReduction::overlap`]).
    pub fn overlaps_reduction(&self) -> bool {
        self.reduce_group.is_some()
    }

    /// Whether a step at `Parameters` gathers the next block's weights on a communication thread while the
    /// current block computes (see [`CompileConfig::prefetch_gathers`]).
    pub fn prefetches_gathers(&self) -> bool {
        self.prefetch.is_some()
    }

    /// Gives back the model.
    pub fn into_inner(self) -> M {
        self.model
    }
}

/// The attention that `resolved` runs on this rank, and the groups it communicates over.
type BuiltAttention = (Arc<dyn Attention>, Vec<Arc<dyn ProcessGroup>>);

fn build_attention(resolved: &Resolved, group: &Arc<dyn ProcessGroup>) -> Result<BuiltAttention, CompileError> {
    use autosp_kernels::sp::{HybridAttention, RingAttention, RingLayout, UlyssesAttention};
    let local: Arc<dyn Attention> = Arc::new(autosp_kernels::LocalAttention);
    let ring_layout = match resolved.layout {
        SeqLayout::Contiguous => RingLayout::Contiguous,
        SeqLayout::Zigzag | SeqLayout::HybridZigzag { .. } => RingLayout::Zigzag,
    };
    Ok(match resolved.strategy {
        _ if group.size() == 1 => (local, Vec::new()),
        Strategy::Ulysses => (Arc::new(UlyssesAttention::new(group.clone(), local)), vec![group.clone()]),
        Strategy::Ring => (Arc::new(RingAttention::new(group.clone(), ring_layout)), vec![group.clone()]),
        Strategy::Hybrid { ulysses } => {
            let h = HybridAttention::new(group.as_ref(), ulysses, ring_layout)?;
            let groups = vec![h.inner_group.clone(), h.outer_group.clone()];
            (Arc::new(h), groups)
        }
        Strategy::Auto => return Err(CompileError::Input("Auto must be resolved before building".into())),
    })
}

/// Compiles `model` for its rank of `config.group`: every rank of the group calls this with its own copy of
/// the model (same weights) at the same time. Impossible requests (Ulysses with heads not divisible by P, a
/// budget below the smallest plan) fail here, before any step runs, saying what would work.
pub fn compile<M: CausalLm + 'static>(mut model: M, config: CompileConfig) -> Result<Compiled<M>, CompileError> {
    if let Some(extension) = &config.rope_scaling {
        let Some(llama) = (&mut model as &mut dyn std::any::Any).downcast_mut::<autosp_models::LlamaModel>() else {
            return Err(CompileError::RopeScalingNotLlama { extension: extension.to_string() });
        };
        llama.extend_rope(extension).map_err(CompileError::RopeScaling)?;
    }
    config.reduction.check()?;
    let world = config.group.clone();
    let w = world.size();
    let mesh = config.mesh.unwrap_or(Mesh::sequence_only(w));
    mesh.check(w)?;
    let p = mesh.sequence;
    if !matches!(config.dtype, DType::F32 | DType::BF16 | DType::F16 | DType::F64) {
        return Err(CompileError::Input(format!(
            "compile dtype {:?} is not a float training dtype: use f32, bf16, f16 (or f64 for checks)",
            config.dtype
        )));
    }
    if let Some(lora) = &config.lora {
        if autosp_core::module::all_params(&model).iter().any(|p| p.shard().is_some()) {
            return Err(CompileError::Input(
                "CompileConfig::lora on a model built sharded: add the adapters before sharding \
                 (autosp_core::lora::add_lora inside build_sharded's closure)"
                    .into(),
            ));
        }
        autosp_core::lora::add_lora(&mut model, lora)?;
    }
    if let Some(bad) = autosp_core::module::all_params(&model).into_iter().find(|x| x.tensor().dtype() != config.dtype)
    {
        return Err(CompileError::Input(format!(
            "parameter `{}` is {:?} but the compile dtype is {:?}: load the model in that dtype \
             (e.g. LlamaModel::load(path, dtype)) or set CompileConfig::dtype",
            bad.name(),
            bad.tensor().dtype(),
            config.dtype
        )));
    }
    let params = autosp_core::module::all_params(&model);
    if let Some(first) = params.first() {
        let want = first.tensor().device().location();
        if let Some(bad) = params.iter().find(|x| x.tensor().device().location() != want) {
            return Err(CompileError::Input(format!(
                "parameter `{}` is on {:?} but `{}` is on {want:?}: put the whole model on one device \
                 (LlamaModel::load_on(path, dtype, &device))",
                bad.name(),
                bad.tensor().device().location(),
                first.name()
            )));
        }
    }
    let resolved = strategy::resolve(config.strategy, &model.dims(), p, true)?;
    // The replicas' sequence-parallel groups: S consecutive ranks each (collective over the world).
    let sp: Arc<dyn ProcessGroup> =
        if mesh.data == 1 { world.clone() } else { world.split(&contiguous_groups(w, p)?)? };
    let (attention, attention_groups) = build_attention(&resolved, &sp)?;
    let (mut slots, mut regions) = (0, 0);
    visit_mut(&mut model, "", &mut |_, m| {
        if let Some(s) = m.attention_slot() {
            s.set(attention.clone());
            // A window asked for narrows the one the slot has (set on the model before compiling); none asked
            // for keeps it.
            s.set_max_distance(AttentionSpec::narrower(s.max_distance(), config.max_attention_distance));
            slots += 1;
        }
        if let Some(r) = m.region_slot() {
            r.set_enabled(true);
            r.set_policy(None);
            regions += 1;
        }
    });
    if slots == 0 {
        return Err(CompileError::Input(
            "the model has no attention slot: build its attention with autosp_core::AttentionSlot so compile can fill it"
                .into(),
        ));
    }
    let dims = model.dims();
    let counts = ParamCounts::of(&mut model, &dims);
    // The gather prefetch asked for on a back end that allows it: it runs at `parameters` over W > 1.
    let prefetch_allowed = config.prefetch_gathers && world.concurrent_handles();
    let trainable: Vec<_> = params.iter().filter(|p| !p.is_frozen()).cloned().collect();
    let built = sharding::built_level(&trainable, &world, config.sharding)?;
    let sharding = match (built, config.sharding, w) {
        (Some(level), Some(_), _) => (level, "asked for; the model was built sharded (build_sharded)".to_string()),
        (Some(level), None, _) => (level, "the model was built sharded (build_sharded)".to_string()),
        (None, _, 1) => (ShardLevel::None, "one rank: nothing to shard".to_string()),
        (None, Some(level), _) => (level, "asked for".to_string()),
        (None, None, _) => sharding::default_level(&counts, config.dtype, w, world.shares_memory(), prefetch_allowed),
    };
    if built.is_none() && sharding.0 != ShardLevel::None {
        // Frozen weights (LoRA's base) too: sliced at `parameters`, left whole below it (Param::shard_over).
        for param in &params {
            param.shard_over(sharding.0, world.clone())?;
        }
    }
    // A second handle on the world (collective) for the thread that reduces the gradients during backward:
    // buckets below `Gradients`, each use's reduce-scatter at `Gradients` and `Parameters`.
    let overlap = w > 1 && config.reduction.overlap;
    let reduce_group = if overlap && world.concurrent_handles() { Some(world.duplicate()?) } else { None };
    // The same for the thread that gathers the next block's weights at `parameters`, with the blocks' weights.
    let prefetch = if sharding::prefetch_runs(sharding.0, w, prefetch_allowed) {
        let mut blocks = Vec::new();
        visit_mut(&mut model, "", &mut |_, m| {
            if m.region_slot().is_some() {
                blocks.push(autosp_core::module::all_params(m));
            }
        });
        Some((world.duplicate()?, blocks))
    } else {
        None
    };
    let mut compiled = Compiled {
        model,
        world,
        sp,
        mesh,
        sharding,
        counts,
        resolved,
        checkpoint: config.checkpoint,
        dtype: config.dtype,
        attention_groups,
        max_attention_distance: config.max_attention_distance,
        reduction: config.reduction,
        reduce_group,
        prefetch,
        prefetch_allowed,
    };
    if let Checkpointing::Budget(bytes) = config.checkpoint {
        let n = config.seq_len.ok_or_else(|| {
            CompileError::Input(
                "a byte budget needs the sequence length it must fit: set CompileConfig::seq_len".into(),
            )
        })?;
        if regions == 0 {
            return Err(CompileError::Input("a byte budget needs blocks with checkpoint regions (RegionSlot)".into()));
        }
        compiled.plan_budget(bytes, n)?;
    }
    Ok(compiled)
}
