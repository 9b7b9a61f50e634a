//! [`TrainConfig`]: the settings of a training loop (sequence length, steps, learning-rate schedule,
//! clipping, micro-batches, curriculum, the non-finite policy, when to evaluate and save, and where files
//! go), with the defaults `llama_longctx` uses.

use std::path::PathBuf;

use autosp_core::optim::loss_scale::{GROWTH_INTERVAL, INIT_SCALE};
use autosp_core::optim::{AdamWConfig, LossScaler, LrSchedule};
use candle_core::DType;

use super::curriculum::Curriculum;
use super::error::{Result, TrainError};

/// What to do with a step whose loss or gradient norm is NaN or infinite. Loss and gradients are
/// all-reduced, so every rank sees the same values and decides alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NonFinite {
    /// Stop with [`TrainError::NonFinite`], naming the newest checkpoint kept; nothing of the step is applied
    /// or saved.
    #[default]
    Stop,
    /// Skip the step (no update; reported as [`super::Event::Skipped`]) and go on.
    Skip,
}

/// Loss scaling ([`LossScaler`]: the loss multiplied by a power of two before backward, the gradients divided
/// after; a step whose gradients overflow is skipped and the scale halved).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum LossScaling {
    /// Dynamic scaling from 2^16, doubling every 2000 good steps (PyTorch's `GradScaler`), when the model
    /// computes in f16; none in bf16 and f32, whose exponent range needs none.
    #[default]
    Auto,
    /// No scaling (an f16 run then keeps its per-token gradients near or under f16's subnormals).
    Off,
    /// Dynamic scaling from `init` (a power of two), doubling after `growth_interval` good steps in a row.
    Dynamic {
        /// The first scale.
        init: f64,
        /// Good steps in a row before the scale doubles.
        growth_interval: u32,
    },
}

impl LossScaling {
    /// Parses `--loss-scale`: `auto`, `off`, or `INIT[:INTERVAL]` (`65536`, `1024:100`).
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "off" | "none" => Ok(Self::Off),
            other => {
                let (init, interval) = other.split_once(':').unwrap_or((other, ""));
                let init: f64 =
                    init.parse().map_err(|_| format!("--loss-scale {other:?}: use auto, off or INIT[:INTERVAL]"))?;
                let growth_interval = match interval {
                    "" => GROWTH_INTERVAL,
                    i => i
                        .parse()
                        .map_err(|_| format!("--loss-scale {other:?}: INTERVAL must be a whole number of steps"))?,
                };
                LossScaler::new(init, growth_interval).map_err(|e| format!("--loss-scale {other:?}: {e}"))?;
                Ok(Self::Dynamic { init, growth_interval })
            }
        }
    }

    /// The scaler a run computing in `dtype` starts with (`None`: no scaling).
    pub fn scaler(self, dtype: DType) -> Result<Option<LossScaler>> {
        let (init, interval) = match self {
            Self::Off => return Ok(None),
            Self::Auto if dtype != DType::F16 => return Ok(None),
            Self::Auto => (INIT_SCALE, GROWTH_INTERVAL),
            Self::Dynamic { init, growth_interval } => (init, growth_interval),
        };
        LossScaler::new(init, interval).map(Some).map_err(|e| TrainError::Config(format!("--loss-scale: {e}")))
    }
}

