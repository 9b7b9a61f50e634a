//! Chunked linear + cross-entropy: the summed token loss of `hidden @ lm_head^T` against targets, computed in
//! row chunks so that no `[m, vocab]` logits tensor ever exists. Forward keeps nothing but its inputs; backward
//! recomputes each chunk's logits, turns them into `softmax - onehot` in place, and accumulates `d_hidden`
//! (chunk by chunk) and `d_lm_head` (a running sum, chunks in order: deterministic). Returns the sum of token
//! losses and the valid-token count, as [`autosp_core::ops::cross_entropy`] does, for the global reduction
//! of sequence parallelism, the loss in f32 (f64 for f64). This is the CPU kernel (it reads the targets and the
//! logits on the host); elsewhere the public functions run [`crate::generic::cross_entropy`].

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use autosp_core::ops::cross_entropy::count_valid;
use autosp_core::ops::IGNORE_INDEX;
use autosp_core::simd::{simd_path, SimdPath};
use autosp_core::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

use crate::dispatch::use_fast_cpu;
use crate::fused::{compute_dtype, mismatch, tensor_from, with_contiguous, Real};
use crate::generic;
use crate::generic::cross_entropy::check_targets;
use crate::running_sum::add_to;

pub(crate) const OP: &str = "chunked_cross_entropy";

/// The chunked loss tape op: inputs `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]` (i64 or u32,
/// negative = ignored, as [`IGNORE_INDEX`]); output the summed loss `[]` in f32 (f64 for f64 inputs). Kind
/// [`NodeKind::Loss`].
#[derive(Debug)]
pub struct ChunkedCrossEntropy {
    /// Rows of `hidden` per chunk: the transient logits are `[chunk_rows, vocab]`.
    pub chunk_rows: usize,
}

/// `(m, d, vocab)` after checking shapes and the chunk size.
pub(crate) fn check(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<(usize, usize, usize)> {
    if chunk_rows == 0 {
        return Err(Error::InvalidArgument { op: OP, msg: "chunk_rows must be at least 1 (try 1024)".into() });
    }
    let &[m, d] = hidden.dims() else {
        return Err(mismatch(
            OP,
            "hidden",
            hidden.dims(),
            "lm_head",
            lm_head.dims(),
            "hidden must be [m, d]; flatten batch and sequence first".into(),
        ));
    };
    let &[vocab, dw] = lm_head.dims() else {
        return Err(mismatch(
            OP,
            "hidden",
            hidden.dims(),
            "lm_head",
            lm_head.dims(),
            "lm_head must be [vocab, d]".into(),
        ));
    };
    if dw != d {
        return Err(mismatch(
            OP,
            "hidden",
            hidden.dims(),
            "lm_head",
            lm_head.dims(),
            format!("lm_head must be [vocab, {d}], d from hidden"),
        ));
    }
    if targets.dims() != [m] {
        return Err(mismatch(
            OP,
            "hidden",
            hidden.dims(),
            "targets",
            targets.dims(),
            format!("targets must be [{m}], one per row of hidden"),
        ));
    }
    if hidden.dtype() != lm_head.dtype() {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "hidden is {:?} but lm_head is {:?}; convert them to one dtype",
                hidden.dtype(),
                lm_head.dtype()
            ),
        });
    }
    Ok((m, d, vocab))
}

/// The targets as i64, checked against the vocabulary.
fn target_ids(targets: &Tensor, vocab: usize) -> Result<Vec<i64>> {
    let t = targets.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    if let Some(&bad) = t.iter().find(|&&t| t >= vocab as i64) {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!("target {bad} is out of range for {vocab} classes (use {IGNORE_INDEX} to ignore a position)"),
        });
    }
    Ok(t)
}

/// Per-row loss `lse - x[target]` (0 for ignored rows) of a chunk's logits `[rows, vocab]`, in f64.
fn chunk_losses<T: Real>(logits: &[T], vocab: usize, targets: &[i64], path: SimdPath) -> Vec<f64> {
    logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            if t < 0 {
                return 0.0;
            }
            let m = T::max_on(path, row);
            let lse = T::exp_sum_on(path, row, m).ln() + m;
            (lse - row[t as usize]).to_f64()
        })
        .collect()
}

