//! Running a compiled model: shifting labels before sharding, padding to the layout's multiple, taking this
//! rank's replica's rows and its shard of them, the global loss (sum of token losses over the valid count of
//! the whole world) and the parameter gradients reduced over the world (all-reduced whole, or this rank's
//! slice when model states are sharded; how, in `grad_reduce.rs`), once per step however many micro-batches
//! it accumulates ([`Accumulation`]); forward-only evaluation loss; and forward-only logits gathered back
//! into sequence order. Inputs are checked on the
//! whole batch, which every rank holds, before sharding: a bad batch fails on every rank at once, with the
//! same error and before any collective, instead of on the one rank whose shard holds the bad id.

use std::collections::HashMap;
use std::sync::Arc;

use autosp_core::comm::{ProcessGroup, ReduceOp};
use autosp_core::gather_prefetch::GatherPrefetch;
use autosp_core::grad_scatter::GradScatter;
use autosp_core::host_read;
use autosp_core::module::trainable_params;
use autosp_core::ops::{self, Documents, IGNORE_INDEX};
use autosp_core::optim::sum_of_squares;
use autosp_core::shard::ShardLevel;
use autosp_core::{CausalLm, CheckpointPolicy, Gradients, MemoryStats, ParamId, Precision, Tape, TokenCoordinates};
use autosp_kernels::sp::layout::gather_unshard;
use candle_core::{DType, Tensor};

use super::grad_reduce::{self, Buckets};
use super::row_groups::{self, per_group, row_groups, RowGroup};
use super::{CompileError, Compiled};

/// What one training step returns (the same on every rank).
#[derive(Clone, Debug)]
pub struct StepOutput {
    /// The mean token loss over the whole sequence (all ranks).
    pub loss: f64,
    /// Valid (not ignored) target tokens over all ranks.
    pub valid_tokens: usize,
    /// Parameter gradients, summed over the world: every rank holds the same whole gradients, or, when model
    /// states are sharded (`Compiled::sharding`), each rank its own slice `[chunk]` of each
    /// ([`Param::update_view`]'s shape: what the optimiser updates). They are f32 for f32, bf16 and f16
    /// parameters (f64 for f64 ones): a mixed-precision step computes them in bf16/f16, converts them to f32
    /// before the reduction, and hands them on in f32 (also at P = 1), so the sum over ranks, clipping and the
    /// optimiser never round to bf16.
    pub grads: Gradients,
    /// This rank's tape bytes when the forward pass ended.
    pub after_forward: MemoryStats,
    /// This rank's tape peak over the step.
    pub peak_bytes: usize,
    /// This rank's tape bytes after every increase over the step (only for the plan's probe steps; empty
    /// otherwise).
    pub memory_trace: Vec<usize>,
}

/// What one micro-batch of an accumulated step returns ([`Compiled::accumulate_step`]); the gradients stay in
/// the [`Accumulation`].
#[derive(Clone, Debug)]
pub struct MicroStep {
    /// The micro-batch's mean token loss over the whole world.
    pub loss: f64,
    /// Its valid target tokens over the world (its weight in the step's mean).
    pub valid_tokens: usize,
    /// This rank's tape bytes when the forward pass ended.
    pub after_forward: MemoryStats,
    /// This rank's tape peak over the micro-batch.
    pub peak_bytes: usize,
    /// This rank's tape bytes after every increase (probe steps only; empty otherwise).
    pub memory_trace: Vec<usize>,
}

/// The gradients of one step's micro-batches, kept on this rank until the step's one reduction: the sum of
/// each micro-batch's local (unreduced) gradients, each in its reduction dtype (f32 for bf16/f16/f32
/// parameters) and weighted by the micro-batch's valid tokens when the step has several micro-batches (so
/// that the step's gradient is the token-weighted mean, as one batch of all of them would give). Made per step
/// by [`Accumulation::new`], filled by [`Compiled::accumulate_step`], turned into the step's gradients by
/// [`Compiled::finish_accumulation`].
#[derive(Debug, Default)]
pub struct Accumulation {
    /// Whether micro-batches are weighted by their tokens (a step of several).
    weighted: bool,
    /// Σ weight · local gradient, by parameter (whole, or the tape's reduced slices at `gradients` and
    /// `parameters`).
    sums: HashMap<ParamId, Tensor>,
    /// The reduced gradients, once the last micro-batch reduced them.
    reduced: Option<Gradients>,
    /// Valid target tokens over the world, summed over the micro-batches so far.
    tokens: usize,
    /// The loss scale of the step's micro-batches.
    loss_scale: Option<f64>,
}

