//! [`RunOptions`]: the settings of a whole fine-tuning run ([`super::Job`]) as `llama_longctx`'s options
//! give them, with its defaults; and the command-line spelling of the compile settings a run takes (strategy,
//! checkpointing, attention window), parsed and printed back.

use std::path::PathBuf;

use autosp_core::{CheckpointPolicy, ShardLevel};
use candle_core::DType;

use crate::compile::{Checkpointing, Strategy};
use crate::device::DeviceSpec;

/// The learning rate of a LoRA run on a model the user brings, when `--lr` is not given: PEFT's and TRL's usual
/// LoRA rate, ten times a full fine-tune's (the update starts at zero and is low rank).
pub const DEFAULT_LORA_LR: f64 = 2e-4;

/// The settings of a fine-tuning run, one per `llama_longctx` option (see its `--help` for each); the
/// defaults are the options' defaults.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// `--model`: a directory, a hub id `owner/name[@revision]` or a `.gguf` file; `None`: the tiny random Llama.
    pub model: Option<String>,
    /// `--seq-len`: tokens per training sequence.
    pub seq_len: usize,
    /// `--dp`: data-parallel replicas D (the ranks split into D replicas of S = ranks / D sequence ranks).
    pub dp: usize,
    /// `--shard`: how model states are sharded over the ranks; `None`: chosen by the model's size.
    pub shard: Option<ShardLevel>,
    /// `--reduce-dtype` and `--bucket-mb`: how gradients are reduced over the ranks.
    pub reduction: crate::compile::GradReduction,
    /// At `--shard parameters`, gather the next block's weights while a block computes
    /// ([`crate::compile::CompileConfig::prefetch_gathers`]); `--no-prefetch-gathers` turns it off.
    pub prefetch_gathers: bool,
    /// `--memory-budget`: the bytes the ranks of this host may hold for model states; a run that gives it,
    /// or resumes a checkpoint (then against the host's available memory when not given), is refused before
    /// any rank allocates when the accounting exceeds it.
    pub memory_budget: Option<u64>,
    /// `--strategy`.
    pub strategy: Strategy,
    /// `--checkpoint`.
    pub checkpoint: Checkpointing,
    /// `--dtype`; `None`: the device's default ([`crate::precision::default_dtype`]).
    pub dtype: Option<DType>,
    /// `--max-attention-distance`.
    pub max_attention_distance: Option<usize>,
    /// `--rope-scaling`: extend the model's context window ([`autosp_models::RopeExtension`]); `None`: the
    /// model's own positions.
    pub rope_scaling: Option<autosp_models::RopeExtension>,
    /// `--steps`.
    pub steps: usize,
    /// `--lr`; `None`: [`RunOptions::default_lr`].
    pub lr: Option<f64>,
    /// `--decay-all`: weight decay on norms, biases and embeddings too (with `--model` they are left out).
    pub decay_all: bool,
    /// `--warmup`.
    pub warmup: usize,
    /// `--grad-clip` (0: off).
    pub grad_clip: f64,
    /// `--batch-tokens`; `None`: one sequence per step.
    pub batch_tokens: Option<usize>,
    /// `--data`: `needles`, `passkey`, `ids:FILE`, or a text/JSONL file.
    pub data: String,
    /// `--curriculum` (needles only); `None`: [`super::Curriculum::default_for`].
    pub curriculum: Option<String>,
    /// `--save`; `None`: the --resume checkpoint's directory, else `runs/latest` under the autosp cache.
    pub save: Option<PathBuf>,
    /// `--save-every` (0: only at the end and when stopped).
    pub save_every: usize,
    /// `--resume`: a `.../step-N` checkpoint.
    pub resume: Option<PathBuf>,
    /// `--allow-changes`.
    pub allow_changes: bool,
    /// `--skip-nonfinite`.
    pub skip_nonfinite: bool,
    /// `--loss-scale` (f16's dynamic loss scaling by default).
    pub loss_scale: super::LossScaling,
    /// `--eval-tokens`: score these ids and stop.
    pub eval_tokens: Option<PathBuf>,
    /// `--eval-data`.
    pub eval_data: Option<String>,
    /// `--eval-every`.
    pub eval_every: usize,
    /// `--eval-tokens-max`: the most held-out tokens `--eval-data` scores (in `seq_len` windows).
    pub eval_tokens_max: usize,
    /// `--eval-passkey LENGTHS`: the passkey grid's prompt lengths, comma-separated ([`super::PasskeyGrid`]).
    pub eval_passkey: Option<String>,
    /// `--eval-depths`: its needle depths in percent; `None`: [`super::DEFAULT_DEPTHS`].
    pub eval_depths: Option<String>,
    /// `--eval-samples`: its keys per cell; `None`: [`super::DEFAULT_SAMPLES`].
    pub eval_samples: Option<usize>,
    /// `--eval-passkey-generate`: also score the passkey grid by greedy generation (exact key digits).
    pub eval_passkey_generate: bool,
    /// `--eval-positions`: the held-out loss by position ([`super::PositionLoss`]).
    pub eval_positions: bool,
    /// `--dump-grads`.
    pub dump_grads: Option<PathBuf>,
    /// `--seed`.
    pub seed: u64,
    /// `--metrics`.
    pub metrics: Option<PathBuf>,
    /// `--explain`: report the compiled plan and stop.
    pub explain: bool,
    /// `--quick`: fewer probes (the CLI also shortens the run).
    pub quick: bool,
    /// `--device`; `None`: [`DeviceSpec::default_for_build`].
    pub device: Option<DeviceSpec>,
    /// `--lora R[:ALPHA]`: train LoRA adapters of rank R on the frozen model ([`super::lora`]).
    pub lora: Option<String>,
    /// `--lora-targets`: the projections adapted (`q,k,v,o,gate,up,down`; default all of them).
    pub lora_targets: Option<String>,
    /// `--lora-dropout` (default 0).
    pub lora_dropout: Option<f32>,
    /// `--lora-train`: `embed`, `norm` or both, trained beside the adapters.
    pub lora_train: Option<String>,
    /// `--lora-adapter DIR`: start from a saved adapter (PEFT's layout) on `--model`.
    pub lora_adapter: Option<PathBuf>,
    /// `--merge-lora DIR`: write the base with the final adapter merged in, as an HF checkpoint.
    pub merge_lora: Option<PathBuf>,
    /// `--chat-layout`: how conversations fill the training windows (pack or truncate).
    pub chat_layout: super::corpus::ChatLayout,
    /// `--packing`: windows with their document boundaries or document-blind ([`super::Packing`]); `None`:
    /// documents for text, JSONL and chat data, stream for `ids:` files ([`super::DataSource::packing`]).
    pub packing: Option<super::Packing>,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            model: None,
            seq_len: 4096,
            dp: 1,
            shard: None,
            reduction: crate::compile::GradReduction::default(),
            prefetch_gathers: true,
            memory_budget: None,
            strategy: Strategy::Auto,
            checkpoint: Checkpointing::Policy(CheckpointPolicy::SequenceAware),
            dtype: None,
            max_attention_distance: None,
            rope_scaling: None,
            steps: 200,
            lr: None,
            decay_all: false,
            warmup: 10,
            grad_clip: 1.0,
            batch_tokens: None,
            data: "needles".into(),
            curriculum: None,
            save: None,
            save_every: 0,
            resume: None,
            allow_changes: false,
            skip_nonfinite: false,
            loss_scale: super::LossScaling::Auto,
            eval_tokens: None,
            eval_data: None,
            eval_every: 0,
            eval_tokens_max: 65536,
            eval_passkey: None,
            eval_depths: None,
            eval_samples: None,
            eval_passkey_generate: false,
            eval_positions: false,
            dump_grads: None,
            seed: 0,
            metrics: None,
            explain: false,
            quick: false,
            device: None,
            lora: None,
            lora_targets: None,
            lora_dropout: None,
            lora_train: None,
            lora_adapter: None,
            merge_lora: None,
            chat_layout: super::corpus::ChatLayout::Pack,
            packing: None,
        }
    }
}