/// `g * (softmax(x) - onehot(target))` of each row of a chunk's logits, 0 for ignored rows.
fn chunk_dlogits<T: Real>(logits: &[T], vocab: usize, targets: &[i64], g: T, path: SimdPath) -> Vec<T> {
    let mut dl = vec![T::ZERO; logits.len()];
    dl.par_chunks_mut(vocab).zip(logits.par_chunks(vocab).zip(targets.par_iter())).for_each(|(dr, (row, &t))| {
        if t < 0 {
            return;
        }
        let m = T::max_on(path, row);
        let sum = T::exp_row_on(path, dr, row, m);
        let scale = g / sum;
        for d in dr.iter_mut() {
            *d *= scale;
        }
        dr[t as usize] -= g;
    });
    dl
}

/// The loss sum (f64) and, when `grad` is given, `(d_hidden, d_lm_head)` scaled by it; all in `T`.
fn run<T: Real>(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &[i64],
    chunk_rows: usize,
    grad: Option<f64>,
) -> Result<(f64, Option<(Tensor, Tensor)>)> {
    let (m, _) = hidden.dims2()?;
    let vocab = lm_head.dim(0)?;
    let wt = lm_head.t()?;
    let mut total = 0.0f64;
    let mut dh_chunks = Vec::new();
    let mut dw: Option<Tensor> = None;
    let mut start = 0;
    while start < m {
        let rows = chunk_rows.min(m - start);
        let h = hidden.narrow(0, start, rows)?;
        let logits = h.matmul(&wt)?;
        let tg = &targets[start..start + rows];
        match grad {
            None => {
                let losses =
                    with_contiguous(&logits, OP, "logits", |l: &[T]| Ok(chunk_losses(l, vocab, tg, simd_path())))?;
                total += losses.iter().sum::<f64>();
            }
            Some(g) => {
                let dl = with_contiguous(&logits, OP, "logits", |l: &[T]| {
                    Ok(chunk_dlogits(l, vocab, tg, T::from_f64(g), simd_path()))
                })?;
                drop(logits);
                let dl = tensor_from(dl, (rows, vocab))?;
                dh_chunks.push(dl.matmul(lm_head)?);
                add_to(&mut dw, dl.t()?.matmul(&h)?)?;
            }
        }
        start += rows;
    }
    let grads = match grad {
        None => None,
        Some(_) => {
            let dh = if dh_chunks.is_empty() { hidden.zeros_like()? } else { Tensor::cat(&dh_chunks, 0)? };
            let dw = match dw {
                Some(dw) => dw,
                None => lm_head.zeros_like()?,
            };
            Some((dh, dw))
        }
    };
    Ok((total, grads))
}

fn run_cpu(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    grad: Option<f64>,
) -> Result<(f64, Option<(Tensor, Tensor)>)> {
    let (_, _, vocab) = check(hidden, lm_head, targets, chunk_rows)?;
    let ids = target_ids(targets, vocab)?;
    let cd = compute_dtype(OP, hidden.dtype())?;
    let (h, w) = (hidden.to_dtype(cd)?.contiguous()?, lm_head.to_dtype(cd)?.contiguous()?);
    let (loss, grads) = match cd {
        DType::F64 => run::<f64>(&h, &w, &ids, chunk_rows, grad)?,
        DType::F32 => run::<f32>(&h, &w, &ids, chunk_rows, grad)?,
        other => return Err(Error::Internal(format!("{OP}: compute dtype {other:?}"))),
    };
    let grads = match grads {
        Some((dh, dw)) => Some((dh.to_dtype(hidden.dtype())?, dw.to_dtype(lm_head.dtype())?)),
        None => None,
    };
    Ok((loss, grads))
}

/// The chunked loss without a tape: `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]` (negative =
/// ignored) -> `(sum of token losses: []` in f32, f64 for f64 inputs (a bf16/f16 hidden still gives an f32
/// loss)`, valid-token count)`. Transient memory is one `[chunk_rows, vocab]` logits block.
pub fn chunked_cross_entropy_forward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<(Tensor, usize)> {
    if !use_fast_cpu(hidden) {
        return generic::cross_entropy::chunked_cross_entropy_forward(hidden, lm_head, targets, chunk_rows);
    }
    let (loss, _) = run_cpu(hidden, lm_head, targets, chunk_rows, None)?;
    // The loss stays in the compute dtype (f32, f64 for f64): never rounded to a bf16/f16 hidden dtype.
    let loss = Tensor::new(loss, hidden.device())?.to_dtype(compute_dtype(OP, hidden.dtype())?)?;
    Ok((loss, count_valid(targets)?))
}

