//! [`Trainer`]: the training loop of one rank over a compiled model. Each optimizer step draws
//! `micro_batches` micro-batches from the [`Stream`] (at the curriculum's length), runs the compiled model's
//! sharded step on each (with the loss scaled for backward in f16: [`super::LossScaling`]) and accumulates their
//! gradients as a token-weighted mean, skips a step whose f16 gradients overflowed (halving the scale), applies
//! the non-finite policy, clips the global gradient norm, and takes an AdamW step at the warm-up + cosine schedule's rate.
//! Between steps it checks the caller's stop flag (agreed across ranks with one all-reduce), scores probes at
//! the end of each curriculum stage and the held-out tokens every `eval_every` steps, and saves every
//! `save_every` steps; rank 0 reports to the caller's observer ([`Event`]) and appends the metrics file.
//! Every rank runs the same loop (the collectives inside need them all).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use autosp_core::comm::{ProcessGroup, ReduceOp};
use autosp_core::optim::{clip_to_norm, AdamW, LossScaler, Optimizer, ScaleStep};
use autosp_core::{Gradients, Param, TrackingAllocator};
use autosp_core::{Precision, ShardLevel};
use autosp_models::LlamaModel;
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::checkpoint::{self, RunShape, Saved, TrainerState};
use super::config::{NonFinite, TrainConfig};
use super::error::{Result, TrainError};
use super::eval::{answer_accuracy, HeldOut, LongContext, LongScores, When};
use super::events::Event;
use super::metrics::{MetricsLog, StepRecord};
use super::stream::{Sample, Stream};
use crate::compile::Accumulation;
use crate::Compiled;

/// Probes scored at the end of each curriculum stage (the first ones of the probe set).
pub const STAGE_PROBES: usize = 4;

/// How a run of the loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Every step of the run is done.
    Done,
    /// The stop flag was raised (on any rank) between two steps.
    Interrupted,
}

/// What [`Trainer::run`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// Whether it finished or was stopped.
    pub ended: Ended,
    /// The step it started from (0, or the resumed checkpoint's).
    pub first_step: usize,
    /// The step it ended at.
    pub last_step: usize,
    /// The loss of the first and of the last step it applied (none when it applied none).
    pub loss: Option<(f64, f64)>,
    /// Tokens trained on and the seconds the applied steps took.
    pub tokens: usize,
    /// Seconds of the applied steps.
    pub seconds: f64,
    /// The tape's peak bytes on each rank, over the run.
    pub tape_peak: Vec<f64>,
    /// The process heap's peak bytes on each rank (0 without a tracking allocator).
    pub heap_peak: Vec<f64>,
    /// On a GPU, the device-memory peak on each rank ([`crate::device::device_memory_peak`]); `None` on the
    /// CPU.
    pub device_peak: Option<Vec<f64>>,
    /// Steps skipped for a non-finite loss or gradient norm.
    pub skipped: usize,
    /// Training windows drawn that held no trainable target (a chat window without an assistant token): each
    /// added nothing to its step's token-weighted sums.
    pub untrained_windows: usize,
    /// Windows drawn in all.
    pub windows: usize,
    /// Steps skipped because none of their windows held a trainable target (no update).
    pub no_target_steps: usize,
    /// The loss scale at the end and the steps skipped for an f16 gradient overflow, when the run scales its
    /// loss ([`super::LossScaling`]).
    pub loss_scale: Option<(f64, usize)>,
    /// The checkpoint saved at the end (or when stopped after at least one step), when there is a save_dir.
    pub checkpoint: Option<PathBuf>,
}

/// The training loop of one rank: a compiled model, its optimizer (AdamW) and the data stream.
pub struct Trainer {
    compiled: Compiled<LlamaModel>,
    config: TrainConfig,
    params: Vec<Param>,
    opt: AdamW,
    stream: Stream,
    step: usize,
    drawn: u64,
    first_step: usize,
    last_saved: Option<PathBuf>,
    tokenizer: Vec<(String, String)>,
    heldout: Option<HeldOut>,
    probes: Vec<Sample>,
    heap: Option<&'static TrackingAllocator>,
    metrics: Option<MetricsLog>,
    scaler: Option<LossScaler>,
}