impl Accumulation {
    /// An empty accumulation for a step of `micro_batches` micro-batches (1: the gradients pass unweighted,
    /// bit for bit what [`Compiled::train_step`] returns).
    pub fn new(micro_batches: usize) -> Self {
        Self { weighted: micro_batches > 1, ..Self::default() }
    }

    /// Valid target tokens over the world of the micro-batches accumulated so far.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Parameter `id`'s local gradient `g` in its reduction dtype, times `weight` (unless 1), plus what the
    /// earlier micro-batches left for it (taken out of the sums).
    fn fold(&mut self, id: ParamId, g: Tensor, weight: f64) -> candle_core::Result<Tensor> {
        let mut g = g.to_dtype(Precision::float(g.dtype()).reduce())?;
        if weight != 1.0 {
            g = (g * weight)?;
        }
        match self.sums.remove(&id) {
            Some(before) => before + g,
            None => Ok(g),
        }
    }
}

/// `ids: [b, n]` -> `(ids, targets)` padded to `n_pad`: `targets[t] = labels[t + 1]`, the last one and the pad
/// ignored (-100). Labels default to the ids; a label of -100 is ignored.
pub fn shift_and_pad(ids: &Tensor, labels: Option<&Tensor>, n_pad: usize) -> Result<(Tensor, Tensor), CompileError> {
    let (b, n) = ids.dims2()?;
    let labels = match labels {
        Some(l) if l.dims() != [b, n] => {
            return Err(CompileError::Input(format!("labels have shape {:?} but ids have [{b}, {n}]", l.dims())))
        }
        Some(l) => l.to_dtype(DType::I64)?,
        None => ids.to_dtype(DType::I64)?,
    };
    let ignore = |len: usize| Tensor::full(IGNORE_INDEX, (b, len), ids.device());
    let targets = Tensor::cat(&[labels.narrow(1, 1, n - 1)?, ignore(1 + n_pad - n)?], 1)?;
    Ok((pad_ids(ids, n_pad)?, targets))
}

/// Checks `ids: [b, n]` (and `labels`, same shape) against a vocabulary of `vocab` ids: every id in
/// `0..vocab`, every label in `0..vocab` or -100 (ignored), at least `min_len` tokens per sequence, integer
/// dtypes. Reads the batch to the host once (ids are small next to activations).
pub fn check_batch(ids: &Tensor, labels: Option<&Tensor>, vocab: usize, min_len: usize) -> Result<(), CompileError> {
    let (b, n) = match ids.dims() {
        &[b, n] => (b, n),
        dims => {
            return Err(CompileError::Input(format!(
                "token ids must have shape [batch, seq_len], got {dims:?}; reshape a single sequence to [1, n]"
            )))
        }
    };
    if b == 0 || n < min_len {
        return Err(CompileError::Input(format!(
            "a batch of {b} sequence(s) of {n} token(s): need at least one sequence of at least {min_len} tokens"
        )));
    }
    let check = |what: &str, t: &Tensor, ignore: Option<i64>| -> Result<(), CompileError> {
        if t.dtype().is_float() {
            return Err(CompileError::Input(format!(
                "{what} must be integers (u32 or i64), got {:?}; convert them before the step",
                t.dtype()
            )));
        }
        // host data: the trainer's batches are made on the host (a batch kept on a GPU costs one read here).
        let rows = t.to_dtype(DType::I64)?.to_vec2::<i64>()?;
        for (r, row) in rows.iter().enumerate() {
            for (i, &id) in row.iter().enumerate() {
                if (id < 0 || id as u64 >= vocab as u64) && Some(id) != ignore {
                    let allowed = if ignore.is_some() { " or -100 (ignored)" } else { "" };
                    return Err(CompileError::Input(format!(
                        "{what}: id {id} at sequence {r}, position {i} is outside the model's vocabulary of {vocab} \
                         ids (0..{vocab}){allowed}; fix the data or use the tokenizer that matches the model"
                    )));
                }
            }
        }
        Ok(())
    };
    check("token ids", ids, None)?;
    if let Some(l) = labels {
        if l.dims() != [b, n] {
            return Err(CompileError::Input(format!("labels have shape {:?} but ids have [{b}, {n}]", l.dims())));
        }
        check("labels", l, Some(IGNORE_INDEX))?;
    }
    Ok(())
}

/// `ids: [b, n]` as u32, padded with token 0 to `[b, n_pad]` (causal attention keeps real tokens from seeing
/// the pad, and its targets are ignored).
fn pad_ids(ids: &Tensor, n_pad: usize) -> Result<Tensor, CompileError> {
    let (b, n) = ids.dims2()?;
    let ids = ids.to_dtype(DType::U32)?;
    if n_pad == n {
        return Ok(ids);
    }
    let pad = Tensor::zeros((b, n_pad - n), DType::U32, ids.device())?;
    Ok(Tensor::cat(&[ids, pad], 1)?)
}

