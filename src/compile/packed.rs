//! Packed documents in a compiled model: the `*_packed` entry points (training step, evaluation loss, logits,
//! logits at rows, token losses) that take one [`Documents`] per batch row (cumulative lengths, as varlen APIs
//! take them). What the step does with them (checks, boundary targets, rows grouped by their documents, the
//! documents on the tape so that the model restarts positions and masks attention at each one) is
//! `row_groups.rs`.

use autosp_core::ops::Documents;
use autosp_core::CausalLm;
use autosp_models::LlamaModel;
use candle_core::Tensor;

use super::step::StepOutput;
use super::{CompileError, Compiled};

impl<M: CausalLm> Compiled<M> {
    /// [`train_step`](Self::train_step) on packed windows: `documents` holds one [`Documents`] per row of
    /// `ids: [b, n]` (its `cu_seqlens` end at `n`). Each token attends only to its own document, positions
    /// restart at each document (the first from its `first_position`), and the target of the last token of
    /// each document but the row's last is ignored. Rows with different documents are run one group of equal
    /// documents at a time on the same tape (the same loss and gradients as one batched forward).
    /// Errors: [`CompileError::DocumentsRows`], [`CompileError::Documents`] (boundaries that do not fit the
    /// window), [`CompileError::DocumentsUnsupported`] (a model without document support).
    pub fn train_step_packed(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: &[Documents],
    ) -> Result<StepOutput, CompileError> {
        self.run_step(ids, labels, Some(documents), self.tape_policy(), false, 1.0)
    }

    /// [`train_step_scaled`](Self::train_step_scaled) on packed windows (see
    /// [`train_step_packed`](Self::train_step_packed)).
    pub fn train_step_scaled_packed(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: &[Documents],
        loss_scale: f64,
    ) -> Result<StepOutput, CompileError> {
        self.check_loss_scale(loss_scale)?;
        self.run_step(ids, labels, Some(documents), self.tape_policy(), false, loss_scale)
    }

    /// [`eval_loss`](Self::eval_loss) on packed windows (see [`train_step_packed`](Self::train_step_packed)).
    pub fn eval_loss_packed(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: &[Documents],
    ) -> Result<(f64, usize), CompileError> {
        self.eval_loss_with(ids, labels, Some(documents))
    }

    /// [`logits`](Self::logits) of packed windows: `[b, n, vocab]`, each row's documents in `documents`.
    pub fn logits_packed(&self, ids: &Tensor, documents: &[Documents]) -> Result<Tensor, CompileError> {
        self.logits_with(ids, Some(documents))
    }

    /// [`logits_at`](Self::logits_at) of packed windows: `[b, rows.len(), vocab]`.
    pub fn logits_at_packed(
        &self,
        ids: &Tensor,
        rows: &[usize],
        documents: &[Documents],
    ) -> Result<Tensor, CompileError> {
        self.logits_at_with(ids, rows, Some(documents))
    }
}

impl Compiled<LlamaModel> {
    /// [`token_losses`](Self::token_losses) of packed windows: `[b, n]`, 0 at each document's last token but
    /// the row's last (its next token starts another document) as at every position without a target.
    pub fn token_losses_packed(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: &[Documents],
    ) -> Result<Tensor, CompileError> {
        self.token_losses_with(ids, labels, Some(documents))
    }
}