impl Trainer {
    /// A trainer of `compiled` (every rank builds its own, with the same settings) on `stream`, at step 0.
    /// Checks `config` ([`TrainConfig::validate`]); rank 0 opens the metrics file.
    pub fn new(compiled: Compiled<LlamaModel>, config: TrainConfig, stream: Stream) -> Result<Self> {
        config.validate()?;
        let params = compiled.params();
        let mut opt = AdamW::new(config.adamw)?;
        if !config.decay_all {
            let exempt: Vec<_> = params.iter().filter(|p| exempt_from_decay(p.name())).cloned().collect();
            opt.skip_decay(&exempt);
        }
        let scaler = config.loss_scale.scaler(compiled.dtype())?;
        let metrics = match (&config.metrics, compiled.group().rank() == 0) {
            (Some(f), true) => Some(MetricsLog::append(f)?),
            _ => None,
        };
        Ok(Self {
            compiled,
            config,
            params,
            opt,
            stream,
            step: 0,
            drawn: 0,
            first_step: 0,
            last_saved: None,
            tokenizer: Vec::new(),
            heldout: None,
            probes: Vec::new(),
            heap: None,
            metrics,
            scaler,
        })
    }

    /// Starts the optimizer's f32 master weights (bf16/f16 compute) from `weights` (HF name -> tensor,
    /// f32), not from the parameters' rounding: pass the weights the model was built from (and the adapter a
    /// LoRA run starts from). A fresh LoRA adapter, which no file holds, starts from its own values. A no-op
    /// in f32.
    pub fn with_masters(mut self, weights: &HashMap<String, Tensor>) -> Result<Self> {
        if Precision::float(self.compiled.dtype()).needs_master() {
            for p in &self.params {
                let w = match weights.get(p.name()) {
                    Some(w) => w,
                    None if p.name().contains(".lora_") => continue,
                    None => return Err(TrainError::Config(format!("the loaded model has no `{}`", p.name()))),
                };
                self.opt.set_master(p, w)?;
            }
        }
        Ok(self)
    }

    /// Writes the tokenizer's files (name and text: `tokenizer.json`, and `tokenizer_config.json` with the
    /// chat template when the model has one) into every checkpoint.
    pub fn with_tokenizer(mut self, files: Vec<(String, String)>) -> Self {
        self.tokenizer = files;
        self
    }

    /// Held-out tokens scored every `eval_every` steps ([`Trainer::heldout_loss`] for other times).
    pub fn with_heldout(mut self, heldout: Option<HeldOut>) -> Self {
        self.heldout = heldout;
        self
    }

    /// Probes with marked answers, the first [`STAGE_PROBES`] scored at the end of each curriculum stage.
    pub fn with_probes(mut self, probes: Vec<Sample>) -> Self {
        self.probes = probes;
        self
    }

    /// The process's tracking allocator (the binary's `#[global_allocator]`), whose peak each step reports.
    pub fn with_heap(mut self, heap: &'static TrackingAllocator) -> Self {
        self.heap = Some(heap);
        self
    }

