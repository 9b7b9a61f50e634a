//! The job: what every rank needs, prepared (and checked) before any rank starts, and the loop each rank
//! runs: compile, optionally explain or evaluate and exit, probe the synthetic task's accuracy (needles or
//! passkey; the needles curriculum's stages too), train with gradient
//! accumulation, clipping, AdamW and a warm-up + cosine schedule, report (rank 0 only), save checkpoints,
//! and stop cleanly on Ctrl-C.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autosp::core::comm::{ProcessGroup, ReduceOp};
use autosp::core::optim::{clip_to_norm, global_norm, AdamW, AdamWConfig, LrSchedule, Optimizer};
use autosp::core::{Gradients, Param, Precision};
use autosp::models::LlamaModel;
use autosp::{compile, CompileConfig, Compiled};
use candle_core::{DType, Device, Tensor};

use crate::args::{Args, DataSource};
use crate::checkpoint::{self, TrainerState};
use crate::collectives::Carrier;
use crate::data::{self, Passkey, PasskeyVocab, Sample, Stream};
use crate::heldout::HeldOut;
use crate::model;
use crate::progress::Progress;
use crate::summary::{Accuracy, EvalLoss, Score, Summary};
use crate::task::{self, Curriculum, Needles};

/// Everything the ranks share, read and checked before they start.
pub struct Job {
    pub args: Args,
    /// Ranks.
    pub p: usize,
    /// Whether ranks are threads of this process (process memory is then shared).
    pub threads: bool,
    /// The compute dtype (`--dtype`, or the device's default).
    pub dtype: DType,
    /// The starting weights in the master dtype (f32; each rank builds its own copy in `dtype`, and under
    /// bf16/f16 starts its optimizer's master weights from them).
    pub base: LlamaModel,
    /// Where the model came from (for the report).
    pub source: String,
    /// `tokenizer.json`'s text, written into every checkpoint.
    pub tokenizer_json: Option<String>,
    pub stream: Stream,
    /// Held-out samples for the accuracy probe (passkey and needles data only), at --seq-len.
    pub probes: Vec<Sample>,
    /// Sequence lengths over the steps (`--data needles`; otherwise every step at --seq-len).
    pub curriculum: Curriculum,
    pub eval_ids: Option<Vec<u32>>,
    /// `--eval-data`: held-out tokens scored before, during and after training.
    pub heldout: Option<HeldOut>,
    pub resume: Option<(PathBuf, TrainerState)>,
    /// What a resumed run changes (`--steps 4 -> 8`), accepted with --allow-changes; printed by rank 0.
    pub resume_changes: Vec<String>,
    pub save_root: PathBuf,
    pub micro: usize,
    /// The device of this process's ranks: thread ranks share it; with one process per rank, `run_mpi_rank`
    /// opens the process's own after `prepare` (`None` until then; `run_rank` then opens it).
    pub device: Option<Device>,
    /// The back end that carries the collectives (thread ranks, MPI, or NCCL over MPI), for the report.
    pub carrier: Carrier,
}

/// How a rank's run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    Done,
    Interrupted,
    /// Failed, and the error is already reported (one process per rank: said before the others were told).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    Failed,
}