/// The chunked loss's backward without a tape: the gradients of `grad * sum of token losses` with respect to
/// `hidden: [m, d]` and `lm_head: [vocab, d]`, as `(d_hidden: [m, d], d_lm_head: [vocab, d])` in the dtypes of
/// hidden and lm_head.
pub fn chunked_cross_entropy_backward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    grad: f64,
) -> Result<(Tensor, Tensor)> {
    if !use_fast_cpu(hidden) {
        return generic::cross_entropy::chunked_cross_entropy_backward(hidden, lm_head, targets, chunk_rows, grad);
    }
    let (_, grads) = run_cpu(hidden, lm_head, targets, chunk_rows, Some(grad))?;
    grads.ok_or_else(|| Error::Internal(format!("{OP}: backward produced no gradients")))
}

impl Op for ChunkedCrossEntropy {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Loss
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![chunked_cross_entropy_forward(i[0], i[1], i[2], self.chunk_rows)?.0])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1, 2])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 3]) };
        let g = g.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let (dh, dw) = chunked_cross_entropy_backward(s.input(0)?, s.input(1)?, s.input(2)?, self.chunk_rows, g)?;
        Ok(vec![Some(dh), Some(dw), None])
    }
}

/// Linear + cross-entropy in row chunks on the tape: `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]`
/// (i64 or u32; [`IGNORE_INDEX`] skipped). Returns `(sum of token losses: []` in f32 (f64 for f64)`, valid
/// count)`, equal to `cross_entropy(linear(hidden, lm_head))` of autosp-core, while no `[m, vocab]` tensor is ever made: the
/// tape holds only the inputs.
pub fn chunked_cross_entropy(
    tape: &Tape,
    hidden: &Value,
    lm_head: &Value,
    targets: &Value,
    chunk_rows: usize,
) -> Result<(Value, usize)> {
    let (_, _, vocab) = check(hidden.tensor(), lm_head.tensor(), targets.tensor(), chunk_rows)?;
    check_targets(targets.tensor(), vocab)?;
    let count = count_valid(targets.tensor())?;
    Ok((tape.apply(ChunkedCrossEntropy { chunk_rows }, &[hidden, lm_head, targets])?.remove(0), count))
}

#[cfg(test)]
mod tests {
    use autosp_core::simd::{supported_paths, SimdPath};

    use super::{chunk_dlogits, chunk_losses};

    /// Every vector path against the scalar path on f32 rows of 1003 logits in [-10, 10] (a tail shorter than
    /// a vector), one row ignored: the vector `e^x` is within ~2 ulp of libm's and the sums run in another
    /// order, so the losses (~5) agree to 1e-6 relative and the gradients to 1e-6 relative to the largest
    /// (max relative error); a wrong term would be off by ~1e-3 or more.
    #[test]
    fn vector_paths_match_scalar() {
        let (rows, vocab) = (4, 1003);
        let logits: Vec<f32> = (0..rows * vocab).map(|i| ((i * 7919) % 2001) as f32 / 100.0 - 10.0).collect();
        let targets = [5, -100, 1002, 640];
        let l0 = chunk_losses(&logits, vocab, &targets, SimdPath::Scalar);
        let d0 = chunk_dlogits(&logits, vocab, &targets, 0.5, SimdPath::Scalar);
        let dscale = d0.iter().fold(0f32, |m, v| m.max(v.abs()));
        for p in supported_paths() {
            let l = chunk_losses(&logits, vocab, &targets, p);
            for (a, b) in l.iter().zip(&l0) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{p}: loss {a} vs {b}");
            }
            let d = chunk_dlogits(&logits, vocab, &targets, 0.5, p);
            let e = d.iter().zip(&d0).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / dscale;
            assert!(e <= 1e-6, "{p}: dlogits max relative error {e:e}");
        }
    }
}