/// `[x]` as an f64 tensor on the host, for the reductions of per-rank numbers (the communicators take host
/// tensors; no f64 ever reaches a device).
fn host_scalar(x: f64) -> candle_core::Result<Tensor> {
    Tensor::new(&[x], &candle_core::Device::Cpu)
}

/// One rank's part of a batch (see `Compiled::local_batch`).
struct LocalBatch {
    /// `[b / D, n_pad / P]` u32: this replica's rows, this rank's shard of them.
    ids_local: Tensor,
    /// The sequence positions of `ids_local`'s columns.
    positions: Vec<usize>,
    /// `[b / D, n_pad / P]`, shifted, -100 where ignored.
    targets_local: Tensor,
    /// The local rows grouped by their documents (one group without documents for an unpacked batch).
    groups: Vec<RowGroup>,
    /// The batch row of local row 0 (this replica's first row).
    first_row: usize,
    /// What a length-dependent RoPE scaling reads ([`Tape::set_sequence_length`]).
    sequence_length: usize,
    /// Valid targets over the ranks in `over` (> 0).
    total: f64,
    /// The ranks whose losses make the batch's: the world when the replicas split the rows, else the
    /// sequence-parallel group.
    over: Arc<dyn ProcessGroup>,
}

impl<M: CausalLm> Compiled<M> {
    /// One training step on `ids: [b, n]` (u32; every rank passes the whole batch; D data-parallel replicas
    /// each train their `b / D` rows), with optional `labels` (`[b, n]`, -100 ignored; default: the ids).
    /// Returns the global loss and the gradients reduced over the world; apply them with any optimiser (every
    /// rank applies the same update, or its slice of it when model states are sharded). Targets are weighed
    /// over the whole world, so a rank or replica whose part holds no valid target contributes zero; a batch
    /// with no valid target anywhere is [`CompileError::NoTargets`] on every rank (skip it).
    pub fn train_step(&self, ids: &Tensor, labels: Option<&Tensor>) -> Result<StepOutput, CompileError> {
        self.run_step(ids, labels, None, self.tape_policy(), false, 1.0)
    }

    /// [`train_step`](Self::train_step) with the loss multiplied by `loss_scale` before backward (f16's
    /// dynamic loss scaling, [`autosp_core::optim::LossScaler`]): the gradients are computed scaled, so that
    /// f16's small per-token terms stay above its subnormals, and divided by `loss_scale` again in f32 after
    /// the reduction. `loss_scale` must be a power of two (the division is then exact); the loss returned is
    /// the unscaled one. Non-finite gradients (an f16 overflow at this scale) come back as they are: the
    /// caller checks the gradient norm and skips the step.
    pub fn train_step_scaled(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        loss_scale: f64,
    ) -> Result<StepOutput, CompileError> {
        self.check_loss_scale(loss_scale)?;
        self.run_step(ids, labels, None, self.tape_policy(), false, loss_scale)
    }

    /// Refuses a loss scale that is not a positive power of two.
    pub(crate) fn check_loss_scale(&self, loss_scale: f64) -> Result<(), CompileError> {
        if !(loss_scale > 0.0 && loss_scale.is_finite() && loss_scale.log2().fract() == 0.0) {
            return Err(CompileError::Input(format!(
                "loss_scale {loss_scale} must be a positive power of two (so that unscaling is exact)"
            )));
        }
        Ok(())
    }

    /// A training step under the tape `policy` (blocks with their own policy keep it), tracing the tape's
    /// memory when `trace`, with the loss scaled by `loss_scale` for backward (a power of two); `documents`:
    /// one per row of a packed batch ([`train_step_packed`](Self::train_step_packed)). One micro-batch of
    /// an [`Accumulation`] of one.
    pub(crate) fn run_step(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: Option<&[Documents]>,
        policy: CheckpointPolicy,
        trace: bool,
        loss_scale: f64,
    ) -> Result<StepOutput, CompileError> {
        let mut acc = Accumulation::new(1);
        let micro = self.run_micro(&mut acc, ids, labels, documents, policy, trace, loss_scale, true)?;
        let grads = self.finish_accumulation(acc)?;
        let MicroStep { loss, valid_tokens, after_forward, peak_bytes, memory_trace } = micro;
        Ok(StepOutput { loss, valid_tokens, grads, after_forward, peak_bytes, memory_trace })
    }

