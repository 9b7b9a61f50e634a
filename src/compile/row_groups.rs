//! How a packed batch's documents shape a compiled step (the rules the `*_packed` entry points
//! (`packed.rs`) and the step itself follow): each row's documents are checked against its window; the
//! target of each position whose next token starts another document is ignored (no document is trained on the
//! one before it); rows with the same documents form a [`RowGroup`] that runs together, its documents on the
//! tape; a row of one document from position 0 is an unpacked row; a length-dependent RoPE scaling reads the
//! longest document's positions over the whole batch (transformers' `max(position_ids) + 1`).

use std::sync::Arc;

use autosp_core::ops::{Documents, IGNORE_INDEX};
use autosp_core::Tape;
use candle_core::Tensor;

use super::CompileError;

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