impl RunOptions {
    /// The learning rate of a run that does not give `--lr` and resumes nothing: for a model the user brings
    /// (`pretrained`), 2e-5 (the usual rate for fine-tuning a 0.1-8B model whole, as TRL's SFT default) or, with
    /// LoRA (`lora`), [`DEFAULT_LORA_LR`]; 1e-2 for the built-in demo model, which trains from
    /// random weights.
    pub fn default_lr(pretrained: bool, lora: bool) -> f64 {
        match (pretrained, lora) {
            (true, true) => DEFAULT_LORA_LR,
            (true, false) => 2e-5,
            (false, _) => 1e-2,
        }
    }

    /// The device asked for, or the build's default.
    pub fn device_spec(&self) -> DeviceSpec {
        self.device.unwrap_or_else(DeviceSpec::default_for_build)
    }

    /// Sequence-parallel thread ranks when `--sp` is not given: 2 on the CPU (each rank runs its kernels on its
    /// share of the cores), 1 on a GPU. Thread ranks on one GPU gain nothing and cost much: each holds a whole
    /// replica of the model states (P times their memory unless `--shard` splits them), and they would race:
    /// candle runs each thread on its own CUDA stream while the ranks hand tensors to each other unordered, so
    /// more than one thread rank on a CUDA device is refused ([`DeviceSpec::check_thread_ranks`]); more ranks
    /// are for more GPUs (`--launcher mpi`, one process per GPU).
    pub fn default_sp_threads(&self) -> usize {
        match self.device_spec() {
            DeviceSpec::Cpu => 2,
            DeviceSpec::Cuda(_) | DeviceSpec::Metal(_) => 1,
        }
    }

