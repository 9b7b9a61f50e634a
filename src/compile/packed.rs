//! Packed documents in a compiled model: the `*_packed` entry points (training step, evaluation loss, logits,
//! logits at rows, token losses) that take one [`Documents`] per batch row (cumulative lengths, as varlen APIs
//! take them), and what the step does with them. A row's documents are checked against its window; the target
//! of each position whose next token starts another document is ignored (no document is trained on the one
//! before it); rows with the same documents run together, each group with its documents on the tape
//! ([`Tape::set_documents`]), so that the model restarts positions at each document and masks attention to
//! it; a row of one document from position 0 runs as an unpacked row. A length-dependent RoPE scaling reads
//! the longest document's positions over the whole batch (transformers' `max(position_ids) + 1`).

use std::sync::Arc;

use autosp_core::ops::{Documents, IGNORE_INDEX};
use autosp_core::{CausalLm, Tape};
use autosp_models::LlamaModel;
use candle_core::Tensor;

use super::step::StepOutput;
use super::{CompileError, Compiled};

/// Batch rows that run together: the same documents (`None`: unpacked), local row indices in order.
#[derive(Clone, Debug)]
pub(crate) struct RowGroup {
    pub documents: Option<Arc<Documents>>,
    pub rows: Vec<usize>,
}

/// Checks one [`Documents`] per row of a batch of `b` rows of `n` tokens, for a model of kind `kind` that
/// may or may not honour them.
pub(crate) fn check_documents(
    documents: &[Documents],
    b: usize,
    n: usize,
    supported: bool,
    kind: &'static str,
) -> Result<(), CompileError> {
    if documents.len() != b {
        return Err(CompileError::DocumentsRows { rows: b, given: documents.len() });
    }
    for (row, d) in documents.iter().enumerate() {
        d.check_window(n).map_err(|source| CompileError::Documents { row, source })?;
    }
    if !supported && documents.iter().any(|d| !d.is_whole()) {
        return Err(CompileError::DocumentsUnsupported { kind });
    }
    Ok(())
}

/// The rows `rows` of a batch (indices `0..rows.len()` of the local rows) grouped by their documents, in order
/// of first appearance: one group of every row, unpacked, without documents (or when every row is one document
/// from position 0).
pub(crate) fn row_groups(documents: Option<&[Documents]>, rows: std::ops::Range<usize>) -> Vec<RowGroup> {
    let local: Vec<usize> = (0..rows.len()).collect();
    let Some(documents) = documents else { return vec![RowGroup { documents: None, rows: local }] };
    let mut groups: Vec<RowGroup> = Vec::new();
    for (i, r) in rows.enumerate() {
        let d = &documents[r];
        let d = (!d.is_whole()).then(|| d.clone());
        match groups.iter_mut().find(|g| g.documents.as_deref() == d.as_ref()) {
            Some(g) => g.rows.push(i),
            None => groups.push(RowGroup { documents: d.map(Arc::new), rows: vec![i] }),
        }
    }
    groups
}

/// The length a length-dependent RoPE scaling reads: the longest document's positions over the batch
/// ([`Documents::position_extent`]), or `n` for unpacked rows.
pub(crate) fn sequence_length(documents: Option<&[Documents]>, n: usize) -> usize {
    match documents {
        Some(d) => d.iter().map(Documents::position_extent).max().unwrap_or(n),
        None => n,
    }
}

/// `targets: [b, n_pad]` i64 (shifted: entry `t` is the label of token `t + 1`) with the target of each
/// position whose next token starts another document of its row set to -100.
pub(crate) fn ignore_boundary_targets(targets: &Tensor, documents: &[Documents]) -> Result<Tensor, CompileError> {
    let (b, n_pad) = targets.dims2()?;
    let mut t = targets.flatten_all()?.to_vec1::<i64>()?; // host data: the step's targets are made on the host
    for (r, d) in documents.iter().enumerate().take(b) {
        for p in d.boundary_targets() {
            t[r * n_pad + p] = IGNORE_INDEX;
        }
    }
    Ok(Tensor::from_vec(t, (b, n_pad), targets.device())?)
}