    /// One micro-batch of a step that accumulates gradients over several (`acc`, made by
    /// [`Accumulation::new`] for the step): `ids: [b, n]` with optional `labels` and `documents` as
    /// [`train_step`](Self::train_step) and [`train_step_packed`](Self::train_step_packed) take them, the loss
    /// scaled by `loss_scale` for backward (a power of two, the same for every micro-batch of the step).
    /// Its gradients are added to `acc` unreduced (each weighted by the micro-batch's valid tokens when the
    /// step has several), so a step makes one gradient reduction, not one per micro-batch: on the `last`
    /// micro-batch, as its backward produces them (overlapped where the back end allows,
    /// [`GradReduction::overlap`](super::GradReduction::overlap)), or in
    /// [`finish_accumulation`](Self::finish_accumulation) when the last micro-batch had no target.
    ///
    /// At `--shard gradients` and `parameters` the tape reduce-scatters each use's gradient as backward
    /// makes it, so every micro-batch still reduces: deferring would hold every whole gradient across the
    /// micro-batches, which those levels exist to avoid; the slices are accumulated instead. At `optimizer`
    /// the whole f32 gradients are held across the micro-batches (once, not once per micro-batch).
    ///
    /// Returns the micro-batch's global loss and valid-token count; [`CompileError::NoTargets`] on every rank
    /// for a micro-batch without a valid target (skip it; `acc` is unchanged).
    #[allow(clippy::too_many_arguments)]
    pub fn accumulate_step(
        &self,
        acc: &mut Accumulation,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: Option<&[Documents]>,
        loss_scale: f64,
        last: bool,
    ) -> Result<MicroStep, CompileError> {
        self.check_loss_scale(loss_scale)?;
        self.run_micro(acc, ids, labels, documents, self.tape_policy(), false, loss_scale, last)
    }

    /// The step's gradients from its micro-batches (`acc`): reduced over the world as
    /// [`StepOutput::grads`] has them (whole, or this rank's slices when model states are sharded), the
    /// token-weighted mean when the step had several micro-batches, divided by the loss scale. Collective
    /// unless the last micro-batch reduced them already. [`CompileError::NoTargets`] when no micro-batch had a
    /// target.
    pub fn finish_accumulation(&self, mut acc: Accumulation) -> Result<Gradients, CompileError> {
        if acc.tokens == 0 {
            return Err(CompileError::NoTargets);
        }
        let mut grads = match acc.reduced.take() {
            Some(g) => g,
            None => {
                autosp_core::alloc::phase("step", "gradient all-reduce");
                let _span = autosp_core::profile::span("step", "gradient reduction", String::new);
                self.reduce_sums(std::mem::take(&mut acc.sums))?
            }
        };
        let loss_scale = acc.loss_scale.unwrap_or(1.0);
        if loss_scale != 1.0 {
            grads.scale(1.0 / loss_scale)?;
        }
        if acc.weighted {
            grads.scale(1.0 / acc.tokens as f64)?;
        }
        Ok(grads)
    }