    /// The compute dtype: `dtype`, else the device's default (f32 on the CPU, bf16 on a GPU).
    pub fn compute_dtype(&self) -> DType {
        self.dtype.unwrap_or_else(|| crate::precision::default_dtype(&self.device_spec()))
    }
}

/// `--max-attention-distance D`: a whole number of positions, 0 or more.
pub fn parse_max_attention_distance(s: &str) -> Result<usize, String> {
    s.trim().parse::<usize>().map_err(|_| {
        format!(
            "`{s}` is not a distance: give a whole number of tokens, 0 or more (0: each token sees only itself; \
             leave the flag out for no window)"
        )
    })
}

/// `ulysses`, `ring`, `hybrid:U`, `auto`.
pub fn parse_strategy(s: &str) -> Result<Strategy, String> {
    match s.to_ascii_lowercase().as_str() {
        "ulysses" => Ok(Strategy::Ulysses),
        "ring" => Ok(Strategy::Ring),
        "auto" => Ok(Strategy::Auto),
        other => match other.strip_prefix("hybrid:").map(str::parse::<usize>) {
            Some(Ok(u)) if u >= 1 => Ok(Strategy::Hybrid { ulysses: u }),
            _ => Err(format!("unknown strategy `{s}`: use ulysses, ring, hybrid:U (U = Ulysses degree) or auto")),
        },
    }
}

/// How `strategy` is spelled on the command line (the inverse of [`parse_strategy`]).
pub fn strategy_flag(strategy: Strategy) -> String {
    match strategy {
        Strategy::Ulysses => "ulysses".into(),
        Strategy::Ring => "ring".into(),
        Strategy::Auto => "auto".into(),
        Strategy::Hybrid { ulysses } => format!("hybrid:{ulysses}"),
    }
}

