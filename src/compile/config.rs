//! What the compile step is asked for: the ranks (the process group) and their mesh (data × sequence), the
//! strategy, the checkpoint policy or byte budget, the dtype, how model states are sharded, and an optional
//! sliding attention window.

use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::shard::ShardLevel;
use autosp_core::CheckpointPolicy;
use candle_core::DType;

use super::mesh::Mesh;

/// How attention is made whole across the ranks of the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// All-to-all of heads and sequence (DeepSpeed-Ulysses). Needs heads divisible by P.
    Ulysses,
    /// K/V blocks passed around a ring (zigzag layout when causal). Any head count.
    Ring,
    /// Ulysses inside groups of `ulysses` ranks, Ring across the groups.
    Hybrid {
        /// The Ulysses degree u (P = u * ring degree).
        ulysses: usize,
    },
    /// Chosen from the head counts and P; `explain()` says why.
    Auto,
}

/// What activation memory the step keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpointing {
    /// One policy for every block.
    Policy(CheckpointPolicy),
    /// A per-rank byte budget for the tape: the planner picks a policy per block (keeping the most that fits,
    /// recomputing the cheapest work first).
    Budget(usize),
}

/// The compile step's configuration.
#[derive(Clone, Debug)]
pub struct CompileConfig {
    /// Every rank of the run (the world, W ranks). Without a [`mesh`](Self::mesh) all of them split each
    /// sequence (P = W).
    pub group: Arc<dyn ProcessGroup>,
    /// How the world splits into data-parallel replicas × sequence-parallel ranks; `None`: `1 × W`.
    pub mesh: Option<Mesh>,
    /// How model states are sharded over the world ([`ShardLevel`]); `None`: chosen by the model's size
    /// (`explain()` says which and why).
    pub sharding: Option<ShardLevel>,
    /// The strategy.
    pub strategy: Strategy,
    /// The checkpointing.
    pub checkpoint: Checkpointing,
    /// The compute dtype: the dtype of the model's parameters and of the activations the step computes in
    /// (f32 by default; bf16 or f16 for mixed precision, f64 for checks). Compile checks that every parameter
    /// has it (load the model in it: `LlamaModel::load(path, dtype)`). Whatever it is, softmax statistics,
    /// the LSE, the loss and token counts stay f32 (f64 under f64), gradients are all-reduced and handed to
    /// the optimiser in f32, and the optimiser keeps f32 master weights and moments (`AdamW::master`).
    pub dtype: DType,
    /// The sequence length a byte budget must fit (needed for `Checkpointing::Budget`).
    pub seq_len: Option<usize>,
    /// A sliding attention window: when `Some(d)`, every attention of the compiled model (training steps and
    /// logits alike) lets the token at position `p` see only the tokens at positions `p - d ..= p` (`d = 0`:
    /// itself only), on top of the model's causal mask; key tiles and Ring blocks out of reach are skipped,
    /// not computed. `None` (the default): no window beyond the model's own (a window a layer has from its
    /// checkpoint, Mistral's or Qwen's `sliding_window`, always stays; `Some(d)` narrows it). The control
    /// that shows whether a task uses context further away than `d` (`llama_longctx
    /// --max-attention-distance`).
    pub max_attention_distance: Option<usize>,
    /// LoRA adapters to add before compiling ([`autosp_core::lora::add_lora`]: the base freezes, the target
    /// linears get adapters); `None`: the model as it is (which may have adapters already).
    pub lora: Option<autosp_core::lora::LoraConfig>,
    /// A context extension applied to the model before anything else
    /// ([`LlamaModel::extend_rope`](autosp_models::LlamaModel::extend_rope): its config's `rope_scaling` and
    /// `max_position_embeddings`, and its RoPE frequencies); `None`: the model's own positions. Only a
    /// [`LlamaModel`](autosp_models::LlamaModel) takes it (another model sets the scaling on its own config).
    /// The trainer saves the compiled model's config, so every checkpoint carries the scaling;
    /// `TrainConfig::rope_scaling` only records the option's spelling, so that a resumed run does not apply it
    /// twice.
    pub rope_scaling: Option<autosp_models::RopeExtension>,
}

impl CompileConfig {
    /// Ulysses/Ring/Hybrid/Auto with a policy, f32.
    pub fn new(group: Arc<dyn ProcessGroup>, strategy: Strategy, checkpoint: Checkpointing) -> Self {
        Self {
            group,
            mesh: None,
            sharding: None,
            strategy,
            checkpoint,
            dtype: DType::F32,
            seq_len: None,
            max_attention_distance: None,
            lora: None,
            rope_scaling: None,
        }
    }

    /// The same configuration adding LoRA adapters to the model (see [`CompileConfig::lora`]). Every rank adds
    /// the same ones (their initialisation is seeded by `lora.seed`).
    pub fn with_lora(mut self, lora: autosp_core::lora::LoraConfig) -> Self {
        self.lora = Some(lora);
        self
    }

    /// The same configuration extending the model's context window (see [`CompileConfig::rope_scaling`]).
    pub fn with_rope_scaling(mut self, extension: autosp_models::RopeExtension) -> Self {
        self.rope_scaling = Some(extension);
        self
    }

    /// The same configuration on a data × sequence mesh (D·S must be the group's size).
    pub fn with_mesh(mut self, mesh: Mesh) -> Self {
        self.mesh = Some(mesh);
        self
    }

    /// The same configuration with model states sharded at `level` over the whole world.
    pub fn with_sharding(mut self, level: ShardLevel) -> Self {
        self.sharding = Some(level);
        self
    }

    /// The same configuration computing in `dtype` (f32, bf16, f16 or f64; see [`CompileConfig::dtype`]).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// The same configuration with a sliding attention window of `distance` positions (`None`: none; see
    /// [`CompileConfig::max_attention_distance`]).
    pub fn with_max_attention_distance(mut self, distance: Option<usize>) -> Self {
        self.max_attention_distance = distance;
        self
    }
}
