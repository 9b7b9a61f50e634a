//! Cross-entropy from logits with an ignore index (-100): returns the sum of the token losses (not the mean)
//! and the number of valid tokens, so that sequence-parallel ranks can reduce both and divide once.

use candle_core::{DType, Tensor, D};

use crate::precision::Precision;
use crate::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// The label that marks a position with no target.
pub const IGNORE_INDEX: i64 = -100;

/// Summed cross-entropy: `logits: [m, vocab]`, `targets: [m]` (i64, `-100` ignored) -> `[]`.
#[derive(Debug)]
pub struct CrossEntropy;

/// The `(valid as accum dtype [m, 1], targets clamped to >= 0 as [m, 1] u32)` pair.
fn valid_and_index(targets: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
    let t = targets.to_dtype(DType::I64)?;
    let valid = t.ge(0i64)?;
    let index = valid.where_cond(&t, &t.zeros_like()?)?.to_dtype(DType::U32)?.unsqueeze(1)?;
    Ok((valid.to_dtype(dtype)?.unsqueeze(1)?, index))
}

/// The number of targets that are not [`IGNORE_INDEX`] (one counted host read, [`crate::host_read`]).
pub fn count_valid(targets: &Tensor) -> Result<usize> {
    let count = targets.to_dtype(DType::I64)?.ge(0i64)?.to_dtype(DType::U32)?.sum_all()?;
    Ok(crate::host_read::read_f64(&count)? as usize)
}

/// Per-row `log(sum(exp(x)))` of `x: [m, v]` as `[m, 1]`.
pub fn row_lse(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?;
    Ok((x.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?)
}

impl Op for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross_entropy"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Loss
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (logits, targets) = (i[0], i[1]);
        let (m, vocab) = logits.dims2()?;
        if targets.dims() != [m] {
            return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                op: "cross_entropy",
                lhs_name: "logits",
                lhs: logits.dims().to_vec(),
                rhs_name: "targets",
                rhs: targets.dims().to_vec(),
                hint: "logits are [m, vocab] and targets [m]".into(),
            })));
        }
        let t = targets.to_dtype(DType::I64)?;
        let max = if m > 0 { crate::host_read::read_f64(&t.max_keepdim(0)?)? as i64 } else { 0 };
        if max >= vocab as i64 {
            return Err(Error::InvalidArgument {
                op: "cross_entropy",
                msg: format!(
                    "target {max} is out of range for {vocab} classes (use {IGNORE_INDEX} to ignore a position)"
                ),
            });
        }
        let x = logits.to_dtype(Precision::float(logits.dtype()).accumulate())?;
        let (valid, index) = valid_and_index(targets, x.dtype())?;
        let picked = x.gather(&index, 1)?;
        let loss = ((row_lse(&x)? - picked)? * valid)?.sum_all()?;
        Ok(vec![loss.to_dtype(logits.dtype())?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let (logits, targets) = (s.input(0)?, s.input(1)?);
        let x = logits.to_dtype(Precision::float(logits.dtype()).accumulate())?;
        let (valid, index) = valid_and_index(targets, x.dtype())?;
        let p = x.broadcast_sub(&row_lse(&x)?)?.exp()?;
        let onehot = p.zeros_like()?.scatter_add(&index, &valid.ones_like()?, 1)?;
        let g = g.to_dtype(x.dtype())?;
        let d = (p - onehot)?.broadcast_mul(&valid)?.broadcast_mul(&g)?;
        Ok(vec![Some(d.to_dtype(logits.dtype())?), None])
    }
}

/// Summed cross-entropy and valid-token count: `logits: [m, vocab]`, `targets: [m]` (i64 or u32;
/// [`IGNORE_INDEX`] skipped). Returns `(sum of token losses: [], valid count)`.
pub fn cross_entropy(tape: &Tape, logits: &Value, targets: &Value) -> Result<(Value, usize)> {
    let count = count_valid(targets.tensor())?;
    Ok((tape.apply(CrossEntropy, &[logits, targets])?.remove(0), count))
}