/// How `checkpointing` is spelled on the command line (the inverse of [`parse_checkpointing`]).
pub fn checkpoint_flag(checkpointing: Checkpointing) -> String {
    match checkpointing {
        Checkpointing::Policy(CheckpointPolicy::None) => "none".into(),
        Checkpointing::Policy(CheckpointPolicy::Full) => "full".into(),
        Checkpointing::Policy(CheckpointPolicy::SequenceAware) => "sequence-aware".into(),
        Checkpointing::Budget(bytes) => bytes.to_string(),
    }
}

/// A memory budget in bytes, such as `68719476736`, `64GiB`, `60G` (the byte forms `--checkpoint` takes).
pub fn parse_memory_budget(s: &str) -> Result<u64, String> {
    match parse_checkpointing(s) {
        Ok(Checkpointing::Budget(b)) => Ok(b as u64),
        _ => Err(format!("--memory-budget `{s}` is not a byte count: give one such as 64GiB, 60G or 68719476736")),
    }
}

/// `none`, `full`, `sequence-aware`, or a byte budget such as `268435456`, `256MiB`, `2G`.
pub fn parse_checkpointing(s: &str) -> Result<Checkpointing, String> {
    match s.to_ascii_lowercase().as_str() {
        "none" => return Ok(Checkpointing::Policy(CheckpointPolicy::None)),
        "full" => return Ok(Checkpointing::Policy(CheckpointPolicy::Full)),
        "sequence-aware" | "sequence_aware" | "sac" => {
            return Ok(Checkpointing::Policy(CheckpointPolicy::SequenceAware))
        }
        _ => {}
    }
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        _ => usize::MAX,
    };
    match num.parse::<usize>() {
        Ok(n) if mult != usize::MAX && n > 0 => Ok(Checkpointing::Budget(n.saturating_mul(mult))),
        _ => {
            Err(format!("unknown checkpointing `{s}`: use none, full, sequence-aware, or a byte budget such as 512MiB"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_budgets_parse_as_byte_counts() {
        assert_eq!(parse_memory_budget("64GiB"), Ok(64 << 30));
        assert_eq!(parse_memory_budget("60G"), Ok(60_000_000_000));
        assert_eq!(parse_memory_budget("1024"), Ok(1024));
        for bad in ["none", "full", "lots", "-3G"] {
            assert!(parse_memory_budget(bad).unwrap_err().contains("--memory-budget"), "{bad}");
        }
    }

    #[test]
    fn thread_ranks_default_to_two_on_the_cpu_and_one_on_a_gpu() {
        let on = |device| RunOptions { device: Some(device), ..RunOptions::default() }.default_sp_threads();
        assert_eq!(on(DeviceSpec::Cpu), 2);
        assert_eq!(on(DeviceSpec::Cuda(None)), 1);
        assert_eq!(on(DeviceSpec::Metal(0)), 1);
    }

    #[test]
    fn strategies_and_checkpointing_parse_and_print_back() {
        for s in ["ulysses", "ring", "auto", "hybrid:2"] {
            assert_eq!(strategy_flag(parse_strategy(s).unwrap()), s);
        }
        assert!(parse_strategy("hybrid:0").is_err() && parse_strategy("diagonal").is_err());
        for s in ["none", "full", "sequence-aware", "1048576"] {
            assert_eq!(checkpoint_flag(parse_checkpointing(s).unwrap()), s);
        }
        assert_eq!(parse_checkpointing("256MiB").unwrap(), Checkpointing::Budget(256 << 20));
        assert_eq!(parse_checkpointing("2G").unwrap(), Checkpointing::Budget(2_000_000_000));
        assert!(parse_checkpointing("0").is_err() && parse_checkpointing("12 parsecs").is_err());
        assert_eq!(parse_max_attention_distance(" 16 "), Ok(16));
        assert!(parse_max_attention_distance("-3").unwrap_err().contains("`-3` is not a distance"));
    }
}