/// Runs `f` once per group with the group's documents on `tape`, on `x`'s rows of the group (dim 0):
/// `x` itself when one group holds every row. The tape's documents are cleared afterwards.
pub(crate) fn per_group<T>(
    tape: &Tape,
    groups: &[RowGroup],
    x: &Tensor,
    mut f: impl FnMut(&RowGroup, Tensor) -> Result<T, CompileError>,
) -> Result<Vec<T>, CompileError> {
    let mut out = Vec::with_capacity(groups.len());
    for g in groups {
        let rows = if groups.len() == 1 {
            x.clone()
        } else {
            let index = Tensor::from_vec(g.rows.iter().map(|&r| r as u32).collect(), g.rows.len(), x.device())?;
            x.index_select(&index, 0)?
        };
        tape.set_documents(g.documents.clone());
        let r = f(g, rows);
        tape.set_documents(None);
        out.push(r?);
    }
    Ok(out)
}

/// The groups' results `parts` (each `[rows of the group, ..]`, in group order) as one tensor in row order.
pub(crate) fn in_row_order(parts: Vec<Tensor>, groups: &[RowGroup]) -> Result<Tensor, CompileError> {
    if parts.len() == 1 {
        return Ok(parts.into_iter().next().expect("one part"));
    }
    let order: Vec<usize> = groups.iter().flat_map(|g| g.rows.iter().copied()).collect();
    let mut inverse = vec![0u32; order.len()];
    for (i, &r) in order.iter().enumerate() {
        inverse[r] = i as u32;
    }
    let all = Tensor::cat(&parts, 0)?;
    let index = Tensor::from_vec(inverse, order.len(), all.device())?;
    Ok(all.index_select(&index, 0)?)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_group_by_documents_and_come_back_in_order() {
        let a = Documents::from_lengths(&[2, 2], 0).unwrap();
        let b = Documents::from_lengths(&[1, 3], 0).unwrap();
        let docs = [a.clone(), b.clone(), Documents::whole(4), a.clone()];
        let g = row_groups(Some(&docs), 0..4);
        let got: Vec<_> = g.iter().map(|g| (g.documents.as_deref().cloned(), g.rows.clone())).collect();
        assert_eq!(got, vec![(Some(a.clone()), vec![0, 3]), (Some(b), vec![1]), (None, vec![2])]);
        // Rows 2..4 of the batch (a replica's): local indices.
        let g2 = row_groups(Some(&docs), 2..4);
        assert_eq!(g2.iter().map(|g| g.rows.clone()).collect::<Vec<_>>(), vec![vec![0], vec![1]]);
        let x = Tensor::new(&[[0u32], [1], [2], [3]], &candle_core::Device::Cpu).unwrap();
        let parts: Vec<Tensor> = g
            .iter()
            .map(|g| {
                let i = Tensor::from_vec(g.rows.iter().map(|&r| r as u32).collect(), g.rows.len(), x.device());
                x.index_select(&i.unwrap(), 0).unwrap()
            })
            .collect();
        let back = in_row_order(parts, &g).unwrap().flatten_all().unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(back, vec![0, 1, 2, 3]);
    }

    #[test]
    fn boundary_targets_are_ignored_and_bad_documents_refused() {
        let d = Documents::from_lengths(&[2, 3], 0).unwrap();
        let t = Tensor::new(&[[1i64, 2, 3, 4, -100, -100]], &candle_core::Device::Cpu).unwrap();
        let got = ignore_boundary_targets(&t, std::slice::from_ref(&d)).unwrap().to_vec2::<i64>().unwrap();
        assert_eq!(got, vec![vec![1, -100, 3, 4, -100, -100]]);
        assert_eq!(sequence_length(Some(&[d.clone(), Documents::from_lengths(&[4, 1], 2).unwrap()]), 5), 6);
        let e = check_documents(std::slice::from_ref(&d), 2, 5, true, "m").unwrap_err();
        assert!(matches!(e, CompileError::DocumentsRows { rows: 2, given: 1 }), "{e}");
        let e = check_documents(std::slice::from_ref(&d), 1, 6, true, "m").unwrap_err();
        assert!(e.to_string().contains("documents of batch row 0") && e.to_string().contains("6 tokens"), "{e}");
        let e = check_documents(&[d], 1, 5, false, "MyLm").unwrap_err();
        assert!(matches!(e, CompileError::DocumentsUnsupported { kind: "MyLm" }), "{e}");
        assert!(check_documents(&[Documents::whole(5)], 1, 5, false, "MyLm").is_ok());
    }
}
