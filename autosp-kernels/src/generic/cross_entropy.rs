//! Chunked linear + cross-entropy in candle tensor ops: the device-generic twin of [`crate::chunked_loss`],
//! with its contracts, chunking and outputs. Per chunk of rows: `logits = h · Wᵀ`, the log-softmax in the
//! compute dtype (f32, f64 for f64), the target column gathered (ignored rows, target < 0, contribute 0);
//! backward: `dlogits = g · (softmax - onehot)`, then `d_hidden` chunk by chunk and `d_lm_head` as a running
//! sum in chunk order. The targets stay a device tensor; the one host read is a single scalar, the count of
//! out-of-range targets, to refuse them with a typed error.

use candle_core::{DType, Tensor, D};

use autosp_core::ops::cross_entropy::count_valid;
use autosp_core::ops::IGNORE_INDEX;
use autosp_core::{Error, Result};

use crate::chunked_loss::{check, OP};
use crate::fused::compute_dtype;
use crate::running_sum::add_to;

/// Refuses targets `>= vocab` (`targets: [m]`, i64 or u32) with a typed error, reading back only the count of
/// such targets (and, when there are some, the largest).
pub fn check_targets(targets: &Tensor, vocab: usize) -> Result<()> {
    let t = targets.to_dtype(DType::I64)?;
    let bad = t.ge(vocab as i64)?.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()?;
    if bad > 0 {
        let max = t.max_all()?.to_scalar::<i64>()?;
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "target {max} is out of range for {vocab} classes ({bad} targets are; use {IGNORE_INDEX} to ignore \
                 a position)"
            ),
        });
    }
    Ok(())
}

/// The loss sum (`[]` in the compute dtype) and, when `grad` is given, `(d_hidden, d_lm_head)` scaled by it in
/// the inputs' dtypes.
fn run(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    grad: Option<f64>,
) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
    let (m, _, vocab) = check(hidden, lm_head, targets, chunk_rows)?;
    check_targets(targets, vocab)?;
    let cd = compute_dtype(OP, hidden.dtype())?;
    let (h, w) = (hidden.to_dtype(cd)?.contiguous()?, lm_head.to_dtype(cd)?.contiguous()?);
    let wt = w.t()?;
    let t = targets.to_dtype(DType::I64)?;
    // valid: [m] u8; ids: [m] u32 with ignored rows pointing at class 0 (masked out below).
    let valid = t.ge(0i64)?;
    let ids = valid.where_cond(&t, &t.zeros_like()?)?.to_dtype(DType::U32)?;
    let mut total: Option<Tensor> = None;
    let mut dh_chunks = Vec::new();
    let mut dw: Option<Tensor> = None;
    let mut start = 0;
    while start < m {
        let rows = chunk_rows.min(m - start);
        let hc = h.narrow(0, start, rows)?;
        let logits = hc.matmul(&wt)?;
        let vc = valid.narrow(0, start, rows)?.unsqueeze(1)?;
        let ic = ids.narrow(0, start, rows)?.unsqueeze(1)?.contiguous()?;
        let zeros = Tensor::zeros((rows, 1), cd, hidden.device())?;
        let mx = logits.max_keepdim(D::Minus1)?;
        let ex = logits.broadcast_sub(&mx)?.exp()?;
        let sum = ex.sum_keepdim(D::Minus1)?;
        match grad {
            None => {
                let lse = (sum.log()? + mx)?;
                let loss = vc.where_cond(&(lse - logits.gather(&ic, 1)?)?, &zeros)?;
                add_to(&mut total, loss.sum_all()?)?;
            }
            Some(g) => {
                drop(logits);
                // g · softmax on valid rows, 0 on ignored ones; then -g at each valid row's target.
                let scale = vc.where_cond(&(sum.recip()? * g)?, &zeros)?;
                let minus_g = vc.where_cond(&(zeros.ones_like()? * -g)?, &zeros)?;
                let dl = ex.broadcast_mul(&scale)?.scatter_add(&ic, &minus_g, 1)?;
                drop(ex);
                dh_chunks.push(dl.matmul(&w)?);
                add_to(&mut dw, dl.t()?.matmul(&hc)?)?;
            }
        }
        start += rows;
    }
    let loss = match total {
        Some(t) => t,
        None => Tensor::zeros((), cd, hidden.device())?,
    };
    let grads = match grad {
        None => None,
        Some(_) => {
            let dh = if dh_chunks.is_empty() { h.zeros_like()? } else { Tensor::cat(&dh_chunks, 0)? };
            let dw = match dw {
                Some(dw) => dw,
                None => w.zeros_like()?,
            };
            Some((dh.to_dtype(hidden.dtype())?, dw.to_dtype(lm_head.dtype())?))
        }
    };
    Ok((loss, grads))
}

/// The chunked loss: `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]` (i64 or u32, negative =
/// ignored) -> `(sum of token losses: []` in f32, f64 for f64 inputs`, valid-token count)`, as
/// [`crate::chunked_cross_entropy_forward`]. Transient memory is one `[chunk_rows, vocab]` logits block (and
/// its exponentials).
pub fn chunked_cross_entropy_forward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<(Tensor, usize)> {
    let (loss, _) = run(hidden, lm_head, targets, chunk_rows, None)?;
    Ok((loss, count_valid(targets)?))
}

/// The chunked loss's backward: the gradients of `grad * sum of token losses` with respect to `hidden: [m, d]`
/// and `lm_head: [vocab, d]`, as `(d_hidden: [m, d], d_lm_head: [vocab, d])` in their inputs' dtypes, as
/// [`crate::chunked_cross_entropy_backward`].
pub fn chunked_cross_entropy_backward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    grad: f64,
) -> Result<(Tensor, Tensor)> {
    let (_, grads) = run(hidden, lm_head, targets, chunk_rows, Some(grad))?;
    grads.ok_or_else(|| Error::Internal(format!("{OP}: backward produced no gradients")))
}