    /// [`accumulate_step`](Self::accumulate_step) under the tape `policy`, tracing the tape's memory when
    /// `trace`.
    #[allow(clippy::too_many_arguments)]
    fn run_micro(
        &self,
        acc: &mut Accumulation,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: Option<&[Documents]>,
        policy: CheckpointPolicy,
        trace: bool,
        loss_scale: f64,
        last: bool,
    ) -> Result<MicroStep, CompileError> {
        if acc.reduced.is_some() {
            return Err(CompileError::Input(
                "this Accumulation was reduced by its last micro-batch already: call finish_accumulation, and \
                 start a new Accumulation for the next step"
                    .into(),
            ));
        }
        if acc.loss_scale.is_some_and(|s| s != loss_scale) {
            return Err(CompileError::Input(format!(
                "loss_scale {loss_scale} differs from the {} of this step's earlier micro-batches: keep one \
                 scale per step (change it between steps)",
                acc.loss_scale.unwrap_or(1.0)
            )));
        }
        let batch = self.local_batch(ids, labels, documents, true)?;
        let total = batch.total;
        let tape = Tape::new(policy);
        // `local_batch` checked every id and label on the host.
        tape.set_inputs_checked();
        if trace {
            tape.trace_memory();
        }
        // At `parameters`: the next block's weights gathered while this one computes, through backward.
        let prefetch = match &self.prefetch {
            Some((group, blocks)) => Some(GatherPrefetch::start(blocks, group.clone())?),
            None => None,
        };
        let sum = self.local_loss(&tape, &batch)?;
        let term = ops::scale(&tape, &sum, loss_scale / total)?;
        let after_forward = tape.memory();
        // The token weight of this micro-batch's gradients in the step's mean.
        let weight = if acc.weighted { total } else { 1.0 };
        let params = trainable_params(&self.model);
        let level = self.sharding();
        let reduce_now = last && self.world.size() > 1 && level <= ShardLevel::Optimizer;
        match (&self.reduce_group, reduce_now) {
            (Some(group), true) => {
                let buckets = Buckets::new(&params, level, self.reduction);
                let _span = autosp_core::profile::span("step", "backward with gradient reduction", String::new);
                let reduced = grad_reduce::overlapped(&buckets, group.as_ref(), |posting| {
                    tape.backward_with_ready(&term, &mut |id, g| posting.ready(id, acc.fold(id, g, weight)?))?;
                    Ok(())
                })?;
                acc.reduced = Some(reduced);
            }
            _ => {
                // At `gradients` and `parameters` each use's gradient is reduce-scattered during backward: on the
                // communication thread while backward goes on, or inline; in the reduction's wire dtype.
                let scatter = match (level >= ShardLevel::Gradients && self.world.size() > 1, &self.reduce_group) {
                    (false, _) => None,
                    (true, group) => Some(GradScatter::start(
                        group.clone().unwrap_or_else(|| self.world.clone()),
                        self.reduction.dtype,
                        group.is_some(),
                        self.reduction.bucket_bytes,
                    )?),
                };
                let ran = tape.backward(&term);
                // The thread's error first: a closed inbox stopped backward because of it.
                let mut posted: Vec<(ParamId, Tensor)> =
                    scatter.map(GradScatter::finish).transpose()?.unwrap_or_default().into_iter().collect();
                ran?;
                posted.sort_by_key(|(id, _)| *id);
                let grads = tape.param_grads();
                for (id, g) in grads.sorted().into_iter().map(|(id, g)| (id, g.clone())).chain(posted) {
                    let g = acc.fold(id, g, weight)?;
                    acc.sums.insert(id, g);
                }
                if reduce_now {
                    autosp_core::alloc::phase("step", "gradient all-reduce");
                    let _span = autosp_core::profile::span("step", "gradient reduction", String::new);
                    let sums = std::mem::take(&mut acc.sums);
                    acc.reduced =
                        Some(Buckets::new(&params, level, self.reduction).reduce_after(self.world.as_ref(), sums)?);
                }
            }
        }
        drop(prefetch);
        let peak_bytes = tape.memory().peak_bytes;
        let memory_trace = tape.memory_trace();

        // One host read of this rank's share of the loss; the sum over ranks is taken on the host (f64).
        let loss_local = host_read::read_f64(term.tensor())? / loss_scale;
        drop(tape);
        let loss = self.world.all_reduce(&host_scalar(loss_local)?, ReduceOp::Sum)?;
        let loss = loss.to_vec1::<f64>()?[0]; // host data
        acc.tokens += total as usize;
        acc.loss_scale = Some(loss_scale);
        Ok(MicroStep { loss, valid_tokens: total as usize, after_forward, peak_bytes, memory_trace })
    }

    /// The accumulated gradients (`sums`, by parameter, in their reduction dtype) reduced over the world as the
    /// sharding level wants them:
    /// - `None`: whole, all-reduced, bucket by bucket ([`Buckets`]: reduction dtype, bucket size and wire
    ///   dtype from [`GradReduction`](super::GradReduction)).
    /// - `Optimizer`: the same buckets reduce-scattered, so each rank gets its slice `[chunk]` of every
    ///   parameter's sum (laid out `[W, Σ chunk]`).
    /// - `Gradients`, `Parameters`: the tape reduce-scattered each use's gradient already; the slices pass on
    ///   (zeros for a parameter no op used, so every rank updates every slice).
    ///
    /// On one rank the gradients only take the shape the optimiser updates.
    fn reduce_sums(&self, mut sums: HashMap<ParamId, Tensor>) -> Result<Gradients, CompileError> {
        let params = trainable_params(&self.model);
        let level = self.sharding();
        if self.world.size() > 1 && level <= ShardLevel::Optimizer {
            return Buckets::new(&params, level, self.reduction).reduce_after(self.world.as_ref(), sums);
        }
        let mut out = Gradients::new();
        for p in &params {
            let t = p.update_view()?;
            let dtype = Precision::float(t.dtype()).reduce();
            let g = match sums.remove(&p.id()) {
                // The shape of what the optimizer updates (flat for a parameter sharded over one rank).
                Some(g) => g.to_dtype(dtype)?.reshape(t.shape())?,
                None if level >= ShardLevel::Gradients => Tensor::zeros(t.shape(), dtype, t.device())?,
                None => continue,
            };
            out.insert(p, g);
        }
        Ok(out)
    }

