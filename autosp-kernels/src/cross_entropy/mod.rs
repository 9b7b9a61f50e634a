//! The chunked linear + cross-entropy: the summed token loss of `hidden @ lm_head^T` against targets,
//! computed in row chunks so that no `[m, vocab]` logits tensor ever exists. The op's one door: plain
//! functions ([`chunked_cross_entropy_forward`], [`chunked_cross_entropy_backward`]), the tape op
//! ([`ChunkedCrossEntropyOp`], [`chunked_cross_entropy`]), the checks, and the choice of kernel: the CPU kernel
//! (`cpu.rs`: the softmax rows on the host, on the vector path) for CPU tensors, the candle-op kernel
//! (`generic.rs`) elsewhere.
//!
//! Forward keeps nothing but its inputs; backward recomputes each chunk's logits, turns them into
//! `softmax - onehot`, and accumulates `d_hidden` (chunk by chunk) and `d_lm_head` (a running sum, chunks in
//! order: deterministic). Returns the sum of token losses and the valid-token count, as
//! [`autosp_core::ops::cross_entropy`] does, for the global reduction of sequence parallelism; the loss in f32
//! (f64 for f64; [`Precision::accumulate`]).

mod cpu;
mod generic;

use autosp_core::dispatch::{select, Route};
use autosp_core::ops::cross_entropy::count_valid;
use autosp_core::ops::IGNORE_INDEX;
use autosp_core::{Error, NodeKind, Op, Precision, Result, SavedTensors, Saves, Tape, Value};
use candle_core::{DType, Tensor};

use crate::shape_error::mismatch;

const OP: &str = "chunked_cross_entropy";

/// The chunked loss without a tape: `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]` (i64 or u32,
/// negative = ignored) -> `(sum of token losses: []` in f32, f64 for f64 inputs (a bf16/f16 hidden still gives
/// an f32 loss)`, valid-token count)`. Transient memory is one `[chunk_rows, vocab]` logits block.
pub fn chunked_cross_entropy_forward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<(Tensor, usize)> {
    let (_, _, vocab) = check(hidden, lm_head, targets, chunk_rows)?;
    let loss = match select(hidden) {
        Route::Cpu => {
            let (loss, _) = cpu::run(hidden, lm_head, targets, vocab, chunk_rows, None, false)?;
            // The loss stays in the accumulation dtype (f32, f64 for f64): never rounded to a bf16/f16 hidden dtype.
            Tensor::new(loss, hidden.device())?.to_dtype(Precision::float(hidden.dtype()).accumulate())?
        }
        Route::Generic => {
            check_targets(targets, vocab)?;
            generic::run(hidden, lm_head, targets, chunk_rows, None, false)?.0
        }
    };
    Ok((loss, count_valid(targets)?))
}

/// What a chunked loss pass returns besides the loss when asked for gradients: `(d_hidden, d_lm_head)`, the
/// head's only when asked for.
pub(crate) type LossGrads = Option<(Tensor, Option<Tensor>)>;

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
    let (dh, dw) = backward(hidden, lm_head, targets, chunk_rows, grad, true)?;
    Ok((dh, dw.ok_or_else(|| Error::Internal(format!("{OP}: backward produced no head gradient")))?))
}

/// [`chunked_cross_entropy_backward`], with the head's gradient only when `weight` asks for it (a frozen head
/// skips its `[vocab, d]` product).
fn backward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    grad: f64,
    weight: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (_, _, vocab) = check(hidden, lm_head, targets, chunk_rows)?;
    let grads = match select(hidden) {
        Route::Cpu => cpu::run(hidden, lm_head, targets, vocab, chunk_rows, Some(grad), weight)?.1,
        Route::Generic => {
            check_targets(targets, vocab)?;
            generic::run(hidden, lm_head, targets, chunk_rows, Some(grad), weight)?.1
        }
    };
    grads.ok_or_else(|| Error::Internal(format!("{OP}: backward produced no gradients")))
}

/// The chunked loss as a tape op: inputs `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]` (i64 or
/// u32, negative = ignored, as [`IGNORE_INDEX`]); output the summed loss `[]` in f32 (f64 for f64 inputs).
/// Kind [`NodeKind::Loss`].
#[derive(Debug)]
pub struct ChunkedCrossEntropyOp {
    /// Rows of `hidden` per chunk: the transient logits are `[chunk_rows, vocab]`.
    pub chunk_rows: usize,
}

impl Op for ChunkedCrossEntropyOp {
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
        let (dh, dw) = backward(s.input(0)?, s.input(1)?, s.input(2)?, self.chunk_rows, g, s.needs_grad(1))?;
        Ok(vec![Some(dh), dw, None])
    }
}

/// Linear + cross-entropy in row chunks on the tape: `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]`
/// (i64 or u32; [`IGNORE_INDEX`] skipped). Returns `(sum of token losses: []` in f32 (f64 for f64)`, valid
/// count)`, equal to `cross_entropy(linear(hidden, lm_head))` of autosp-core, while no `[m, vocab]` tensor is
/// ever made: the tape holds only the inputs.
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
    Ok((tape.apply(ChunkedCrossEntropyOp { chunk_rows }, &[hidden, lm_head, targets])?.remove(0), count))
}

/// `(m, d, vocab)` after checking shapes, dtypes and the chunk size.
fn check(hidden: &Tensor, lm_head: &Tensor, targets: &Tensor, chunk_rows: usize) -> Result<(usize, usize, usize)> {
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
    Precision::of(OP, hidden.dtype())?;
    Ok((m, d, vocab))
}

/// Refuses targets `>= vocab` (`targets: [m]`, i64 or u32) with a typed error, reading back only the count of
/// such targets (and, when there are some, the largest).
fn check_targets(targets: &Tensor, vocab: usize) -> Result<()> {
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