impl Job {
    /// Reads the model, the data and the checkpoint to resume, checking them all before anything runs.
    pub fn prepare(args: Args, p: usize, threads: bool) -> Result<Self> {
        if p == 0 {
            bail!("--sp 0: there must be at least one rank; give --sp 1 or more");
        }
        if args.seq_len < 2 {
            bail!(
                "--seq-len {}: a training sequence needs at least 2 tokens (an input and its next token); give \
                 --seq-len 2 or more",
                args.seq_len
            );
        }
        if p > args.seq_len {
            bail!(
                "--sp {p} is larger than --seq-len {}: every rank needs at least one token of the sequence; lower \
                 --sp to at most {} or raise --seq-len",
                args.seq_len,
                args.seq_len
            );
        }
        // A typo in AUTOSP_KERNELS or a device this build cannot open fails here, before any rank starts.
        autosp::kernels::dispatch::kernels_from_env().map_err(anyhow::Error::msg)?;
        // Likewise a typo in AUTOSP_SIMD, or a vector path this CPU lacks.
        autosp::kernels::simd::simd_from_env()?;
        // Thread ranks share one device handle (tensors pass between them as they are); one process per rank
        // opens its own in `run_rank`.
        let device = if threads { Some(args.device_spec().open(None)?) } else { None };
        let micro = args.micro_batches().map_err(anyhow::Error::msg)?;
        let dtype = args.compute_dtype();
        let curriculum = match (DataSource::parse(&args.data), &args.curriculum) {
            (DataSource::Needles, Some(c)) => Curriculum::parse(c, args.seq_len)?,
            (DataSource::Needles, None) => Curriculum::default_for(args.seq_len, args.steps),
            (_, Some(_)) => {
                bail!("--curriculum works with --data needles only (the other data come in --seq-len sequences)")
            }
            (_, None) => Curriculum::parse("none", args.seq_len)?,
        };
        let mut resume_changes = Vec::new();
        let resume = match &args.resume {
            Some(dir) => {
                let state = checkpoint::verify(dir)?;
                // The schedule, the sequence length and the attention window may change with --allow-changes
                // (older checkpoints did not record the schedule: nothing to compare; they had no window).
                let window = |w: Option<usize>| w.map_or("none".to_string(), |w| w.to_string());
                let may_change = [
                    ("--seq-len", Some(state.seq_len.to_string()), args.seq_len.to_string()),
                    (
                        "--max-attention-distance",
                        Some(window(state.max_attention_distance)),
                        window(args.max_attention_distance),
                    ),
                    ("--steps", state.steps.map(|x| x.to_string()), args.steps.to_string()),
                    ("--lr", state.lr.map(|x| x.to_string()), args.lr.to_string()),
                    ("--warmup", state.warmup.map(|x| x.to_string()), args.warmup.to_string()),
                    ("--curriculum", state.curriculum.clone(), curriculum.flag()),
                ];
                for (what, saved, now) in may_change {
                    if let Some(saved) = saved.filter(|s| *s != now) {
                        resume_changes.push(format!("{what} {saved} -> {now}"));
                    }
                }
                if !resume_changes.is_empty() && !args.allow_changes {
                    bail!(
                        "--resume {}: this run changes {} from the checkpoint's run; resume with the checkpoint's \
                         values, or pass --allow-changes to go on with the new ones",
                        dir.display(),
                        resume_changes.join(", ")
                    );
                }
                let same = [
                    ("--batch-tokens / --seq-len", state.micro_batches.to_string(), micro.to_string()),
                    ("--data", state.data_source.clone(), args.data.clone()),
                    ("--seed", state.seed.to_string(), args.seed.to_string()),
                    ("--dtype", state.dtype.as_str().to_string(), dtype.as_str().to_string()),
                ];
                for (what, saved, now) in same {
                    if saved != now {
                        bail!(
                            "--resume {}: the checkpoint was trained with {what} {saved}, this run has {now}; \
                             resume with the same options",
                            dir.display()
                        );
                    }
                }
                Some((dir.clone(), state))
            }
            None => None,
        };
        let source = match (&resume, &args.model) {
            (Some((dir, _)), _) => dir.display().to_string(),
            (None, Some(m)) => m.clone(),
            (None, None) => model::tiny_model(args.seed)?.display().to_string(),
        };
        let loaded = model::load(&source, Precision::float(dtype).master())?;
        let vocab = loaded.model.config.vocab_size;
        let mut probes = Vec::new();
        let stream = match DataSource::parse(&args.data) {
            DataSource::Needles => {
                let mut held_out = Needles::new(vocab, args.seed.wrapping_add(0x00AB_5E11))?;
                for _ in 0..if args.quick { 4 } else { 16 } {
                    probes.push(held_out.sample(args.seq_len)?);
                }
                Stream::Needles(Needles::new(vocab, args.seed)?)
            }
            DataSource::Passkey => {
                let pv = match &loaded.tokenizer {
                    Some(t) => PasskeyVocab::Text(Box::new(t.clone())),
                    None => PasskeyVocab::Ids { vocab },
                };
                let mut held_out = Passkey::new(pv.clone(), args.seq_len, args.seed.wrapping_add(0x00AB_5E11))?;
                let n = if args.quick { 4 } else { 8 };
                for _ in 0..n {
                    probes.push(held_out.sample()?);
                }
                Stream::Passkey(Passkey::new(pv, args.seq_len, args.seed)?)
            }
            DataSource::Ids(f) => {
                let ids = data::read_ids(&f, vocab)?;
                Stream::Packed { seqs: data::pack(&ids, args.seq_len, &f.display().to_string())?, next: 0 }
            }
            DataSource::Text(f) => {
                let docs = data::read_documents(&f)?;
                let tok = loaded.tokenizer.as_ref().with_context(|| {
                    format!(
                        "--data {}: text needs the model's tokenizer, and `{source}` has no tokenizer.json; give \
                         token ids with --data ids:FILE",
                        f.display()
                    )
                })?;
                let ids = data::tokenize(tok, &docs, loaded.model.config.eos_token_id)?;
                Stream::Packed { seqs: data::pack(&ids, args.seq_len, &f.display().to_string())?, next: 0 }
            }
        };
        let eval_ids = match &args.eval_tokens {
            Some(f) => {
                let ids = data::read_ids(f, vocab)?;
                if ids.len() < 2 {
                    bail!("--eval-tokens {}: needs at least 2 token ids, found {}", f.display(), ids.len());
                }
                Some(ids)
            }
            None => None,
        };
        let heldout = match &args.eval_data {
            Some(spec) => Some(HeldOut::load(
                spec,
                args.seq_len,
                vocab,
                loaded.tokenizer.as_ref(),
                loaded.model.config.eos_token_id,
            )?),
            None => None,
        };
        let save_root = match (&args.save, &resume) {
            (Some(d), _) => d.clone(),
            (None, Some((dir, _))) => dir.parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from(".")),
            (None, None) => model::cache_dir().join("runs").join("latest"),
        };
        let schedule = schedule(&args);
        schedule.validate().map_err(|e| anyhow::anyhow!("--lr / --warmup / --steps: {e}"))?;
        Ok(Job {
            p,
            threads,
            dtype,
            base: loaded.model,
            source,
            tokenizer_json: loaded.tokenizer_json,
            stream,
            probes,
            curriculum,
            eval_ids,
            heldout,
            resume,
            resume_changes,
            save_root,
            micro,
            device,
            carrier: if threads { Carrier::Threads } else { Carrier::Mpi },
            args,
        })
    }
}

