//! What the compile step is asked for: the ranks (the process group) and their mesh (data × sequence), the
//! strategy, the checkpoint policy or byte budget, the dtype, how model states are sharded, how gradients are
//! reduced, and an optional sliding attention window.

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

/// How a step reduces the gradients over the world (at `--shard none` and `optimizer`; at `gradients` and
/// `parameters` the tape reduce-scatters each use's gradient in f32 as backward makes it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradReduction {
    /// The dtype the gradients travel in: f32 (the default) or bf16, which halves the bytes sent. The sum is
    /// taken in f32 after each receive (the threads and MPI back ends reduce bf16 in f32 and round the
    /// reduced chunk once to bf16 before handing it back), and the result is f32 again. NCCL widens bf16 to
    /// f32 before its own sum, so there the bytes sent stay f32's.
    /// f64 gradients (f64 checks) always travel in f64.
    pub dtype: DType,
    /// The bytes of f32 gradient per bucket (one collective each; a larger parameter is a bucket of its own).
    /// At `Gradients` and `Parameters`, where each use's gradient is reduce-scattered in backward, the most
    /// bytes of whole gradients in flight to the communication thread (or one larger gradient).
    pub bucket_bytes: usize,
    /// Post each bucket's reduction as soon as backward made every gradient in it (at `Gradients` and
    /// `Parameters`: each use's reduce-scatter), on a communication thread, while backward goes on, where the
    /// back end allows two handles at once ([`ProcessGroup::concurrent_handles`]: thread ranks, MPI processes,
    /// NCCL with `NCCL_RUNTIME_CONNECT=0`). `false`: buckets after backward, reduce-scatters inline.
    pub overlap: bool,
}

impl Default for GradReduction {
    /// f32, 16 MiB buckets, overlapped.
    fn default() -> Self {
        Self { dtype: DType::F32, bucket_bytes: 16 << 20, overlap: true }
    }
}

impl GradReduction {
    /// Gradient elements per bucket (`bucket_bytes` of f32, at least one).
    pub fn bucket_elems(&self) -> usize {
        (self.bucket_bytes / 4).max(1)
    }

    /// `--reduce-dtype`: `f32` or `bf16`.
    pub fn parse_dtype(s: &str) -> Result<DType, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            _ => Err(format!("--reduce-dtype `{s}`: use f32 (the default) or bf16 (half the reduction bytes)")),
        }
    }

    /// `--bucket-mb`: MiB of f32 gradient per reduction bucket, more than 0 (fractions allowed) -> bytes.
    pub fn parse_bucket_mb(s: &str) -> Result<usize, String> {
        match s.trim().parse::<f64>() {
            Ok(mb) if mb.is_finite() && mb * 1048576.0 >= 4.0 => Ok((mb * 1048576.0) as usize),
            _ => Err(format!("--bucket-mb `{s}`: give the MiB of f32 gradient per bucket, more than 0 (default 16)")),
        }
    }

    /// Refuses a dtype other than f32 and bf16, and an empty bucket, naming the option.
    pub fn check(&self) -> Result<(), super::CompileError> {
        if !matches!(self.dtype, DType::F32 | DType::BF16) {
            return Err(super::CompileError::Input(format!(
                "gradient reduction dtype (--reduce-dtype, GradReduction::dtype) {:?}: use f32 or bf16",
                self.dtype
            )));
        }
        if self.bucket_bytes < 4 {
            return Err(super::CompileError::Input(format!(
                "gradient bucket size (--bucket-mb, GradReduction::bucket_bytes) {} bytes holds no f32 gradient:                  use at least 4 bytes (the default is 16 MiB)",
                self.bucket_bytes
            )));
        }
        Ok(())
    }
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
    /// How the gradients are reduced over the world: dtype, bucket size, overlap with backward.
    pub reduction: GradReduction,
    /// At `--shard parameters`, gather the next block's weights on a communication thread while the current
    /// block computes (forward, and backward's replay in reverse), at most two blocks whole at once
    /// ([`autosp_core::gather_prefetch`]), where the back end allows two handles at once
    /// ([`ProcessGroup::concurrent_handles`]: thread ranks, MPI processes, NCCL with `NCCL_RUNTIME_CONNECT=0`).
    /// On by default; `false`: always gathered at the use.
    pub prefetch_gathers: bool,
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
            reduction: GradReduction::default(),
            prefetch_gathers: true,
        }
    }

    /// The same configuration with the gather prefetch at `parameters` on or off (see
    /// [`CompileConfig::prefetch_gathers`]).
    pub fn with_prefetch_gathers(mut self, on: bool) -> Self {
        self.prefetch_gathers = on;
        self
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

    /// The same configuration reducing the gradients as `reduction` says (see [`GradReduction`]).
    pub fn with_reduction(mut self, reduction: GradReduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// The same configuration with a sliding attention window of `distance` positions (`None`: none; see
    /// [`CompileConfig::max_attention_distance`]).
    pub fn with_max_attention_distance(mut self, distance: Option<usize>) -> Self {
        self.max_attention_distance = distance;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduction_flags_parse_and_bad_ones_name_the_option() {
        assert_eq!(GradReduction::parse_dtype(" BF16"), Ok(DType::BF16));
        assert_eq!(GradReduction::parse_dtype("f32"), Ok(DType::F32));
        assert!(GradReduction::parse_dtype("f16").unwrap_err().contains("--reduce-dtype `f16`"));
        assert_eq!(GradReduction::parse_bucket_mb("16"), Ok(16 << 20));
        assert_eq!(GradReduction::parse_bucket_mb("0.5"), Ok(1 << 19));
        for bad in ["0", "-1", "lots", "inf"] {
            assert!(GradReduction::parse_bucket_mb(bad).unwrap_err().contains("--bucket-mb"), "{bad}");
        }
        assert_eq!(GradReduction::default().bucket_elems(), 1 << 22);
        assert!(GradReduction { dtype: DType::F64, ..GradReduction::default() }.check().is_err());
        assert!(GradReduction::default().check().is_ok());
    }
}