    /// Continues the checkpoint at `dir` ([`checkpoint::verify`] gave `state`): the optimizer's moments, step
    /// count and master weights, the step, and the data position. The model's weights must already be the
    /// checkpoint's (build it with `LlamaModel::load(dir, ..)`). A checkpoint, whole or sharded over any W ranks,
    /// resumes on any mesh and sharding level, each rank reading only its own elements
    /// ([`checkpoint::restore_state`]; collective).
    pub fn resume(&mut self, dir: &std::path::Path, state: &TrainerState) -> Result<()> {
        let (config, group) = (&self.compiled.model().config, self.compiled.group());
        checkpoint::restore_state(dir, state, config, group.as_ref(), &mut self.opt, &self.params)?;
        if let (Some(scaler), Some((scale, good))) = (self.scaler.as_mut(), state.loss_scale) {
            let interval = match self.config.loss_scale {
                super::config::LossScaling::Dynamic { growth_interval, .. } => growth_interval,
                _ => autosp_core::optim::loss_scale::GROWTH_INTERVAL,
            };
            *scaler = LossScaler::restored(scale, interval, good)?;
        }
        self.stream.seek(state.data);
        self.step = state.step;
        self.first_step = state.step;
        self.drawn = state.data.drawn;
        self.last_saved = Some(dir.to_path_buf());
        Ok(())
    }

    /// Steps done.
    pub fn step(&self) -> usize {
        self.step
    }

