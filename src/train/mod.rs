//! The trainer a candle app uses: the training loop over a compiled model, the data it draws, durable
//! checkpoints, and the metrics it reports.
//!
//! - [`Trainer`]: one rank's loop over a [`Compiled`](crate::Compiled) Llama: micro-batches (gradients
//!   accumulated as a token-weighted mean), global-norm clipping, AdamW at a warm-up + cosine schedule
//!   ([`TrainConfig`]), the non-finite policy ([`NonFinite`]: stop naming the checkpoint kept, or skip the
//!   step), a stop flag agreed across ranks between steps ([`interrupt`] wires Ctrl-C to it), held-out scoring
//!   and probes, periodic saves, and exact resume. It prints nothing: reports go to the caller's observer as
//!   [`Event`]s (on rank 0), each of which reads as the line `llama_longctx` prints, and to a JSON-lines
//!   metrics file when asked ([`MetricsLog`]).
//! - Data: [`DataSource`] (`needles`, `passkey`, `ids:FILE`, text or JSONL), [`data`] (reading, tokenising
//!   and packing into `seq_len` sequences), [`packing`] (`--packing`: windows with their document
//!   boundaries, or document-blind), [`Stream`] (sequences with a [`Position`] for exact resume),
//!   [`Curriculum`] (shorter sequences first), and the [`synthetic`] long-range retrieval tasks.
//! - Evaluation (`eval/`, collective over the compiled model): [`HeldOut`] (held-out loss),
//!   [`answer_accuracy`] (the synthetic tasks' probes), [`PasskeyGrid`] (passkey retrieval over lengths ×
//!   depths), [`PositionLoss`] (held-out loss by position), [`picture`] (their SVGs), and [`LongContext`], the
//!   door a run scores the long-context pair through.
//! - [`checkpoint`]: `step-N` directories in the HF layout plus optimizer and trainer state, written
//!   atomically and fsynced, hashed, verified on load, under a [`SaveLock`]; exact resume.
//! - [`Summary`], [`StepRecord`]: the end-of-run table and JSON, the per-step records.
//! - [`Job`]: a whole fine-tuning run from [`RunOptions`] (model, data, resume checks, compile, train,
//!   summary): what the `llama_longctx` example runs as a thin command line.
//!
//! Errors are [`TrainError`]s, one variant per thing to do about it.
//!
//! # Example
//!
//! Train a tiny random Llama for a few steps on two thread ranks (sequence parallel), save a checkpoint,
//! and check that the loss fell and that the checkpoint verifies:
//!
//! ```
//! use std::time::Duration;
//! use autosp::core::comm::run_ranks;
//! use autosp::models::{random_weights, LlamaModel, TinySpec};
//! use autosp::train::{checkpoint, data, Stream, TrainConfig, Trainer};
//! use autosp::{compile, Checkpointing, CompileConfig, Strategy};
//! use candle_core::{DType, Device};
//!
//! let config = TinySpec::default().config();
//! let weights = random_weights(&config, 7, DType::F32, &Device::Cpu).unwrap();
//! // A token stream with a pattern to learn, packed into sequences of 64 tokens.
//! let ids: Vec<u32> = (0..1024u32).map(|i| (i * 7 + i / 64) % 50).collect();
//! let seqs = data::pack(&ids, 64, "the example stream").unwrap();
//! let dir = tempfile::tempdir().unwrap();
//!
//! let results = run_ranks(2, Duration::from_secs(60), |pg| -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
//!     let model = LlamaModel::from_weights(&config, weights.clone())?;
//!     let policy = Checkpointing::Policy(autosp::core::CheckpointPolicy::SequenceAware);
//!     let compiled = compile(model, CompileConfig::new(pg, Strategy::Auto, policy))?;
//!     let mut train = TrainConfig::new(64, 8);
//!     train.lr = 3e-3;
//!     train.warmup = 1;
//!     train.save_dir = Some(dir.path().to_path_buf());
//!     let mut trainer = Trainer::new(compiled, train, Stream::packed(seqs.clone()))?;
//!     let mut losses = Vec::new();
//!     let outcome = trainer.run(&|| false, &mut |event| {
//!         if let autosp::train::Event::Step(r) = &event {
//!             losses.push(r.loss); // `println!("{event}")` prints the step line
//!         }
//!     })?;
//!     Ok((outcome, losses))
//! });
//! let (outcome, losses) = results.into_iter().next().unwrap().unwrap().unwrap();
//! assert_eq!(losses.len(), 8, "rank 0 reports every step");
//! assert!(losses[7] < 0.5 * losses[0], "the loss fell by more than half: {losses:?}");
//! let saved = outcome.checkpoint.expect("saved at the end");
//! assert_eq!(saved, dir.path().join("step-8"));
//! let state = checkpoint::verify(&saved).unwrap();
//! assert_eq!((state.step, state.data.drawn), (8, 8));
//! LlamaModel::load(saved.to_str().unwrap(), DType::F32).unwrap();
//! ```

pub mod checkpoint;
mod config;
pub mod corpus;
mod curriculum;
pub mod data;
mod error;
mod eval;
mod events;
mod fingerprint;
mod flock;
pub mod interrupt;
mod launch;
pub mod lora;
mod metrics;
pub mod model;
mod options;
pub mod packing;
mod progress;
mod run;
mod stream;
pub mod synthetic;
mod trainer;

pub use checkpoint::{RunShape, SaveLock, Saved, TrainerState};
pub use config::{micro_batches, LossScaling, NonFinite, TrainConfig};
pub use curriculum::Curriculum;
pub use data::DataSource;
pub use error::{Result, TrainError};
pub use eval::{
    answer_accuracy, bucket_edges, model_windows, picture, Answers, Bucket, HeldOut, LongContext, LongScores,
    PasskeyCell, PasskeyGrid, PasskeyScores, PositionLoss, PositionScores, When, DEFAULT_DEPTHS, DEFAULT_SAMPLES,
};
pub use events::Event;
#[cfg(feature = "mpi")]
pub use launch::over_mpi;
pub use launch::Carrier;
pub use metrics::{Accuracy, EvalLoss, MetricsLog, Score, StepRecord, Summary, Table};
pub use options::{
    checkpoint_flag, parse_checkpointing, parse_max_attention_distance, parse_memory_budget, parse_strategy,
    strategy_flag, RunOptions,
};
pub use packing::Packing;
pub use progress::Progress;
pub use run::Job;
pub use stream::{Position, Sample, Stream};
pub use trainer::{exempt_from_decay, Ended, Outcome, Trainer, STAGE_PROBES};