/// Linear warm-up to `--lr`, then cosine decay to `--lr / 10` at the last step.
fn schedule(a: &Args) -> LrSchedule {
    LrSchedule::WarmupCosine { peak: a.lr, min_lr: a.lr / 10.0, warmup: a.warmup.min(a.steps), total: a.steps }
}

fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

/// Teacher-forced answer accuracy: for every answer token, whether the argmax of the logits at the token
/// before it is that token (earlier answer tokens are given, not generated). Returns (tokens right, tokens,
/// samples with every answer right). Collective.
fn answer_accuracy(c: &Compiled<LlamaModel>, probes: &[Sample]) -> Result<(usize, usize, usize)> {
    let (mut right, mut total, mut keys) = (0, 0, 0);
    for s in probes {
        let n = s.ids.len();
        let ids = Tensor::from_vec(s.ids.clone(), (1, n), &Device::Cpu)?;
        let k = s.answers.len();
        // Only the scored rows travel between the ranks, not the whole [n, vocab] logits.
        let scored: Vec<usize> = s.answers.iter().map(|&a| a - 1).collect();
        let logits = c.logits_at(&ids, &scored)?;
        let rows = logits.argmax(2)?.flatten_all()?.to_vec1::<u32>()?;
        let ok = rows.iter().zip(s.answers.iter().map(|&a| s.ids[a])).filter(|(a, b)| **a == *b).count();
        right += ok;
        total += k;
        keys += usize::from(ok == k);
    }
    Ok((right, total, keys))
}