    /// Forward only: the global mean token loss of `ids: [b, n]` (u32; every rank passes the whole batch)
    /// against `labels` (`[b, n]`, -100 ignored; default: the ids), with the same shifting, sharding and
    /// reduction as [`train_step`](Self::train_step) (the same loss up to the order of floating-point sums:
    /// a recording tape may run the MLP chunked) but nothing recorded, no backward and no gradients:
    /// held-out evaluation at long context costs one forward pass. The D replicas split the rows when D
    /// divides `b`; otherwise (one held-out sequence on two replicas) each replica scores the whole batch.
    /// Returns `(mean loss, valid target tokens)`, the same on every rank; [`CompileError::NoTargets`] on every
    /// rank when no target is valid.
    pub fn eval_loss(&self, ids: &Tensor, labels: Option<&Tensor>) -> Result<(f64, usize), CompileError> {
        self.eval_loss_with(ids, labels, None)
    }

    /// [`eval_loss`](Self::eval_loss), with one [`Documents`] per row when `documents` is given.
    pub(crate) fn eval_loss_with(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: Option<&[Documents]>,
    ) -> Result<(f64, usize), CompileError> {
        let split = ids.dims2()?.0.is_multiple_of(self.mesh.data);
        let batch = self.local_batch(ids, labels, documents, split)?;
        let tape = Tape::inference();
        tape.set_inputs_checked();
        let sum = self.local_loss(&tape, &batch)?;
        let local = host_read::read_f64(ops::scale(&tape, &sum, 1.0 / batch.total)?.tensor())?;
        let loss = batch.over.all_reduce(&host_scalar(local)?, ReduceOp::Sum)?.to_vec1::<f64>()?[0]; // host data
        Ok((loss, batch.total as usize))
    }

    /// The summed token loss `[]` of this rank's part of a batch, one forward per group of rows with equal
    /// documents (the documents on the tape while it runs), summed on the tape. Declares the sequence length
    /// RoPE's length-dependent scalings read: the whole sequence's real length (not the padded one, not the
    /// shard's), or the longest document's positions, as transformers' `max(position_ids) + 1`.
    fn local_loss(&self, tape: &Tape, batch: &LocalBatch) -> Result<autosp_core::Value, CompileError> {
        tape.set_sequence_length(batch.sequence_length);
        let positions: Vec<u64> = batch.positions.iter().map(|&p| p as u64).collect();
        let sums = per_group(tape, &batch.groups, &batch.ids_local, |g, ids| {
            // Where the group's tokens sit in the batch, for per-token draws (LoRA's dropout masks).
            let sequences = g.rows.iter().map(|&r| (batch.first_row + r) as u64).collect();
            let coordinates = TokenCoordinates { sequences, positions: positions.clone() };
            tape.set_token_coordinates(Some(Arc::new(coordinates)));
            let targets = if batch.groups.len() == 1 {
                batch.targets_local.clone()
            } else {
                let device = batch.targets_local.device();
                let index = Tensor::from_vec(g.rows.iter().map(|&r| r as u32).collect(), g.rows.len(), device)?;
                batch.targets_local.index_select(&index, 0)?
            };
            Ok(self.model.loss(tape, &ids, &batch.positions, &targets.flatten_all()?)?.0)
        })?;
        tape.set_token_coordinates(None);
        let mut sums = sums.into_iter();
        let mut sum = sums.next().expect("at least one group");
        for s in sums {
            sum = ops::add(tape, &sum, &s)?;
        }
        Ok(sum)
    }

