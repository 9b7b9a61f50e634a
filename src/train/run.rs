//! [`Job`]: a whole fine-tuning run from [`RunOptions`], what `llama_longctx` runs. [`Job::prepare`] reads and
//! checks everything before any rank starts (the options, the model, the data, the held-out tokens, the
//! checkpoint to resume and whether this run may continue it); [`Job::run_rank`] is one rank's run: compile,
//! then either report the plan (`explain`) or score `eval_tokens` and stop, or take the save lock, describe
//! the run, score the task's probes and the held-out tokens, train ([`Trainer`]), score again and end with a
//! [`Summary`]. Reports go to the caller's observer on rank 0 as [`Event`]s.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::TrackingAllocator;
use autosp_core::{Precision, ShardLevel};
use autosp_models::{LlamaConfig, LlamaModel};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::checkpoint::model_slices::WeightRanges;
use super::checkpoint::{self, RunShape, SaveLock, TrainerState};
use super::config::{micro_batches, NonFinite, TrainConfig};
use super::corpus::Corpus;
use super::curriculum::Curriculum;
use super::data::{self, DataSource};
use super::error::{Result, TrainError};
use super::eval::{answer_accuracy, Answers, HeldOut, LongContext, When};
use super::events::Event;
use super::launch::Carrier;
use super::lora::{merge_into, LoraRun};
use super::metrics::{Accuracy, EvalLoss, Score, Summary};
use super::model;
use super::options::{checkpoint_flag, strategy_flag, RunOptions};
use super::packing::Packing;
use super::stream::{Sample, Stream};
use super::synthetic::{Needles, NeedlesVocab, Passkey, PasskeyVocab, VALUES};
use super::trainer::{Ended, Trainer};
use crate::compile::{build_sharded, Mesh};
use crate::{compile, CompileConfig};

/// Everything the ranks share, read and checked before they start.
pub struct Job {
    /// The options.
    pub options: RunOptions,
    /// Ranks, all of them (the world: D data-parallel replicas × S sequence-parallel ranks).
    pub p: usize,
    /// The data × sequence mesh of the ranks.
    pub mesh: Mesh,
    /// Whether ranks are threads of this process (process memory is then shared).
    pub threads: bool,
    /// The compute dtype (`--dtype`, or the device's default).
    pub dtype: DType,
    /// The model's config.
    pub config: LlamaConfig,
    /// The starting weights (by HF name) in the master dtype (f32), or in `dtype` where the files hold nothing
    /// wider ([`model::load_dtype`]): each rank builds its own model from them in `dtype` and, under bf16/f16,
    /// starts its optimizer's master weights from them (widened: the same values). Dropped once every rank of
    /// this process has built its model: no whole copy of the model outlives the start of training.
    pub base: std::sync::Mutex<Option<Arc<HashMap<String, Tensor>>>>,
    /// Where the model came from (for the report).
    pub source: String,
    /// The tokenizer's files (`tokenizer.json`, `tokenizer_config.json`), written into every checkpoint.
    pub tokenizer_files: Vec<(String, String)>,
    /// The training data.
    pub stream: Stream,
    /// Held-out samples for the accuracy probe (passkey and needles data only), at `seq_len`.
    pub probes: Vec<Sample>,
    /// The training loop's settings.
    pub train: TrainConfig,
    /// `--eval-tokens`: ids to score (then stop).
    pub eval_ids: Option<Vec<u32>>,
    /// `--eval-data`: held-out tokens scored before, during and after training.
    pub heldout: Option<HeldOut>,
    /// The checkpoint to resume and its state.
    pub resume: Option<(PathBuf, TrainerState)>,
    /// What a resumed run changes (`--steps 4 -> 8`), accepted with `allow_changes`.
    pub resume_changes: Vec<String>,
    /// The directory checkpoints go to.
    pub save_root: PathBuf,
    /// The device of this process's ranks: thread ranks share it; with one process per rank, the caller opens
    /// the process's own after `prepare` (`None` until then; `run_rank` then opens it).
    pub device: Option<Device>,
    /// The back end that carries the collectives, for the report.
    pub carrier: Carrier,
    /// The process's tracking allocator, for the heap peaks reported.
    pub heap: Option<&'static TrackingAllocator>,
    /// The program's name, which starts the first line describing the run (`training` unless set).
    pub name: String,
    /// The LoRA adapters the ranks add to the model, when the run trains adapters.
    pub lora: Option<LoraRun>,
    /// The long-context evaluations (`--eval-passkey`, `--eval-positions`), scored before and after training.
    pub long_context: LongContext,
    /// What `--rope-scaling` made of the model's positions (the line the run prints), when given.
    pub rope_extended: Option<autosp_models::RopeExtended>,
    /// At `--shard parameters`, the weight files each rank reads its own slices from, open with their headers
    /// read (once per process; `base` is then `None`: no process loads the whole model); `None` when the ranks
    /// build from `base`.
    pub weight_ranges: Option<Arc<WeightRanges>>,
}