    /// The compiled model.
    pub fn compiled(&self) -> &Compiled<LlamaModel> {
        &self.compiled
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    /// The settings.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Whether this rank reports (rank 0).
    pub fn is_reporting(&self) -> bool {
        self.compiled.group().rank() == 0
    }

    /// The shape of this run, as checkpoints record it.
    pub fn shape(&self) -> RunShape {
        let c = &self.config;
        RunShape {
            seq_len: c.seq_len,
            micro_batches: c.micro_batches,
            data_parallel: self.compiled.mesh().data,
            data_source: c.data.clone(),
            seed: c.seed,
            dtype: self.compiled.dtype(),
            steps: c.steps,
            lr: c.lr,
            decay_all: c.decay_all,
            warmup: c.warmup,
            max_attention_distance: self.compiled.max_attention_distance(),
            curriculum: c.curriculum.flag(),
            base_model: c.base_model.clone(),
            rope_scaling: c.rope_scaling.clone(),
            packing: self.stream.packing().map(|p| p.to_string()),
        }
    }

    /// The loss scaler, when the run scales its loss (f16).
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The trainer state to save: the step, AdamW's step, the data position, the run's shape and the loss
    /// scaler's state.
    fn state(&self) -> TrainerState {
        let mut state = TrainerState::new(self.step, self.opt.steps(), self.stream.position(self.drawn), &self.shape());
        state.loss_scale = self.scaler.map(|s| (s.scale(), s.good_steps()));
        state
    }

    /// Saves a checkpoint of the current step into `save_dir/step-N`. Unsharded, rank 0 writes it (the others,
    /// which hold the same weights, only return where it went). With sharded model states every rank takes
    /// part ([`checkpoint::save_sharded`]: collective).
    pub fn save(&mut self) -> Result<Saved> {
        let root =
            self.config.save_dir.clone().ok_or_else(|| {
                TrainError::Config("saving a checkpoint needs a save_dir in the TrainConfig".to_string())
            })?;
        let saved = if self.compiled.sharding() != ShardLevel::None {
            let state = self.state();
            let model = self.compiled.model();
            let world = self.compiled.group();
            checkpoint::save_sharded(world, &root, model, &self.opt, &self.params, &state, &self.tokenizer)?
        } else if self.is_reporting() {
            let state = self.state();
            let model = self.compiled.model();
            checkpoint::save(&root, model, &self.opt, &self.params, &state, &self.tokenizer)?
        } else {
            Saved { dir: checkpoint::step_dir(&root, self.step), cleaned: Vec::new() }
        };
        self.last_saved = Some(saved.dir.clone());
        Ok(saved)
    }

    /// The held-out loss and targets scored, when the trainer has held-out tokens. Collective.
    pub fn heldout_loss(&self) -> Result<Option<(f64, usize)>> {
        self.heldout.as_ref().map(|h| h.evaluate(&self.compiled)).transpose()
    }

    /// Appends `line` to the metrics file (rank 0, when there is one).
    pub fn record(&mut self, line: &serde_json::Value) -> Result<()> {
        match self.metrics.as_mut() {
            Some(m) => m.write(line),
            None => Ok(()),
        }
    }

    /// Scores the long-context evaluations `long` asks for on the model ([`LongContext::evaluate`]; collective:
    /// every rank calls it), appending their JSON lines (`when`: before or after training) to the metrics file.
    pub fn score_long_context(&mut self, long: &LongContext, when: When) -> Result<LongScores> {
        let scores = long.evaluate(&self.compiled)?;
        for line in scores.json_lines(when) {
            self.record(&line)?;
        }
        Ok(scores)
    }

    /// Trains to `config.steps`. Before each step every rank asks `stop()` and all agree (one all-reduce):
    /// when any says yes, the loop ends with [`Ended::Interrupted`] (after saving, when a step was taken and
    /// there is a `save_dir`). At the end it saves (with a `save_dir`). `observe` gets the reports on rank 0.
    /// Collective: every rank calls it. An error of this rank (a batch its step refuses, a file it cannot
    /// write) is told to every other rank of the job ([`ProcessGroup::abort`]), whose calls then fail at once
    /// naming it rather than at the group's timeout.
    pub fn run(&mut self, stop: &dyn Fn() -> bool, observe: &mut dyn FnMut(Event)) -> Result<Outcome> {
        let group = self.compiled.group().clone();
        autosp_core::comm::abort_on_error(group.as_ref(), self.run_steps(stop, observe))
    }

    /// [`run`](Self::run)'s loop, an error not yet told to the other ranks.
    fn run_steps(&mut self, stop: &dyn Fn() -> bool, observe: &mut dyn FnMut(Event)) -> Result<Outcome> {
        let pg: Arc<dyn ProcessGroup> = self.compiled.group().clone();
        let (p, rank0) = (pg.size(), self.is_reporting());
        let (steps, seq_len, micro) = (self.config.steps, self.config.seq_len, self.config.micro_batches);
        let sched = self.config.schedule();
        let mut out = Outcome {
            ended: Ended::Done,
            first_step: self.first_step,
            last_step: self.step,
            loss: None,
            tokens: 0,
            seconds: 0.0,
            tape_peak: vec![0.0; p],
            heap_peak: vec![0.0; p],
            device_peak: None,
            skipped: 0,
            untrained_windows: 0,
            windows: 0,
            no_target_steps: 0,
            loss_scale: None,
            checkpoint: None,
        };
        while self.step < steps {
            let flag = Tensor::new(&[f64::from(u8::from(stop()))], &Device::Cpu)?;
            // host data: a flag made on the host.
            if pg.all_reduce(&flag, ReduceOp::Max)?.to_vec1::<f64>()?[0] > 0.0 {
                out.ended = Ended::Interrupted;
                break;
            }
            let t0 = Instant::now();
            let reads = autosp_core::host_read::host_reads();
            // The curriculum's length for this step: seq_len / len sequences of len tokens per micro-batch.
            let len = self.config.curriculum.len_at(self.step, seq_len);
            // Skipped steps (no target, an f16 overflow, a non-finite value) leave the block early: a skipped
            // step is still a step, whose probes, held-out score and save are due as after any other.
            'step: {
                let batch = self.accumulate(len)?;
                out.windows += batch.windows;
                out.untrained_windows += batch.untrained;
                let Some((grads, loss)) = batch.trained else {
                    // No window of the step had a trainable target, on any rank: nothing to learn, no update.
                    self.step += 1;
                    out.no_target_steps += 1;
                    if rank0 {
                        observe(Event::NoTargets { step: self.step, steps, windows: batch.windows });
                        let why = "no trainable target in any window of the step";
                        self.record(&json!({ "step": self.step, "skipped": why }))?;
                    }
                    break 'step;
                };
                let tape_peak = batch.tape_peak;
                if self.step == self.first_step {
                    if let Some(f) = self.config.dump_grads.clone() {
                        // Whole gradients (gathered from every rank's slices when sharded: collective).
                        let whole = self.compiled.whole_grads(&grads)?;
                        if rank0 {
                            self.dump_grads(&whole, &f)?;
                            observe(Event::GradientsWritten { step: self.step + 1, path: f });
                        }
                    }
                }
                let mut grads = grads;
                // Loss and gradient norm are the same on every rank (all-reduced), so every rank decides alike.
                let norm = self.compiled.grad_norm(&grads)?;
                let scale = self.scaler.map(|s| s.scale());
                if let (Some(scaler), true) = (self.scaler.as_mut(), loss.is_finite()) {
                    // A finite loss with non-finite gradients: f16 overflowed at this scale (skip, halve), unless
                    // the scale is already below 1 (then the policy below decides).
                    if scaler.update(norm.is_finite()) == ScaleStep::Overflow {
                        self.step += 1;
                        let halved = scaler.scale();
                        if rank0 {
                            observe(Event::Overflow { step: self.step, steps, scale: halved * 2.0, halved });
                            let why = format!("f16 gradients overflowed at loss scale {}; halved", halved * 2.0);
                            self.record(&json!({ "step": self.step, "skipped": why, "loss_scale": halved }))?;
                        }
                        break 'step;
                    }
                }
                let nonfinite = match (loss.is_finite(), norm.is_finite()) {
                    (false, _) => Some(("loss", loss)),
                    (true, false) => Some(("gradient norm", norm)),
                    _ => None,
                };
                if let Some((what, value)) = nonfinite {
                    if self.config.nonfinite == NonFinite::Stop {
                        let kept = self.last_saved.clone();
                        return Err(TrainError::NonFinite { what, step: self.step + 1, value, kept });
                    }
                    self.step += 1;
                    out.skipped += 1;
                    if rank0 {
                        let reason = Event::nonfinite_reason(what, self.step, value);
                        observe(Event::Skipped { step: self.step, steps, what, value });
                        self.record(&json!({ "step": self.step, "skipped": reason }))?;
                    }
                    break 'step;
                }
                if self.config.grad_clip > 0.0 {
                    clip_to_norm(&mut grads, norm, self.config.grad_clip)?;
                }
                let lr = sched.lr(self.step);
                self.opt.step(&self.params, &grads, lr)?;
                self.step += 1;
                let dt = t0.elapsed().as_secs_f64();
                let tokens = seq_len * micro * self.compiled.mesh().data;
                out.tokens += tokens;
                out.seconds += dt;
                let heap = self.heap.map_or(0, |h| h.peak_bytes());
                // -1: no device memory to report (the CPU).
                let device = crate::device::device_memory_peak(&self.compiled.device()).map_or(-1.0, |d| d as f64);
                let peaks = gather(&pg, &[tape_peak as f64, heap as f64, device])?;
                for (r, v) in peaks.iter().enumerate() {
                    out.tape_peak[r] = out.tape_peak[r].max(v[0]);
                    out.heap_peak[r] = out.heap_peak[r].max(v[1]);
                    if v[2] >= 0.0 {
                        let d = out.device_peak.get_or_insert_with(|| vec![0.0; p]);
                        d[r] = d[r].max(v[2]);
                    }
                }
                out.loss = Some((out.loss.map_or(loss, |l| l.0), loss));
                if rank0 {
                    let record = StepRecord {
                        step: self.step,
                        steps,
                        loss,
                        lr,
                        grad_norm: norm,
                        loss_scale: scale,
                        host_reads: autosp_core::host_read::host_reads() - reads,
                        tokens_per_s: tokens as f64 / dt,
                        tape_peak: peaks.iter().map(|v| v[0] as u64).collect(),
                        heap_peak: peaks.iter().map(|v| v[1] as u64).collect(),
                        heap_peak_max: out.heap_peak.iter().cloned().fold(0.0, f64::max) as u64,
                        device_peak_max: out.device_peak.as_ref().map(|d| d.iter().cloned().fold(0.0, f64::max) as u64),
                    };
                    let line = record.to_json();
                    observe(Event::Step(record));
                    self.record(&line)?;
                }
            }
            self.between_steps(len, observe)?;
        }
        out.last_step = self.step;
        out.loss_scale = self.scaler.map(|s| (s.scale(), s.skipped() as usize));
        let stepped = self.step > self.first_step;
        if self.config.save_dir.is_some() && (out.ended == Ended::Done || stepped) {
            let saved = self.save()?;
            if rank0 {
                for what in saved.cleaned {
                    observe(Event::Cleaned { root: self.config.save_dir.clone().unwrap_or_default(), what });
                }
            }
            out.checkpoint = Some(saved.dir);
        }
        Ok(out)
    }