    /// This rank's part of a checked batch: `ids: [b, n]` and optional `labels: [b, n]` -> its replica's rows
    /// (`b / D` of them; all `b` unless `split`) as the local ids `[b / D, n_pad / P]`, their positions, the
    /// local shifted targets `[b / D * n_pad / P]` and the number of valid targets over the ranks that share
    /// the batch (collective). A rank's shard, or a replica's rows, without a valid target adds nothing to the
    /// sums and weighs nothing; [`CompileError::NoTargets`] on every rank when no rank has one, and an error
    /// when `split` and D does not divide `b`.
    ///
    /// `documents` (one per row of the whole batch): checked against the windows, the targets that cross a
    /// document boundary ignored, and the local rows grouped by their documents.
    fn local_batch(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: Option<&[Documents]>,
        split: bool,
    ) -> Result<LocalBatch, CompileError> {
        check_batch(ids, labels, self.model.dims().vocab, 2)?;
        let (b, n) = ids.dims2()?;
        self.check_documents(documents, b, n)?;
        let over = if split { self.world.clone() } else { self.sp.clone() };
        let rows = if split { self.mesh.rows(b, self.mesh.replica(self.world.rank()))? } else { 0..b };
        let groups = row_groups(documents, rows.clone());
        let sequence_length = row_groups::sequence_length(documents, n);
        let replica_documents = documents.map(|d| &d[rows.clone()]);
        let (ids, labels) = if rows.len() < b {
            (ids.narrow(0, rows.start, rows.len())?, labels.map(|l| l.narrow(0, rows.start, rows.len())).transpose()?)
        } else {
            (ids.clone(), labels.cloned())
        };
        let (ids, labels) = (&ids, labels.as_ref());
        let n_pad = self.padded_len(n);
        // Shifted, padded and cut on the host (where the checked batch is), then moved: counting the valid
        // targets reads no device tensor.
        let host = candle_core::Device::Cpu;
        let (ids, labels) = (ids.to_device(&host)?, labels.map(|l| l.to_device(&host)).transpose()?);
        let (ids, targets) = shift_and_pad(&ids, labels.as_ref(), n_pad)?;
        let targets = match replica_documents {
            Some(d) => row_groups::ignore_boundary_targets(&targets, d)?,
            None => targets,
        };
        let positions = self.positions(n_pad, self.sp.rank())?;
        let index = Tensor::from_vec(positions.iter().map(|&p| p as u32).collect(), positions.len(), &host)?;
        let targets_local = targets.index_select(&index, 1)?;
        let local_count = targets_local.flatten_all()?.to_vec1::<i64>()?.iter().filter(|&&t| t >= 0).count(); // host data
        let device = self.device();
        let ids_local = ids.index_select(&index, 1)?.to_device(&device)?;
        let targets_local = targets_local.to_device(&device)?;

        // host data: counted on the host, reduced as a host tensor.
        let total = over.all_reduce(&host_scalar(local_count as f64)?, ReduceOp::Sum)?.to_vec1::<f64>()?[0];
        if total == 0.0 {
            return Err(CompileError::NoTargets);
        }
        let first_row = rows.start;
        Ok(LocalBatch { ids_local, positions, targets_local, groups, first_row, sequence_length, total, over })
    }

    /// Checks `documents` (one per row of a batch of `b` rows of `n` tokens) when given.
    pub(crate) fn check_documents(
        &self,
        documents: Option<&[Documents]>,
        b: usize,
        n: usize,
    ) -> Result<(), CompileError> {
        match documents {
            Some(d) => row_groups::check_documents(d, b, n, self.model.supports_documents(), self.model.kind()),
            None => Ok(()),
        }
    }

    /// The L2 norm of the gradients a step returned, over the whole model (summed in f64 in parameter
    /// order): of the whole gradients, or, when they are this rank's slices, of every rank's slices together
    /// (an all-reduce over the world; collective). Every rank gets the same norm.
    pub fn grad_norm(&self, grads: &Gradients) -> Result<f64, CompileError> {
        let mut sq = sum_of_squares(grads)?;
        if self.sharding() != ShardLevel::None && self.world.size() > 1 {
            // host data: a sum made on the host.
            sq = self.world.all_reduce(&host_scalar(sq)?, ReduceOp::Sum)?.to_vec1::<f64>()?[0];
        }
        Ok(sq.sqrt())
    }

    /// The whole gradients from the slices a sharded step returned (collective: every rank gathers every
    /// parameter's, in model order); whole gradients pass through. For inspecting or dumping gradients.
    pub fn whole_grads(&self, grads: &Gradients) -> Result<Gradients, CompileError> {
        let mut out = Gradients::new();
        for p in trainable_params(&self.model) {
            let Some(g) = grads.get(&p) else { continue };
            let whole = match p.shard() {
                Some(s) if g.dims() != s.shape.dims() => s.gather(g)?,
                _ => g.clone(),
            };
            out.insert(&p, whole);
        }
        Ok(out)
    }

    /// Forward only (a long prompt's prefill split over the ranks): logits `[b, n, vocab]` for `ids: [b, n]`,
    /// gathered back into sequence order on every rank. Every replica computes the whole batch over its
    /// sequence-parallel group.
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor, CompileError> {
        self.logits_with(ids, None)
    }