/// The kernel switches from the environment (`AUTOSP_KERNELS`, `AUTOSP_SIMD`), checked so that a typo or a
/// vector path this CPU lacks fails before any rank starts.
fn check_kernel_env() -> Result<()> {
    crate::kernels::dispatch::kernels_from_env().map_err(TrainError::Config)?;
    autosp_core::simd::simd_from_env().map_err(|e| TrainError::Config(e.to_string()))?;
    Ok(())
}

impl Job {
    /// [`prepare`](Self::prepare) on every process of `group` (one process per rank: `--launcher mpi`), the
    /// outcome agreed over the group (collective: one all-reduce). The processes check alone (each its own
    /// host's memory, files only it reads), so one may refuse a run the others accept: then it returns its own
    /// error and every other process one saying a rank refused, at once, rather than at a collective's timeout.
    pub fn prepare_on(options: RunOptions, group: &dyn ProcessGroup) -> Result<Self> {
        let job = Self::prepare(options, group.size(), false);
        match (checkpoint::agree(group, job.is_ok())?, job) {
            (_, Err(e)) => Err(e),
            (true, Ok(job)) => Ok(job),
            (false, Ok(_)) => Err(TrainError::Config(
                "another rank refused the run while preparing it (its own error says why); no rank went on".into(),
            )),
        }
    }