/// Held-out samples scored at the end of each curriculum stage (the first ones of the probe set).
const STAGE_PROBES: usize = 4;

/// What the needles task needs of the run, in one line: where the evidence and the questions sit at
/// `seq_len` (tokens, and the ranks holding them under the compiled layout), the distance between them,
/// chance, and the curriculum.
fn needles_line(
    c: &Compiled<LlamaModel>,
    seq_len: usize,
    steps: usize,
    p: usize,
    curriculum: &Curriculum,
    tokens_per_step: usize,
) -> Result<String> {
    let n_pad = c.padded_len(seq_len);
    let (ev, qs) = (Needles::evidence(seq_len), Needles::questions(seq_len));
    let (mut ev_ranks, mut q_ranks) = (Vec::new(), Vec::new());
    for r in 0..p {
        let pos = c.positions(n_pad, r)?;
        if pos.iter().any(|x| ev.contains(x)) {
            ev_ranks.push(r.to_string());
        }
        if pos.iter().any(|x| qs.contains(x)) {
            q_ranks.push(r.to_string());
        }
    }
    let mut stages: Vec<String> = curriculum.stages.iter().map(|(l, s)| format!("{s} steps at {l}")).collect();
    let short: usize = curriculum.stages.iter().map(|s| s.1).sum();
    stages.push(format!("{} at {seq_len}", steps.saturating_sub(short)));
    Ok(format!(
        "task: needles. {} needles stated {} times each in tokens {}-{} (rank {}), asked for in tokens {}-{} \
         (rank {}): every answer is {} to {} tokens before its question; chance {:.1}% (1 in {}). Loss on the \
         answers only; curriculum: {} ({tokens_per_step} tokens per step)",
        task::CLASSES,
        task::copies(seq_len),
        ev.start,
        ev.end - 1,
        ev_ranks.join(", "),
        qs.start,
        qs.end - 1,
        q_ranks.join(", "),
        Needles::min_distance(seq_len),
        qs.end - 1 - ev.start,
        100.0 / task::VALUES as f64,
        task::VALUES,
        stages.join(", ")
    ))
}

/// Gathers `values` from every rank (f64, exact for byte counts) to every rank: `[rank][i]`.
fn gather(pg: &Arc<dyn ProcessGroup>, values: &[f64]) -> Result<Vec<Vec<f64>>> {
    let t = Tensor::new(values, &Device::Cpu)?;
    let all = pg.all_gather(&t, 0)?.to_vec1::<f64>()?;
    Ok(all.chunks(values.len()).map(<[f64]>::to_vec).collect())
}

