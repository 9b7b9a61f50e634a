//! The chunked linear + cross-entropy in candle tensor ops, on any device: the device-generic twin of the CPU
//! kernel (`cpu.rs`), with its contracts, chunking and outputs. Per chunk of rows: `logits = h · Wᵀ`, the log-softmax in the
//! compute dtype (f32, f64 for f64), the target column gathered (ignored rows, target < 0, contribute 0);
//! backward: `dlogits = g · (softmax - onehot)`, then `d_hidden` chunk by chunk and `d_lm_head` as a running
//! sum in chunk order. The targets stay a device tensor (the door refuses out-of-range ones first).

use candle_core::{DType, Tensor, D};

use autosp_core::{Precision, Result};

use crate::running_sum::add_to;

/// The loss sum (`[]` in the compute dtype) of checked inputs (`hidden: [m, d]`) and, when `grad` is given,
/// `(d_hidden, d_lm_head)` scaled by it in the inputs' dtypes (`d_lm_head` only when `weight`).
pub(crate) fn run(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    grad: Option<f64>,
    weight: bool,
) -> Result<(Tensor, super::LossGrads)> {
    let m = hidden.dim(0)?;
    let cd = Precision::float(hidden.dtype()).compute();
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
                if weight {
                    add_to(&mut dw, dl.t()?.matmul(&hc)?)?;
                }
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
                Some(dw) => Some(dw),
                None if weight => Some(w.zeros_like()?),
                None => None,
            };
            Some((dh.to_dtype(hidden.dtype())?, dw.map(|d| d.to_dtype(lm_head.dtype())).transpose()?))
        }
    };
    Ok((loss, grads))
}