/// The settings of a training loop.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Tokens per training sequence: each micro-batch is a `[seq_len / len, len]` batch of token ids, `len`
    /// the curriculum's length of the step (`seq_len` without a curriculum).
    pub seq_len: usize,
    /// Optimizer steps of the whole run (a resumed run goes on to this step).
    pub steps: usize,
    /// Peak learning rate (AdamW): linear warm-up to it, then cosine decay to `lr / 10` at the last step.
    pub lr: f64,
    /// Warm-up steps (at most `steps`).
    pub warmup: usize,
    /// Clip the gradients' global L2 norm to this (0 turns clipping off).
    pub grad_clip: f64,
    /// Micro-batches per optimizer step; their gradients are accumulated as a token-weighted mean.
    pub micro_batches: usize,
    /// Sequence lengths before `seq_len` (shorter sequences, as many per micro-batch as fit in `seq_len`).
    pub curriculum: Curriculum,
    /// Non-finite loss or gradient norm: stop or skip.
    pub nonfinite: NonFinite,
    /// Loss scaling (dynamic in f16 by default).
    pub loss_scale: LossScaling,
    /// Save a checkpoint every N steps (0: only at the end, and when stopped). Needs `save_dir`.
    pub save_every: usize,
    /// Score the held-out tokens every N steps (0: never during training).
    pub eval_every: usize,
    /// AdamW's betas, epsilon and weight decay.
    pub adamw: AdamWConfig,
    /// Whether weight decay falls on every parameter (`true`), or only on the matrices of the projections
    /// and the untied LM head (`false`: norms, biases and the embedding are not decayed, as fine-tuning
    /// recipes do; `llama_longctx` with `--model`).
    pub decay_all: bool,
    /// What the data is, as checkpoints record it (a resume with other data is refused).
    pub data: String,
    /// The data's seed, as checkpoints record it.
    pub seed: u64,
    /// Where checkpoints go (`save_dir/step-N`); `None`: the trainer saves nothing by itself.
    pub save_dir: Option<PathBuf>,
    /// A JSON-lines file that rank 0 appends one line per step (and per evaluation) to.
    pub metrics: Option<PathBuf>,
    /// Write the first step's gradients (of the mean token loss, before clipping; HF names) as safetensors here.
    pub dump_grads: Option<PathBuf>,
    /// The base model of a LoRA run (`--model` as given), which checkpoints name in `adapter_config.json` and
    /// `trainer_state.json`; `None` for full fine-tuning.
    pub base_model: Option<String>,
    /// The RoPE extension the run's model got (`--rope-scaling`, as it spells it), which checkpoints record so
    /// that a resumed run neither applies it twice (a full checkpoint's config.json holds it already) nor
    /// loses it (a LoRA checkpoint's base is loaded from its own files); `None`: none asked for.
    pub rope_scaling: Option<String>,
}

impl TrainConfig {
    /// `steps` steps on sequences of `seq_len` tokens, with `llama_longctx`'s defaults: lr 1e-2, 10 warm-up
    /// steps (at most `steps`), clipping at 1.0, one micro-batch, no curriculum, stop on non-finite, dynamic
    /// loss scaling in f16 only, no periodic saves or evaluations, AdamW's default betas, nothing written.
    pub fn new(seq_len: usize, steps: usize) -> Self {
        Self {
            seq_len,
            steps,
            lr: 1e-2,
            warmup: 10.min(steps),
            grad_clip: 1.0,
            micro_batches: 1,
            curriculum: Curriculum::none(),
            nonfinite: NonFinite::Stop,
            loss_scale: LossScaling::Auto,
            save_every: 0,
            eval_every: 0,
            adamw: AdamWConfig::default(),
            decay_all: true,
            data: String::new(),
            seed: 0,
            save_dir: None,
            metrics: None,
            dump_grads: None,
            base_model: None,
            rope_scaling: None,
        }
    }

    /// Linear warm-up to `lr`, then cosine decay to `lr / 10` at the last step.
    pub fn schedule(&self) -> LrSchedule {
        LrSchedule::WarmupCosine {
            peak: self.lr,
            min_lr: self.lr / 10.0,
            warmup: self.warmup.min(self.steps),
            total: self.steps,
        }
    }

    /// Tokens per optimizer step: `seq_len * micro_batches`.
    pub fn tokens_per_step(&self) -> usize {
        self.seq_len * self.micro_batches
    }

    /// Checks the settings against each other ([`TrainError::Config`] naming the fix).
    pub fn validate(&self) -> Result<()> {
        if self.seq_len < 2 {
            return Err(TrainError::Config(format!(
                "--seq-len {}: a training sequence needs at least 2 tokens (an input and its next token); give \
                 --seq-len 2 or more",
                self.seq_len
            )));
        }
        if self.micro_batches == 0 {
            return Err(TrainError::Config("micro_batches is 0: a step needs at least one micro-batch".into()));
        }
        self.curriculum.validate(self.seq_len)?;
        self.schedule().validate().map_err(|e| TrainError::Config(format!("--lr / --warmup / --steps: {e}")))?;
        if self.save_every > 0 && self.save_dir.is_none() {
            return Err(TrainError::Config(format!(
                "save_every is {} but there is no save_dir: give the directory checkpoints go to",
                self.save_every
            )));
        }
        Ok(())
    }
}

/// Micro-batches per step for `batch_tokens` tokens per step (`--batch-tokens`; `None`: one sequence).
pub fn micro_batches(batch_tokens: Option<usize>, seq_len: usize) -> Result<usize> {
    match batch_tokens {
        None => Ok(1),
        Some(t) if t == 0 || t % seq_len != 0 => Err(TrainError::Config(format!(
            "--batch-tokens {t} must be a positive multiple of --seq-len {seq_len} (each micro-batch is one sequence)"
        ))),
        Some(t) => Ok(t / seq_len),
    }
}