    /// One step's micro-batches at sequence length `len`: the gradients (token-weighted mean), the loss (the
    /// same mean) and the tape's peak bytes. Each micro-batch holds `seq_len / len` sequences per data-parallel
    /// replica, every replica its own (every rank draws them all; the compiled step takes its replica's). A
    /// window without a trainable target weighs nothing; a micro-batch with none anywhere is left out (every
    /// rank learns that alike from the step's target count), and a step with none at all trains nothing.
    fn accumulate(&mut self, len: usize) -> Result<Accumulated> {
        let (seq_len, micro) = (self.config.seq_len, self.config.micro_batches);
        let replicas = self.compiled.mesh().data;
        let mut acc = Accumulation::new(micro);
        let (mut loss_sum, mut count, mut tape_peak) = (0f64, 0usize, 0usize);
        let (mut windows, mut untrained) = (0usize, 0usize);
        let answers_only = self.stream.answers_only();
        let rows = replicas * seq_len / len;
        for m in 0..micro {
            // LoRA's dropout masks follow the step and each sequence's place in its batch, so a resumed run
            // draws the ones an uninterrupted run drew, on any mesh.
            autosp_core::lora::seed_dropout(self.compiled.model(), self.step as u64, (m * rows) as u64);
            let (mut ids, mut labels) = (Vec::with_capacity(seq_len), Vec::with_capacity(seq_len));
            // Packed by documents: each window's ([`Stream::packing`]), a row of the step each.
            let mut documents = Vec::new();
            for _ in 0..rows {
                let s = self.stream.next(len)?;
                self.drawn += 1;
                windows += 1;
                untrained += usize::from(answers_only && s.answers.is_empty());
                labels.extend(s.labels(answers_only));
                documents.extend(s.documents);
                ids.extend(s.ids);
            }
            let labels = match answers_only || !documents.is_empty() {
                true => Some(Tensor::from_vec(labels, (rows, len), &Device::Cpu)?),
                false => None,
            };
            let ids = Tensor::from_vec(ids, (rows, len), &Device::Cpu)?;
            let (labels, documents) = (labels.as_ref(), (!documents.is_empty()).then_some(&documents[..]));
            let scale = self.scaler.map_or(1.0, |s| s.scale());
            // Local gradients, token-weighted into `acc`; one reduction for the step, on the last micro-batch
            // (or in finish_accumulation when it has no target).
            let out = self.compiled.accumulate_step(&mut acc, &ids, labels, documents, scale, m + 1 == micro);
            let out = match out {
                Ok(out) => out,
                // Every rank gets this alike (the target count is reduced before any forward pass).
                Err(crate::CompileError::NoTargets) => continue,
                Err(e) => return Err(e.into()),
            };
            tape_peak = tape_peak.max(out.peak_bytes);
            loss_sum += out.loss * out.valid_tokens as f64;
            count += out.valid_tokens;
        }
        if count == 0 {
            return Ok(Accumulated { trained: None, tape_peak, windows, untrained });
        }
        // The token-weighted mean over the micro-batches, reduced once.
        let grads = self.compiled.finish_accumulation(acc)?;
        Ok(Accumulated { trained: Some((grads, loss_sum / count as f64)), tape_peak, windows, untrained })
    }