    /// [`logits`](Self::logits), with one [`Documents`] per row when `documents` is given.
    pub(crate) fn logits_with(&self, ids: &Tensor, documents: Option<&[Documents]>) -> Result<Tensor, CompileError> {
        check_batch(ids, None, self.model.dims().vocab, 1)?;
        let (b, n) = ids.dims2()?;
        self.check_documents(documents, b, n)?;
        let n_pad = self.padded_len(n);
        let ids = pad_ids(&ids.to_device(&self.device())?, n_pad)?;
        let positions = self.positions(n_pad, self.sp.rank())?;
        let index = Tensor::from_vec(positions.iter().map(|&p| p as u32).collect(), positions.len(), ids.device())?;
        let tape = Tape::inference();
        tape.set_sequence_length(row_groups::sequence_length(documents, n));
        let groups = row_groups(documents, 0..b);
        let parts = per_group(&tape, &groups, &ids.index_select(&index, 1)?, |_, ids| {
            Ok(self.model.logits(&tape, &ids, &positions)?.into_tensor())
        })?;
        let local = row_groups::in_row_order(parts, &groups)?;
        let whole = gather_unshard(self.sp.as_ref(), &local.contiguous()?, 1, self.layout())?;
        Ok(whole.narrow(1, 0, n)?)
    }

    /// Forward only, gathering only the scored rows: logits `[b, rows.len(), vocab]` at sequence positions
    /// `rows` (each `< n`, any order, repeats allowed) for `ids: [b, n]`, the same on every rank. Each rank
    /// computes the logits of its own shard, keeps the requested rows it holds, and one `all_gather` moves
    /// only those: `(P-1) * rows_here * b * vocab` elements sent per rank, whatever `n` (where [`logits`]
    /// sends `(P-1) * b * n/P * vocab`, gigabytes for a large vocabulary at long context). Use it for
    /// evaluation that scores a few positions (passkey accuracy).
    ///
    /// [`logits`]: Self::logits
    pub fn logits_at(&self, ids: &Tensor, rows: &[usize]) -> Result<Tensor, CompileError> {
        self.logits_at_with(ids, rows, None)
    }

    /// [`logits_at`](Self::logits_at), with one [`Documents`] per row when `documents` is given.
    pub(crate) fn logits_at_with(
        &self,
        ids: &Tensor,
        rows: &[usize],
        documents: Option<&[Documents]>,
    ) -> Result<Tensor, CompileError> {
        check_batch(ids, None, self.model.dims().vocab, 1)?;
        let (b, n) = ids.dims2()?;
        self.check_documents(documents, b, n)?;
        if let Some(&bad) = rows.iter().find(|&&t| t >= n) {
            return Err(CompileError::Input(format!(
                "logits_at: row {bad} is outside the sequence of {n} tokens (rows must be below {n})"
            )));
        }
        let n_pad = self.padded_len(n);
        let (size, rank) = (self.sp.size(), self.sp.rank());
        let ids = pad_ids(&ids.to_device(&self.device())?, n_pad)?;
        // Where each position lives: (rank, index in that rank's shard).
        let mut home = vec![(0, 0); n_pad];
        let mut shards = Vec::with_capacity(size);
        for r in 0..size {
            let positions = self.positions(n_pad, r)?;
            for (i, &t) in positions.iter().enumerate() {
                home[t] = (r, i);
            }
            shards.push(positions);
        }
        let positions = &shards[rank];
        let index = Tensor::from_vec(positions.iter().map(|&p| p as u32).collect(), positions.len(), ids.device())?;
        let tape = Tape::inference();
        tape.set_sequence_length(row_groups::sequence_length(documents, n));
        let groups = row_groups(documents, 0..b);
        // The requested rows each rank holds, in request order; rank r's come r-th in the gather. Only their
        // logits are made (collective: every rank takes the head, with its own rows).
        let home = &home;
        let held = |r: usize| rows.iter().filter(move |&&t| home[t].0 == r).map(move |&t| home[t].1 as usize);
        let mine: Vec<usize> = held(rank).collect();
        let parts = per_group(&tape, &groups, &ids.index_select(&index, 1)?, |_, ids| {
            Ok(self.model.logits_at(&tape, &ids, positions, &mine)?.into_tensor())
        })?;
        let picked = row_groups::in_row_order(parts, &groups)?;
        let gathered = self.sp.all_gather(&picked.contiguous()?, 1)?;
        // Back to request order: the k-th request held by rank r sits at offset(r) + k.
        let mut offset = vec![0usize; size + 1];
        for r in 0..size {
            offset[r + 1] = offset[r] + held(r).count();
        }
        let mut seen = vec![0usize; size];
        let order: Vec<u32> = rows
            .iter()
            .map(|&t| {
                let r = home[t].0;
                seen[r] += 1;
                (offset[r] + seen[r] - 1) as u32
            })
            .collect();
        let order = Tensor::from_vec(order, rows.len(), gathered.device())?;
        Ok(gathered.index_select(&order, 1)?)
    }
}