    /// Reads the model, the data and the checkpoint to resume for a run of `options` on `p` ranks in all
    /// (`options.dp` replicas of `p / dp` sequence ranks; `threads`: ranks are threads of this process sharing
    /// one device, which is opened here), checking them all before anything runs. Writes nothing (but the
    /// default tiny model, made once in the cache).
    pub fn prepare(options: RunOptions, p: usize, threads: bool) -> Result<Self> {
        let o = &options;
        for (flag, n) in [("--dp", o.dp), ("--sp", p / o.dp.max(1))] {
            if n == 0 {
                return Err(TrainError::Config(format!(
                    "{flag} 0: there must be at least one rank; give {flag} 1 or more"
                )));
            }
        }
        if !p.is_multiple_of(o.dp) {
            return Err(TrainError::Config(format!(
                "{p} ranks do not split into --dp {} replicas: give a number of ranks that is a multiple of --dp",
                o.dp
            )));
        }
        let mesh = Mesh::new(o.dp, p / o.dp);
        let p_seq = mesh.sequence;
        if o.seq_len < 2 {
            return Err(TrainError::Config(format!(
                "--seq-len {}: a training sequence needs at least 2 tokens (an input and its next token); give \
                 --seq-len 2 or more",
                o.seq_len
            )));
        }
        if p_seq > o.seq_len {
            return Err(TrainError::Config(format!(
                "--sp {p_seq} is larger than --seq-len {}: every rank needs at least one token of the sequence; \
                 lower --sp to at most {} or raise --seq-len",
                o.seq_len, o.seq_len
            )));
        }
        check_kernel_env()?;
        // Thread ranks share one device handle (tensors pass between them as they are; on CUDA only one, as
        // more would race across candle's per-thread streams); one process per rank opens its own.
        let device = if threads {
            o.device_spec().check_thread_ranks(p)?;
            Some(o.device_spec().open(None)?)
        } else {
            None
        };
        let micro = micro_batches(o.batch_tokens, o.seq_len)?;
        let dtype = o.compute_dtype();
        let source_kind = DataSource::parse(&o.data);
        let packing = source_kind.packing(o.packing)?;
        let curriculum = match (&source_kind, &o.curriculum) {
            (DataSource::Needles, Some(c)) => Curriculum::parse(c, o.seq_len)?,
            (DataSource::Needles, None) => Curriculum::default_for(o.seq_len, o.steps),
            (_, Some(_)) => {
                return Err(TrainError::Config(
                    "--curriculum works with --data needles only (the other data come in --seq-len sequences)".into(),
                ))
            }
            (_, None) => Curriculum::none(),
        };
        // A resumed run keeps its checkpoint's learning rate and decay unless told otherwise; a model the user
        // brings gets fine-tuning's defaults (RunOptions::default_lr, no decay on norms, biases, embeddings).
        let resumed = match &o.resume {
            Some(dir) => Some((dir.clone(), checkpoint::verify(dir)?)),
            None => None,
        };
        let saved = resumed.as_ref().map(|(_, s)| s);
        let lora = LoraRun::from_options(o, resumed.as_ref().map(|(d, s)| (d.as_path(), s.base_model.as_deref())))?;
        // The model the run starts from: the checkpoint resumed (a LoRA checkpoint holds only the adapter: its
        // base), --model, an adapter's base, or the demo model.
        let base = o.model.clone().or_else(|| lora.as_ref().and_then(|l| l.base.clone()));
        let source = match (&resumed, &base) {
            (Some((dir, _)), _) if !autosp_models::is_adapter(dir) => dir.display().to_string(),
            (Some((dir, _)), None) => {
                return Err(TrainError::Config(format!(
                    "--resume {}: the LoRA checkpoint does not name its base model; give it with --model",
                    dir.display()
                )))
            }
            (_, Some(m)) => m.clone(),
            (None, None) => model::tiny_model(o.seed)?.display().to_string(),
        };
        let pretrained = base.is_some();
        let lr =
            o.lr.or(saved.and_then(|s| s.lr)).unwrap_or_else(|| RunOptions::default_lr(pretrained, lora.is_some()));
        let decay_all = o.decay_all
            || match saved {
                Some(s) => s.decay_all.unwrap_or(true),
                None => o.model.is_none(),
            };
        let shape = RunShape {
            seq_len: o.seq_len,
            micro_batches: micro,
            data_parallel: o.dp,
            data_source: o.data.clone(),
            seed: o.seed,
            dtype,
            steps: o.steps,
            lr,
            decay_all,
            warmup: o.warmup,
            max_attention_distance: o.max_attention_distance,
            curriculum: curriculum.flag(),
            base_model: lora.as_ref().map(|_| source.clone()),
            // The extension this run's model has: the one asked for, else the one the checkpoint recorded.
            rope_scaling: o
                .rope_scaling
                .as_ref()
                .map(ToString::to_string)
                .or(saved.and_then(|s| s.rope_scaling.clone())),
            packing: packing.map(|p| p.to_string()),
        };
        let (resume, resume_changes) = match resumed {
            Some((dir, state)) => {
                let changes = state.resume_changes(&shape, &dir, o.allow_changes)?;
                (Some((dir, state)), changes)
            }
            None => (None, Vec::new()),
        };
        // At `parameters` each rank reads its own slices of the weights: the job reads the config, the
        // tokenizer and the files' headers, and makes the model as a skeleton (#41). A resumed run, or one given
        // --memory-budget, is checked on the skeleton before any rank allocates: the checkpoint belongs to this
        // model, and the model states fit this mesh.
        let checked = resume.is_some() || o.memory_budget.is_some();
        let sliced = match o.shard {
            Some(ShardLevel::Parameters) => model::load_skeleton(&source, dtype)?,
            _ => None,
        };
        let check = |config: &LlamaConfig| {
            let resume = resume.as_ref().map(|(dir, state)| (dir.as_path(), state));
            checkpoint::resume_fit::check_run(
                config,
                dtype,
                lora.as_ref(),
                resume,
                o.shard,
                p,
                threads,
                o.prefetch_gathers,
                o.memory_budget,
            )
        };
        // The config checked before anything whole is read: the skeleton's, else config.json's alone (not the
        // skeleton's headers and tokenizer, which the whole load below reads again).
        let config_first = match (&sliced, checked) {
            (_, false) => None,
            (Some((skeleton, _)), true) => Some(skeleton.model.config.clone()),
            (None, true) => model::config_of(&source)?.map(|(config, _)| config),
        };
        if let Some(config) = &config_first {
            check(config)?;
        }
        let (mut loaded, weight_ranges) = match sliced {
            Some((loaded, ranges)) => (loaded, Some(Arc::new(ranges))),
            None => (model::load(&source, model::load_dtype(&source, dtype)?)?, None),
        };
        if checked && config_first.is_none() {
            // A GGUF file's config comes with its weights: the same checks on the loaded model, before any rank
            // builds from it.
            check(&loaded.model.config)?;
        }
        let vocab = loaded.model.config.vocab_size;
        let mut probes = Vec::new();
        let stream = match &source_kind {
            DataSource::Needles => {
                // A model with a tokenizer: only its ordinary tokens and its own BOS (no special or reserved id).
                let bos = loaded.model.config.bos_token_id;
                let nv = match &loaded.tokenizer {
                    Some(t) => NeedlesVocab::of_tokenizer(t, vocab, bos)?,
                    None => NeedlesVocab::new(vocab, bos.unwrap_or(1))?,
                };
                probes = Needles::probes(&nv, o.seed, if o.quick { 4 } else { 16 }, o.seq_len)?;
                Stream::Needles(Needles::new(nv, o.seed))
            }
            DataSource::Passkey => {
                let pv = match &loaded.tokenizer {
                    Some(t) => PasskeyVocab::Text(Box::new(t.clone())),
                    None => PasskeyVocab::Ids { vocab },
                };
                probes = Passkey::probes(pv.clone(), o.seed, if o.quick { 4 } else { 8 }, o.seq_len)?;
                Stream::Passkey(Passkey::new(pv, o.seq_len, o.seed)?)
            }
            DataSource::Ids(f) if packing == Some(Packing::Documents) => {
                let (ids, starts) = data::read_id_documents(f, vocab)?;
                Stream::packed_documents(data::pack_documents(&ids, &starts, o.seq_len, &f.display().to_string())?)
            }
            DataSource::Ids(f) => {
                let ids = data::read_ids(f, vocab)?;
                Stream::packed(data::pack(&ids, o.seq_len, &f.display().to_string())?)
            }
            DataSource::Text(f) => {
                let t = loaded.tokenising(&format!("--data {}", f.display()), &source, o);
                // Bad data is reported before a missing tokenizer.
                let t = t.or_else(|e| Corpus::check(f).and(Err(e)))?;
                let corpus = Corpus::prepare(f, &t)?;
                if corpus.windows(o.seq_len) == 0 {
                    return Err(TrainError::Data(format!(
                        "--seq-len {} is longer than the {} tokens available in {}: lower --seq-len or give more data",
                        o.seq_len,
                        corpus.tokens,
                        f.display()
                    )));
                }
                let packing = packing.unwrap_or(Packing::Documents);
                Stream::Corpus { corpus: Arc::new(corpus), seq_len: o.seq_len, packing, next: 0 }
            }
        };
        let eval_ids = match &o.eval_tokens {
            Some(f) => {
                let ids = data::read_ids(f, vocab)?;
                if ids.len() < 2 {
                    return Err(TrainError::Data(format!(
                        "--eval-tokens {}: needs at least 2 token ids, found {}",
                        f.display(),
                        ids.len()
                    )));
                }
                Some(ids)
            }
            None => None,
        };
        let heldout = match &o.eval_data {
            Some(spec) => {
                let t = match DataSource::parse(spec) {
                    DataSource::Text(_) => Some(loaded.tokenising(&format!("--eval-data {spec}"), &source, o)?),
                    _ => None,
                };
                // Scored as the run trains (the synthetic tasks' runs: document-blind, as before --packing).
                let packing = packing.unwrap_or(Packing::Stream);
                Some(HeldOut::load(spec, o.seq_len, o.eval_tokens_max, vocab, t.as_ref(), packing)?)
            }
            None => None,
        };
        let save_root = match (&o.save, &resume) {
            (Some(d), _) => d.clone(),
            (None, Some((dir, _))) => dir.parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from(".")),
            (None, None) => model::cache_dir().join("runs").join("latest"),
        };
        // An evaluation run (nothing to train: --steps 0, or no step past the checkpoint resumed) writes a
        // checkpoint only when asked (--save: the model as loaded, with any --rope-scaling; --merge-lora).
        let saves = o.steps > resume.as_ref().map_or(0, |(_, s)| s.step) || o.save.is_some() || o.merge_lora.is_some();
        let train = TrainConfig {
            seq_len: o.seq_len,
            steps: o.steps,
            lr,
            warmup: o.warmup,
            grad_clip: o.grad_clip,
            micro_batches: micro,
            curriculum,
            nonfinite: if o.skip_nonfinite { NonFinite::Skip } else { NonFinite::Stop },
            loss_scale: o.loss_scale,
            save_every: if saves { o.save_every } else { 0 },
            eval_every: o.eval_every,
            adamw: Default::default(),
            decay_all,
            data: o.data.clone(),
            seed: o.seed,
            save_dir: saves.then(|| save_root.clone()),
            metrics: o.metrics.clone(),
            dump_grads: o.dump_grads.clone(),
            base_model: shape.base_model.clone(),
            rope_scaling: shape.rope_scaling.clone(),
        };
        train.validate()?;
        // --rope-scaling: the config every rank builds from, and so every checkpoint written, carries it. A full
        // checkpoint resumed holds the extension its run recorded (applied again only when this run asks for
        // another, with --allow-changes: on top of it); an adapter's base gets it from the option, else from the
        // config written beside the adapter.
        let adapter_dir = match (&resume, &o.lora_adapter) {
            (Some((dir, _)), _) if autosp_models::is_adapter(dir) => Some(dir.clone()),
            (_, given) => given.clone(),
        };
        let recorded = resume.as_ref().and_then(|(_, s)| s.rope_scaling.clone());
        let rope_extended = match (&adapter_dir, &o.rope_scaling) {
            (Some(dir), rope) => super::lora::adapter_positions(&mut loaded.model, dir, rope.as_ref())?,
            (None, Some(x)) if resume.is_some() && recorded == Some(x.to_string()) => None,
            (None, rope) => rope.as_ref().map(|x| loaded.model.extend_rope(x)).transpose()?,
        };
        let config = loaded.model.config.clone();
        let base = weight_ranges.is_none().then(|| Arc::new(loaded.model.to_weights()));
        let tokenizer_files = loaded.tokenizer_files();
        let long_context =
            LongContext::from_options(o, &config, loaded.tokenizer.as_ref(), heldout.as_ref(), &save_root)?;
        drop(loaded);
        Ok(Job {
            p,
            mesh,
            threads,
            dtype,
            config,
            base: std::sync::Mutex::new(base),
            source,
            tokenizer_files,
            stream,
            probes,
            train,
            eval_ids,
            heldout,
            resume,
            resume_changes,
            save_root,
            device,
            carrier: if threads { Carrier::Threads } else { Carrier::Mpi },
            lora,
            long_context,
            rope_extended,
            weight_ranges,
            heap: None,
            name: "training".into(),
            options,
        })
    }

    /// One rank's whole run (every rank calls it with its group). `stop` is asked between steps
    /// ([`Trainer::run`]); `observe` gets the reports on rank 0. Returns how the run ended. An error of this
    /// rank is told to every other rank of the job ([`ProcessGroup::abort`]), whose calls then fail at once
    /// naming it rather than at the group's timeout.
    pub fn run_rank(
        &self,
        pg: Arc<dyn ProcessGroup>,
        stop: &dyn Fn() -> bool,
        observe: &mut dyn FnMut(Event),
    ) -> Result<Ended> {
        let group = pg.clone();
        autosp_core::comm::abort_on_error(group.as_ref(), self.rank_run(pg, stop, observe))
    }

    /// [`run_rank`](Self::run_rank)'s work, an error not yet told to the other ranks.
    fn rank_run(
        &self,
        pg: Arc<dyn ProcessGroup>,
        stop: &dyn Fn() -> bool,
        observe: &mut dyn FnMut(Event),
    ) -> Result<Ended> {
        let o = &self.options;
        let rank0 = pg.rank() == 0;
        let mut say = |line: String| {
            if rank0 {
                observe(Event::Info(line))
            }
        };
        // Thread ranks share one device; one process per rank takes its node-local rank's GPU.
        let device = match &self.device {
            Some(d) => d.clone(),
            None => o.device_spec().open(Some((crate::device::local_rank(pg.rank()), pg.size())))?,
        };
        // The loaded weights (f32, or `dtype` for a checkpoint stored in it; on the CPU; one copy shared by the
        // thread ranks). The model
        // computes in their `dtype` rounding on the device; the optimizer's masters are taken from them below.
        // None where each rank reads its own slices (`weight_ranges`, at `parameters`).
        let base = self.base.lock().expect("job lock poisoned").clone();
        let adapt = |model: &mut LlamaModel| -> Result<()> {
            if let Some(l) = &self.lora {
                l.apply(model)?;
            }
            Ok(())
        };
        let build = |base: &HashMap<String, Tensor>| -> Result<LlamaModel> {
            let weights = base
                .iter()
                .map(|(k, t)| Ok((k.clone(), t.to_device(&device)?.to_dtype(self.dtype)?)))
                .collect::<Result<HashMap<String, Tensor>>>()?;
            let mut model = LlamaModel::from_weights(&self.config, weights)?;
            adapt(&mut model)?;
            Ok(model)
        };
        // At `parameters` each rank reads its own slices of the files (all ranks at once, #41); from the loaded
        // weights the ranks build in turn, each keeping its slices before the next builds.
        let (model, read_masters) = match (&self.weight_ranges, &base) {
            (Some(ranges), _) => {
                let b = checkpoint::model_slices::build(ranges, &self.config, self.dtype, &device, &pg, adapt)?;
                (b.model, b.masters)
            }
            (None, Some(base)) => match o.shard {
                Some(level @ ShardLevel::Parameters) => (build_sharded(&pg, level, || build(base))?, HashMap::new()),
                _ => (build(base)?, HashMap::new()),
            },
            (None, None) => {
                return Err(TrainError::Config(
                    "the job's starting weights were released: run every rank of a job once".into(),
                ))
            }
        };
        let mut cfg = CompileConfig::new(pg.clone(), o.strategy, o.checkpoint)
            .with_mesh(self.mesh)
            .with_dtype(self.dtype)
            .with_max_attention_distance(o.max_attention_distance)
            .with_reduction(o.reduction)
            .with_prefetch_gathers(o.prefetch_gathers);
        if let Some(level) = o.shard {
            cfg = cfg.with_sharding(level);
        }
        cfg.seq_len = Some(o.seq_len);
        // Every rank of this process holds its own handle on the starting weights now: the job's goes, and the
        // weights with the last rank's (below).
        pg.barrier()?;
        // Thread ranks share the job (rank 0 lets it go); one process per rank has a job of its own (#41).
        if pg.rank() == 0 || !self.threads {
            self.base.lock().expect("job lock poisoned").take();
        }
        let mut c = compile(model, cfg).map_err(|cause| TrainError::Compile {
            settings: format!(
                "--dp {} --sp {} --strategy {} --checkpoint {} --seq-len {}",
                self.mesh.data,
                self.mesh.sequence,
                strategy_flag(o.strategy),
                checkpoint_flag(o.checkpoint),
                o.seq_len
            ),
            cause: Box::new(cause),
        })?;
        if o.explain {
            say(c.explain(o.seq_len)?);
            return Ok(Ended::Done);
        }
        if let Some(ids) = &self.eval_ids {
            let n = ids.len();
            let (loss, targets) = c.eval_loss(&Tensor::from_vec(ids.clone(), (1, n), &Device::Cpu)?, None)?;
            say(json!({ "eval_loss": loss, "tokens": n, "targets": targets, "sp": self.p, "model": self.source })
                .to_string());
            return Ok(Ended::Done);
        }

        // One run at a time saves into a directory (rank 0 saves; it holds the lock until the run ends).
        let _lock = if rank0 { Some(SaveLock::acquire(&self.save_root)?) } else { None };
        for line in self.describe(&c, &device)? {
            say(line);
        }
        // The f32 masters start from the base weights, and from the adapter a LoRA run starts from.
        let starting = match &base {
            Some(base) => (**base).clone(),
            None => read_masters,
        };
        let masters = match self.lora.as_ref().and_then(|l| l.weights.as_ref()) {
            Some(w) => starting.into_iter().chain(w.iter().map(|(k, t)| (k.clone(), t.clone()))).collect(),
            None => starting,
        };
        let mut trainer = Trainer::new(c, self.train.clone(), self.stream.clone())?;
        // An evaluation run that saves nothing (no save_dir) needs no f32 masters (a copy of every bf16 weight).
        if self.train.save_dir.is_some() {
            trainer = trainer.with_masters(&masters)?;
        }
        let mut trainer = trainer
            .with_tokenizer(self.tokenizer_files.clone())
            .with_heldout(self.heldout.clone())
            .with_probes(self.probes.clone());
        if let Some(heap) = self.heap {
            trainer = trainer.with_heap(heap);
        }
        // The optimizer holds what it keeps of the masters (its slices when sharded): the whole loaded weights
        // go now, not at the end of the run (#41).
        drop(masters);
        drop(base);
        if let Some((dir, st)) = &self.resume {
            trainer.resume(dir, st)?;
            say(format!("resumed from {} at step {}", dir.display(), trainer.step()));
            if !self.resume_changes.is_empty() {
                say(format!("resumed with changes (--allow-changes): {}", self.resume_changes.join(", ")));
            }
        }
        let probe = |t: &Trainer| -> Result<Option<Answers>> {
            (!self.probes.is_empty()).then(|| answer_accuracy(t.compiled(), &self.probes)).transpose()
        };
        let before = probe(&trainer)?;
        let eval_before = trainer.heldout_loss()?;
        if let (Some((loss, n)), Some(h)) = (eval_before, &self.heldout) {
            if rank0 {
                let ids = self.save_root.join("heldout-ids.txt");
                h.write_ids(&ids)?;
                say(format!(
                    "held-out loss before training: {loss:.4} ({} tokens in {} window(s) of at most {}, {n} next-token \
                     targets, of {}; ids in {}, one window per line)",
                    h.ids.len(),
                    h.windows().count(),
                    h.window,
                    h.source,
                    ids.display()
                ));
            }
            trainer.record(&json!({ "step": trainer.step(), "eval_loss": loss }))?;
        }
        self.long_context.warnings.iter().for_each(|w| say(w.clone()));
        let long_before = trainer.score_long_context(&self.long_context, When::Before)?;

        let out = trainer.run(stop, observe)?;
        if out.ended == Ended::Interrupted {
            if rank0 {
                let stepped = out.last_step > out.first_step;
                observe(Event::Interrupted { step: out.last_step, checkpoint: out.checkpoint, stepped });
            }
            return Ok(Ended::Interrupted);
        }
        // A run that took no step (--steps 0) is scored once: its "after" is its "before".
        let trained = out.last_step > out.first_step;
        let after = if trained { probe(&trainer)? } else { before };
        let eval_after = if trained { trainer.heldout_loss()? } else { eval_before };
        if let (Some((loss, _)), true) = (eval_after, trained) {
            trainer.record(&json!({ "step": out.last_step, "eval_loss": loss }))?;
        }
        let long_after = trained.then(|| trainer.score_long_context(&self.long_context, When::After)).transpose()?;
        let mut tables = Vec::new();
        if rank0 && !self.long_context.is_empty() {
            let (t, pictures) = self.long_context.report(&long_before, long_after.as_ref())?;
            tables = t;
            let shown: Vec<String> = pictures.iter().map(|p| p.display().to_string()).collect();
            observe(Event::Info(format!("long-context evaluation pictures: {}", shown.join(", "))));
        }
        // Teacher-forced: each answer token predicted with the true tokens before it.
        let (what, unit, whole, chance) = match self.stream {
            Stream::Needles(_) => ("needles", "answers", "samples all right", Some(1.0 / VALUES as f64)),
            _ => ("passkey", "answer tokens", "whole keys", None),
        };
        let score = |x: Answers| Score {
            right: x.right,
            total: x.total,
            unit: unit.into(),
            note: format!("{}/{} {whole}", x.whole, self.probes.len()),
        };
        let summary = Summary {
            first_step: out.first_step,
            last_step: out.last_step,
            loss: out.loss,
            eval: match (&self.heldout, eval_before, eval_after) {
                (Some(h), Some((before, _)), Some((after, _))) => {
                    Some(EvalLoss { before, after, tokens: h.ids.len(), source: h.source.clone() })
                }
                _ => None,
            },
            accuracy: before.zip(after).map(|(b, f)| Accuracy {
                what: what.into(),
                chance,
                before: score(b),
                after: score(f),
            }),
            throughput: (out.tokens > 0).then_some((out.tokens, out.seconds)),
            vector_path: device.is_cpu().then(|| (autosp_core::simd::simd_path().name(), crate::cpu_matmul::kernels())),
            tape_peak: out.tape_peak,
            heap_peak: out.heap_peak,
            threads: self.threads,
            skipped: out.skipped,
            untrained_windows: (out.untrained_windows, out.windows),
            no_target_steps: out.no_target_steps,
            loss_scale: out.loss_scale,
            device_peak: out.device_peak,
            checkpoint: out.checkpoint,
            tables,
        };
        let adapter = summary.checkpoint.clone();
        trainer.record(&summary.to_json())?;
        if rank0 {
            observe(Event::Summary(Box::new(summary)));
        }
        if let (Some(_), Some(scaling), Some(adapter), true) = (&self.lora, &self.config.rope_scaling, &adapter, rank0)
        {
            let (dir, file) = (adapter.display(), autosp_models::peft::BASE_CONFIG);
            observe(Event::Info(format!(
                "the adapter was trained with {} RoPE scaling ({dir}/{file}), and PEFT loads the base's own config: \
                 load it as trained with AutoModelForCausalLM.from_pretrained(\"{dir}\", \
                 config=AutoConfig.from_pretrained(\"{dir}/{file}\")), or merge it (--merge-lora)",
                scaling.rope_type()
            )));
        }
        if let (Some(out), Some(adapter), true) = (&o.merge_lora, &adapter, rank0) {
            // The adapter's checkpoint holds the run's positions (its base config).
            let merged = merge_into(&self.source, adapter, out, None)?;
            observe(Event::Info(format!(
                "merged the adapter of {} into the base model: {} (an HF checkpoint transformers loads as it is)",
                adapter.display(),
                merged.display()
            )));
        }
        Ok(Ended::Done)
    }

    /// The lines that describe the run before training: the model, the compiled plan, the collectives, the
    /// attention window and the task.
    fn describe(&self, c: &crate::Compiled<LlamaModel>, device: &Device) -> Result<Vec<String>> {
        let (o, d) = (&self.options, &self.config);
        let mut lines = vec![
            format!(
                "{}: model {} ({} layers, hidden {}, {} heads / {} kv heads, vocab {}) on {:?}",
                self.name,
                self.source,
                d.num_hidden_layers,
                d.hidden_size,
                d.num_attention_heads,
                d.num_key_value_heads,
                d.vocab_size,
                device.location()
            ),
            format!(
                "compiled for P = {} {} ranks{}: {:?} ({}), checkpointing {:?}, compute dtype {}{}; {} tokens per \
                 sequence ({} per rank), {} sequence(s) per step, data {}",
                self.mesh.sequence,
                if self.threads { "thread" } else { "MPI" },
                if self.mesh.data > 1 {
                    format!(" in each of {} data-parallel replicas ({} ranks)", self.mesh.data, self.p)
                } else {
                    String::new()
                },
                c.resolved().strategy,
                c.resolved().reason,
                o.checkpoint,
                self.dtype.as_str(),
                if Precision::float(self.dtype).needs_master() {
                    " (f32 master weights, moments, loss and gradient all-reduce)"
                } else {
                    ""
                },
                o.seq_len,
                c.padded_len(o.seq_len) / self.mesh.sequence,
                self.train.micro_batches * self.mesh.data,
                o.data
            ),
            self.carrier.describe(device),
            format!("model states (--shard {}: {}): {}", c.sharding(), c.sharding_reason(), c.model_state_bytes()),
        ];
        if self.p > 1 {
            lines.push(communication_line(c));
        }
        if let Some(lora) = c.model().lora_config() {
            let all: usize = autosp_core::module::all_params(c.model()).iter().map(|p| p.shape().elem_count()).sum();
            let trained: usize = c.params().iter().map(|p| p.shape().elem_count()).sum();
            lines.push(format!(
                "LoRA: {} (scale {}); {trained} of {all} parameters train ({:.2}%), the base is frozen{}",
                super::lora::describe(&lora),
                lora.alpha / lora.r as f64,
                100.0 * trained as f64 / all.max(1) as f64,
                match self.lora.as_ref().and_then(|l| l.weights.as_ref()) {
                    Some(_) => "; starting from a saved adapter",
                    None => "",
                }
            ));
        }
        lines.extend([format!(
            "optimizer: AdamW, peak lr {:e}{}, weight decay {} {}",
            self.train.lr,
            match (o.lr, &self.resume, o.model.is_some() || self.lora.as_ref().is_some_and(|l| l.base.is_some())) {
                (Some(_), _, _) => " (--lr)",
                (None, Some(_), _) => " (the checkpoint's)",
                (None, None, true) if self.lora.is_some() =>
                    " (the LoRA default for a pretrained --model; --lr to change it)",
                (None, None, true) => " (the default for a pretrained --model; --lr to change it)",
                (None, None, false) => " (the demo model's default)",
            },
            self.train.adamw.weight_decay,
            if self.train.decay_all {
                "on every parameter"
            } else {
                "on the projection matrices only (norms, biases and the embedding are not decayed; --decay-all to \
                     decay them)"
            }
        )]);
        if let Some(w) = c.max_attention_distance() {
            lines.push(format!(
                "attention window (--max-attention-distance {w}): each token sees only the {} tokens at most {w} \
                 positions before it{}",
                w + 1,
                if w + 1 >= o.seq_len { " (every token of a sequence: the window hides nothing)" } else { "" }
            ));
        }
        let windowed: Vec<String> =
            (0..d.num_hidden_layers).filter(|&i| d.attention_window(i).is_some()).map(|i| i.to_string()).collect();
        if let (Some(w), false) = (d.sliding_window, windowed.is_empty()) {
            lines.push(format!(
                "attention window from the checkpoint (sliding_window {w}): on layer(s) {} each token sees itself \
                 and the {} tokens before it{}",
                windowed.join(", "),
                w - 1,
                if o.max_attention_distance.is_some() { "; --max-attention-distance narrows it further" } else { "" }
            ));
        }
        if let Some(extended) = &self.rope_extended {
            lines.push(extended.describe());
        }
        match &d.rope_scaling {
            // The extension's line says the type, factor and windows; the scaling's own line adds only the
            // warnings of the length-dependent types.
            Some(scaling) if self.rope_extended.is_none() || scaling.depends_on_length() => {
                lines.push(scaling.describe(d.max_position_embeddings, o.seq_len))
            }
            Some(_) => {}
            None => lines.extend(autosp_models::unscaled_window_warning(d.max_position_embeddings, o.seq_len)),
        }
        if let Stream::Corpus { corpus, seq_len, .. } = &self.stream {
            lines.push(corpus.describe(*seq_len));
        }
        lines.extend(self.stream.describe_packing(d.max_position_embeddings)?);
        if let Stream::Needles(_) = self.stream {
            let tokens = self.train.tokens_per_step() * self.mesh.data;
            lines.push(Needles::describe(c, o.seq_len, o.steps, &self.train.curriculum, tokens)?);
        }
        Ok(lines)
    }
}

/// How a compiled model of several ranks moves its gradients and weights: buckets and their dtype, whether a
/// communication thread overlaps them with backward, and the gather prefetch at `parameters`.
fn communication_line(c: &crate::Compiled<LlamaModel>) -> String {
    let r = c.reduction();
    let mut line = if c.sharding() <= ShardLevel::Optimizer {
        format!(
            "communication: gradients reduced in buckets of {} MiB (--bucket-mb), sent in {} (--reduce-dtype), {}",
            super::metrics::mib(r.bucket_bytes as f64),
            r.dtype.as_str(),
            if c.overlaps_reduction() { "on a communication thread while backward runs" } else { "after backward" }
        )
    } else {
        format!(
            "communication: each use's gradient reduce-scattered in backward, sent in {} (--reduce-dtype), {}",
            r.dtype.as_str(),
            if c.overlaps_reduction() { "on a communication thread while backward runs" } else { "inline" }
        )
    };
    if c.sharding() == ShardLevel::Parameters {
        line.push_str(if c.prefetches_gathers() {
            "; the next block's weights gathered on a communication thread while a block computes"
        } else {
            "; each weight gathered at its use"
        });
    }
    line
}