    /// Writes `grads` (f32) as safetensors to `path` under the checkpoint's own tensor names, as transformers'
    /// `named_parameters` has them: Phi-3's split projections fused back into `qkv_proj` and `gate_up_proj`
    /// (`autosp_models::fused`; a fused weight's gradient is its parts' gradients stacked).
    fn dump_grads(&self, grads: &Gradients, path: &std::path::Path) -> Result<()> {
        let named: HashMap<String, Tensor> = self
            .params
            .iter()
            .filter_map(|p| grads.get(p).map(|g| (p.name().to_string(), g.to_dtype(DType::F32))))
            .map(|(n, g)| g.map(|g| (n, g)))
            .collect::<candle_core::Result<_>>()?;
        let named = autosp_models::fused::fuse(&self.compiled.model().config, &named)?;
        candle_core::safetensors::save(&named, path).map_err(|cause| TrainError::Tensors {
            what: format!("writing --dump-grads {}", path.display()),
            cause: Box::new(cause),
        })
    }

    /// After a step: the stage-end probes, the periodic held-out score and the periodic save (all collective
    /// or rank 0 only, alike on every rank).
    fn between_steps(&mut self, len: usize, observe: &mut dyn FnMut(Event)) -> Result<()> {
        let (step, steps, seq_len) = (self.step, self.config.steps, self.config.seq_len);
        let rank0 = self.is_reporting();
        // At the end of each curriculum stage: accuracy on the first held-out probes (collective).
        if step < steps && len != self.config.curriculum.len_at(step, seq_len) && !self.probes.is_empty() {
            let few = &self.probes[..self.probes.len().min(STAGE_PROBES)];
            let answers = answer_accuracy(&self.compiled, few)?;
            if rank0 {
                observe(Event::Stage { len, step, seq_len, answers, samples: few.len() });
            }
        }
        let every = self.config.eval_every;
        if every > 0 && step % every == 0 && step < steps {
            if let Some((loss, _)) = self.heldout_loss()? {
                if rank0 {
                    observe(Event::HeldOut { step, steps, loss });
                    self.record(&json!({ "step": step, "eval_loss": loss }))?;
                }
            }
        }
        let every = self.config.save_every;
        if every > 0 && step % every == 0 && step < steps {
            let saved = self.save()?;
            if rank0 {
                let root = self.config.save_dir.clone().unwrap_or_default();
                for what in saved.cleaned {
                    observe(Event::Cleaned { root: root.clone(), what });
                }
                observe(Event::Saved(saved.dir));
            }
        }
        Ok(())
    }
}

/// One step's micro-batches, run ([`Trainer::accumulate`]).
struct Accumulated {
    /// The gradients and the loss (token-weighted means), or `None` when no window had a trainable target.
    trained: Option<(Gradients, f64)>,
    /// The tape's peak bytes over the micro-batches.
    tape_peak: usize,
    /// Windows drawn.
    windows: usize,
    /// Windows drawn without a trainable target.
    untrained: usize,
}

/// Gathers `values` from every rank (f64, exact for byte counts) to every rank: `[rank][i]`.
fn gather(pg: &Arc<dyn ProcessGroup>, values: &[f64]) -> Result<Vec<Vec<f64>>> {
    let t = Tensor::new(values, &Device::Cpu)?;
    let all = pg.all_gather(&t, 0)?.to_vec1::<f64>()?; // host data
    Ok(all.chunks(values.len()).map(<[f64]>::to_vec).collect())
}

/// The parameters fine-tuning leaves out of weight decay (HF names): every RMSNorm's scale, every bias and the
/// token embedding (with a tied head, the head too).
pub fn exempt_from_decay(name: &str) -> bool {
    name.ends_with("norm.weight") || name.ends_with(".bias") || name == "model.embed_tokens.weight"
}