/// One rank's whole run.
pub fn run_rank(pg: Arc<dyn ProcessGroup>, job: &Job) -> Result<Ended> {
    let a = &job.args;
    let rank0 = pg.rank() == 0;
    let say = |s: &str| {
        if rank0 {
            println!("{s}");
        }
    };
    // Thread ranks share one device; one process per rank takes its node-local rank's GPU.
    let device = match &job.device {
        Some(d) => d.clone(),
        None => a.device_spec().open(Some((autosp::device::local_rank(pg.rank()), pg.size())))?,
    };
    // The loaded weights (master dtype, f32) on the device; the model computes in their `dtype` rounding.
    let base = job
        .base
        .to_weights()
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(&device)?)))
        .collect::<Result<std::collections::HashMap<String, Tensor>>>()?;
    let weights = base
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.to_dtype(job.dtype)?)))
        .collect::<Result<std::collections::HashMap<String, Tensor>>>()?;
    let model = LlamaModel::from_weights(&job.base.config, weights)?;
    let mut cfg = CompileConfig::new(pg.clone(), a.strategy, a.checkpoint)
        .with_dtype(job.dtype)
        .with_max_attention_distance(a.max_attention_distance);
    cfg.seq_len = Some(a.seq_len);
    let mut c = compile(model, cfg).with_context(|| {
        format!(
            "--sp {} --strategy {} --checkpoint {} --seq-len {} cannot be compiled",
            job.p,
            crate::args::strategy_flag(a.strategy),
            crate::args::checkpoint_flag(a.checkpoint),
            a.seq_len
        )
    })?;

    if a.explain {
        let text = c.explain(a.seq_len)?;
        say(&text);
        return Ok(Ended::Done);
    }
    if let Some(ids) = &job.eval_ids {
        let n = ids.len();
        let (loss, targets) = c.eval_loss(&Tensor::from_vec(ids.clone(), (1, n), &Device::Cpu)?, None)?;
        let line = serde_json::json!({
            "eval_loss": loss, "tokens": n, "targets": targets, "sp": job.p, "model": job.source,
        });
        say(&line.to_string());
        return Ok(Ended::Done);
    }

    // One run at a time saves into a directory (rank 0 saves; it holds the lock until the run ends).
    let _lock = if rank0 { Some(checkpoint::SaveLock::acquire(&job.save_root)?) } else { None };

    let d = &job.base.config;
    let tokens_per_step = a.seq_len * job.micro;
    say(&format!(
        "llama_longctx: model {} ({} layers, hidden {}, {} heads / {} kv heads, vocab {}) on {:?}",
        job.source,
        d.num_hidden_layers,
        d.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.vocab_size,
        device.location()
    ));
    say(&format!(
        "compiled for P = {} {} ranks: {:?} ({}), checkpointing {:?}, compute dtype {}{}; {} tokens per sequence \
         ({} per rank), {} sequence(s) per step, data {}",
        job.p,
        if job.threads { "thread" } else { "MPI" },
        c.resolved().strategy,
        c.resolved().reason,
        a.checkpoint,
        job.dtype.as_str(),
        if Precision::float(job.dtype).needs_master() {
            " (f32 master weights, moments, loss and gradient all-reduce)"
        } else {
            ""
        },
        a.seq_len,
        c.padded_len(a.seq_len) / job.p,
        job.micro,
        a.data
    ));
    say(&job.carrier.describe(&device));
    if let Some(w) = c.max_attention_distance() {
        say(&format!(
            "attention window (--max-attention-distance {w}): each token sees only the {} tokens at most {w} \
             positions before it{}",
            w + 1,
            if w + 1 >= a.seq_len { " (every token of a sequence: the window hides nothing)" } else { "" }
        ));
    }

    if let Stream::Needles(_) = job.stream {
        say(&needles_line(&c, a.seq_len, a.steps, job.p, &job.curriculum, a.seq_len * job.micro)?);
    }

    let params: Vec<Param> = c.params();
    let mut opt = AdamW::new(AdamWConfig::default())?;
    if Precision::float(job.dtype).needs_master() {
        // The masters start from the loaded weights (f32), not from their bf16/f16 rounding.
        for p in &params {
            let w = base.get(p.name()).with_context(|| format!("the loaded model has no `{}`", p.name()))?;
            opt.set_master(p, w)?;
        }
    }
    drop(base);
    let mut stream = job.stream.clone();
    let (mut step, mut drawn) = (0usize, 0u64);
    if let Some((dir, st)) = &job.resume {
        checkpoint::restore_optimizer(dir, &mut opt, &params, st.optimizer_step)?;
        stream.seek(st.data);
        step = st.step;
        drawn = st.data.drawn;
        say(&format!("resumed from {} at step {step}", dir.display()));
        if !job.resume_changes.is_empty() {
            say(&format!("resumed with changes (--allow-changes): {}", job.resume_changes.join(", ")));
        }
    }
    let first_step = step;
    let sched = schedule(a);

    let before = if job.probes.is_empty() { None } else { Some(answer_accuracy(&c, &job.probes)?) };
    let eval_before = match &job.heldout {
        Some(h) => {
            let (loss, n) = h.evaluate(&c)?;
            if rank0 {
                let ids = job.save_root.join("heldout-ids.txt");
                h.write_ids(&ids)?;
                say(&format!(
                    "held-out loss before training: {loss:.4} ({} tokens, {n} next-token targets, of {}; ids in {})",
                    h.ids.len(),
                    h.source,
                    ids.display()
                ));
            }
            Some(loss)
        }
        None => None,
    };
    let mut metrics = match (&a.metrics, rank0) {
        (Some(f), true) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(f)
                .with_context(|| format!("opening --metrics {}", f.display()))?,
        ),
        _ => None,
    };
    let save = |c: &Compiled<LlamaModel>, opt: &AdamW, step: usize, drawn: u64, stream: &Stream| -> Result<PathBuf> {
        let state = TrainerState {
            step,
            optimizer_step: opt.steps(),
            data: stream.position(drawn),
            seq_len: a.seq_len,
            micro_batches: job.micro,
            data_source: a.data.clone(),
            seed: a.seed,
            dtype: job.dtype,
            steps: Some(a.steps),
            lr: Some(a.lr),
            warmup: Some(a.warmup),
            max_attention_distance: a.max_attention_distance,
            curriculum: Some(job.curriculum.flag()),
        };
        checkpoint::save(&job.save_root, c.model(), opt, &params, &state, job.tokenizer_json.as_deref())
    };

    if let (Some(m), Some(loss)) = (metrics.as_mut(), eval_before) {
        writeln!(m, "{}", serde_json::json!({ "step": step, "eval_loss": loss }))?;
    }
    let mut bar = Progress::new(step, a.steps, rank0 && !a.no_progress);
    let (mut first_loss, mut last_loss) = (None, f64::NAN);
    let (mut tape_peaks, mut proc_peaks) = (vec![0f64; job.p], vec![0f64; job.p]);
    let (mut tokens, mut seconds) = (0usize, 0f64);
    let mut interrupted = false;
    // The newest complete checkpoint of this run (or the one it resumed from), named when training stops.
    let mut last_saved = job.resume.as_ref().map(|(d, _)| d.clone());
    let mut skipped = 0usize;
    while step < a.steps {
        let flag = Tensor::new(&[f64::from(u8::from(crate::interrupt::requested()))], &Device::Cpu)?;
        if pg.all_reduce(&flag, ReduceOp::Max)?.to_vec1::<f64>()?[0] > 0.0 {
            interrupted = true;
            break;
        }
        let t0 = Instant::now();
        let mut grads = Gradients::new();
        let (mut loss_sum, mut count, mut tape_peak) = (0f64, 0usize, 0usize);
        // The curriculum's length for this step: seq_len / len sequences of len tokens per micro-batch.
        let len = job.curriculum.len_at(step);
        for _ in 0..job.micro {
            let (mut ids, mut labels) = (Vec::with_capacity(a.seq_len), Vec::with_capacity(a.seq_len));
            for _ in 0..a.seq_len / len {
                let s = stream.next(len)?;
                drawn += 1;
                labels.extend(s.answer_labels());
                ids.extend(s.ids);
            }
            let rows = a.seq_len / len;
            let labels = match stream.answers_only() {
                true => Some(Tensor::from_vec(labels, (rows, len), &Device::Cpu)?),
                false => None,
            };
            let ids = Tensor::from_vec(ids, (rows, len), &Device::Cpu)?;
            let out = c.train_step(&ids, labels.as_ref())?;
            tape_peak = tape_peak.max(out.peak_bytes);
            if job.micro == 1 {
                grads = out.grads;
            } else {
                // Token-weighted mean over the micro-batches: sum count_i * grad_i, divided below.
                let w = out.valid_tokens as f64;
                for p in &params {
                    if let Some(g) = out.grads.get(p) {
                        grads.accumulate(p, &(g * w)?)?;
                    }
                }
            }
            loss_sum += out.loss * out.valid_tokens as f64;
            count += out.valid_tokens;
        }
        if job.micro > 1 {
            grads.scale(1.0 / count as f64)?;
        }
        let loss = loss_sum / count as f64;
        if step == first_step && rank0 {
            if let Some(f) = &a.dump_grads {
                let named: std::collections::HashMap<String, Tensor> = params
                    .iter()
                    .filter_map(|p| grads.get(p).map(|g| (p.name().to_string(), g.to_dtype(DType::F32))))
                    .map(|(n, g)| g.map(|g| (n, g)))
                    .collect::<candle_core::Result<_>>()?;
                candle_core::safetensors::save(&named, f)
                    .with_context(|| format!("writing --dump-grads {}", f.display()))?;
                say(&format!("gradients of step {} written to {}", step + 1, f.display()));
            }
        }
        // Loss and gradients are the same on every rank (all-reduced), so every rank decides alike.
        let norm = global_norm(&grads)?;
        let nonfinite = if !loss.is_finite() {
            Some(format!("loss is not finite at step {} ({loss})", step + 1))
        } else if !norm.is_finite() {
            Some(format!("gradient norm is not finite at step {} ({norm})", step + 1))
        } else {
            None
        };
        if let Some(what) = nonfinite {
            if !a.skip_nonfinite {
                let kept = match &last_saved {
                    Some(d) => format!("the last checkpoint, {}, is kept", d.display()),
                    None => "no checkpoint of this run was saved".to_string(),
                };
                bail!(
                    "{what}: training stopped and this state was not saved ({kept}); lower --lr or --grad-clip, \
                     check the data, or pass --skip-nonfinite to skip such steps"
                );
            }
            step += 1;
            skipped += 1;
            if rank0 {
                bar.println(&format!("step {step:>4}/{}: skipped, {what}: no update (--skip-nonfinite)", a.steps));
                if let Some(m) = metrics.as_mut() {
                    writeln!(m, "{}", serde_json::json!({ "step": step, "skipped": what }))?;
                }
            }
            continue;
        }
        if a.grad_clip > 0.0 {
            clip_to_norm(&mut grads, norm, a.grad_clip)?;
        }
        let lr = sched.lr(step);
        opt.step(&params, &grads, lr)?;
        step += 1;
        let dt = t0.elapsed().as_secs_f64();
        tokens += tokens_per_step;
        seconds += dt;
        let tps = tokens_per_step as f64 / dt;
        let peaks = gather(&pg, &[tape_peak as f64, crate::ALLOC.peak_bytes() as f64])?;
        for (r, v) in peaks.iter().enumerate() {
            tape_peaks[r] = tape_peaks[r].max(v[0]);
            proc_peaks[r] = proc_peaks[r].max(v[1]);
        }
        first_loss.get_or_insert(loss);
        last_loss = loss;
        if rank0 {
            let tape: Vec<String> = peaks.iter().map(|v| format!("{:.1}", mib(v[0]))).collect();
            bar.println(&format!(
                "step {step:>4}/{} loss {loss:.4} lr {lr:.2e} grad-norm {norm:.3} {tps:>7.0} tok/s tape peak [{}] MiB \
                 process peak {:.1} MiB",
                a.steps,
                tape.join(", "),
                mib(proc_peaks.iter().cloned().fold(0.0, f64::max))
            ));
            bar.update(step, loss, tps);
            if let Some(m) = metrics.as_mut() {
                let line = serde_json::json!({
                    "step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tps,
                    "tape_peak_bytes": peaks.iter().map(|v| v[0] as u64).collect::<Vec<_>>(),
                    "process_peak_bytes": peaks.iter().map(|v| v[1] as u64).collect::<Vec<_>>(),
                });
                writeln!(m, "{line}")?;
            }
        }
        // At the end of each curriculum stage: accuracy on the first held-out --seq-len probes (collective).
        if step < a.steps && len != job.curriculum.len_at(step) && !job.probes.is_empty() {
            let few = &job.probes[..job.probes.len().min(STAGE_PROBES)];
            let acc = answer_accuracy(&c, few)?;
            if rank0 {
                bar.println(&format!(
                    "stage of {len}-token sequences done at step {step}: accuracy at {} tokens {:.1}% ({}/{} answers \
                     of {} held-out samples)",
                    a.seq_len,
                    100.0 * acc.0 as f64 / acc.1.max(1) as f64,
                    acc.0,
                    acc.1,
                    few.len()
                ));
            }
        }
        if let Some(h) = job.heldout.as_ref().filter(|_| a.eval_every > 0 && step % a.eval_every == 0 && step < a.steps)
        {
            let (loss, _) = h.evaluate(&c)?;
            if rank0 {
                bar.println(&format!("step {step:>4}/{} held-out loss {loss:.4}", a.steps));
                if let Some(m) = metrics.as_mut() {
                    writeln!(m, "{}", serde_json::json!({ "step": step, "eval_loss": loss }))?;
                }
            }
        }
        if a.save_every > 0 && step % a.save_every == 0 && step < a.steps {
            if rank0 {
                let dir = save(&c, &opt, step, drawn, &stream)?;
                bar.println(&format!("checkpoint: {}", dir.display()));
            }
            last_saved = Some(checkpoint::step_dir(&job.save_root, step));
        }
    }
    bar.finish();

    if interrupted {
        if rank0 {
            if step > first_step {
                let dir = save(&c, &opt, step, drawn, &stream)?;
                println!("interrupted after step {step}: checkpoint saved to {}", dir.display());
            } else {
                println!("interrupted before the first step: nothing to save");
            }
        }
        return Ok(Ended::Interrupted);
    }

    let after = if job.probes.is_empty() { None } else { Some(answer_accuracy(&c, &job.probes)?) };
    let eval_after = match &job.heldout {
        Some(h) => Some(h.evaluate(&c)?),
        None => None,
    };
    if rank0 {
        let dir = save(&c, &opt, step, drawn, &stream)?;
        if let (Some(m), Some((loss, _))) = (metrics.as_mut(), eval_after) {
            writeln!(m, "{}", serde_json::json!({ "step": step, "eval_loss": loss }))?;
        }
        // Teacher-forced: each answer token predicted with the true tokens before it.
        let (what, unit, whole, chance) = match job.stream {
            Stream::Needles(_) => ("needles", "answers", "samples all right", Some(1.0 / task::VALUES as f64)),
            _ => ("passkey", "answer tokens", "whole keys", None),
        };
        let score = |x: (usize, usize, usize)| Score {
            right: x.0,
            total: x.1,
            unit: unit.into(),
            note: format!("{}/{} {whole}", x.2, job.probes.len()),
        };
        let summary = Summary {
            first_step,
            last_step: step,
            loss: first_loss.map(|f| (f, last_loss)),
            eval: match (&job.heldout, eval_before, eval_after) {
                (Some(h), Some(before), Some((after, _))) => {
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
            throughput: (tokens > 0).then_some((tokens, seconds)),
            vector_path: c.device().is_cpu().then(|| autosp::kernels::simd::simd_path().name()),
            tape_peak: tape_peaks,
            heap_peak: proc_peaks,
            threads: job.threads,
            skipped,
            checkpoint: dir,
        };
        print!("{}", summary.table());
        if let Some(m) = metrics.as_mut() {
            writeln!(m, "{}", summary.to_json())?;
        }
    }
    Ok(Ended::Done)
}
