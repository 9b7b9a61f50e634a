//! The chunked linear + cross-entropy: the summed token loss of `hidden @ lm_head^T` against targets,
//! computed in pieces so that no `[m, vocab]` logits tensor ever exists. The op's one door: plain functions
//! ([`chunked_cross_entropy_forward`], [`chunked_cross_entropy_backward`]), the tape op
//! ([`ChunkedCrossEntropyOp`], [`chunked_cross_entropy`]), the checks, and the choice of kernel:
//!
//! - the CPU kernel (`cpu.rs`, CPU tensors): row chunks of the caller's `chunk_rows`, the softmax rows on
//!   the host on the vector path, `d_lm_head` a running sum accumulated in place;
//! - the device-generic kernel (`generic.rs`, candle ops, every other device): `[rows, vocab]` tiles sized
//!   from a byte budget per device ([`LossTiles::for_inputs`]; `chunk_rows` is not used), the GEMMs in the
//!   inputs' dtype (bf16/f16 on a GPU) and the softmax statistics in f32 (f64 for f64), the backward tiled
//!   over the vocabulary so each tile of `d_lm_head` is final at once and written into one preallocated
//!   `[vocab, d]` gradient; see that module for the algorithm, precision and memory.
//!
//! - the sharded head (`sharded.rs`, a head sharded at `Gradients` or `Parameters`): vocabulary tiles gathered
//!   one at a time and their gradients reduce-scattered tile by tile ([`chunked_cross_entropy_param`]).
//!
//! Forward keeps nothing but its inputs; backward recomputes the logits. Returns the sum of token losses and
//! the valid-token count, as [`autosp_core::ops::cross_entropy()`] does, for the global reduction of sequence
//! parallelism; the loss in f32 (f64 for f64; [`Precision::accumulate`]). Both kernels sum in a fixed order:
//! deterministic.
//!
//! Host reads ([`autosp_core::host_read`]): a forward call reads back one small tensor (the count of
//! out-of-range targets, the largest target and the count of valid ones); on the generic route the op's own
//! forward and backward read nothing (the upstream gradient stays on the device), and the plain backward
//! reads that summary once to check its targets. On the CPU route the CPU kernel reads its targets on the
//! host (CPU storage) and refuses out-of-range ones itself, and a backward reads the upstream gradient once.

mod cpu;
mod generic;
mod sharded;

pub use generic::{LossTiles, MIN_VOCAB_TILE, TILE_BYTES_CPU, TILE_BYTES_GPU};
pub use sharded::{chunked_cross_entropy_param, sharded_head_logits, ShardedHeadLoss};

use autosp_core::dispatch::{select, Route};
use autosp_core::host_read::{read_f64, read_vec};
use autosp_core::ops::IGNORE_INDEX;
use autosp_core::{Error, NodeKind, Op, Precision, Result, SavedTensors, Saves, Tape, Value};
use candle_core::{DType, Device, Tensor};

use crate::shape_error::mismatch;

const OP: &str = "chunked_cross_entropy";

/// The chunked loss without a tape: `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]` (i64 or u32,
/// negative = ignored) -> `(sum of token losses: []` in f32, f64 for f64 inputs (a bf16/f16 hidden still gives
/// an f32 loss)`, valid-token count)`. Transient memory: one `[chunk_rows, vocab]` logits block on the CPU
/// kernel, a few tiles of [`LossTiles::for_inputs`] on the generic one. One host read.
pub fn chunked_cross_entropy_forward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
) -> Result<(Tensor, usize)> {
    let vocab = check(hidden, lm_head, targets, chunk_rows)?;
    let route = select(hidden);
    let count = read_targets(targets, vocab, route)?;
    Ok((forward(route, hidden, lm_head, targets, chunk_rows)?, count))
}

/// The forward of checked inputs on `route`, reading nothing back but what the CPU kernel reads on the host.
fn forward(route: Route, hidden: &Tensor, lm_head: &Tensor, targets: &Tensor, chunk_rows: usize) -> Result<Tensor> {
    let (m, vocab) = (hidden.dim(0)?, lm_head.dim(0)?);
    match route {
        Route::Cpu => {
            let (loss, _) = cpu::run(hidden, lm_head, targets, vocab, chunk_rows, None, false)?;
            // The loss stays in the accumulation dtype (f32, f64 for f64): never rounded to a bf16/f16 hidden dtype.
            Ok(Tensor::new(loss, hidden.device())?.to_dtype(Precision::float(hidden.dtype()).accumulate())?)
        }
        Route::Generic => {
            generic::forward(hidden, lm_head, targets, LossTiles::for_inputs(hidden.device(), hidden.dtype(), m, vocab))
        }
    }
}

/// What a chunked loss pass returns besides the loss when asked for gradients: `(d_hidden, d_lm_head)`, the
/// head's only when asked for.
pub(crate) type LossGrads = Option<(Tensor, Option<Tensor>)>;

/// The chunked loss's backward without a tape: the gradients of `grad * sum of token losses` with respect to
/// `hidden: [m, d]` and `lm_head: [vocab, d]`, as `(d_hidden: [m, d], d_lm_head: [vocab, d])` in the dtypes of
/// hidden and lm_head. At most one host read.
pub fn chunked_cross_entropy_backward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    grad: f64,
) -> Result<(Tensor, Tensor)> {
    let vocab = check(hidden, lm_head, targets, chunk_rows)?;
    let route = select(hidden);
    if route == Route::Generic {
        read_targets(targets, vocab, route)?;
    }
    let grad = Tensor::new(grad, &Device::Cpu)?;
    let (dh, dw) = backward(route, hidden, lm_head, targets, chunk_rows, &grad, true)?;
    Ok((dh, dw.ok_or_else(|| Error::Internal(format!("{OP}: backward produced no head gradient")))?))
}

/// The backward of checked inputs on `route`: `grad` is the upstream gradient, a one-element float tensor
/// (the CPU kernel reads it back, counted; the generic one keeps it on the device, moving it there when it
/// is made on the host). The head's gradient only when `weight` asks for it (a frozen head skips its
/// `[vocab, d]` products).
fn backward(
    route: Route,
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    grad: &Tensor,
    weight: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (m, vocab) = (hidden.dim(0)?, lm_head.dim(0)?);
    match route {
        Route::Cpu => {
            let g = read_f64(grad)?;
            let grads = cpu::run(hidden, lm_head, targets, vocab, chunk_rows, Some(g), weight)?.1;
            grads.ok_or_else(|| Error::Internal(format!("{OP}: backward produced no gradients")))
        }
        Route::Generic => {
            // A host-made g is narrowed on the host (never f64 on the device unless the inputs are), then moved.
            let g = grad.to_dtype(Precision::float(hidden.dtype()).accumulate())?.to_device(hidden.device())?;
            let tiles = LossTiles::for_inputs(hidden.device(), hidden.dtype(), m, vocab);
            generic::backward(hidden, lm_head, targets, tiles, &g, weight)
        }
    }
}

/// The device-generic kernel's forward in the given `tiles` (at least 1 x 1), on any device whatever the
/// dispatch says: tests run many row and vocabulary tiles on small shapes, benchmarks time the generic kernel
/// on the CPU. Checks as [`chunked_cross_entropy_forward`] (one host read). Not part of the stable API.
#[doc(hidden)]
pub fn generic_forward_with_tiles(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    tiles: LossTiles,
) -> Result<(Tensor, usize)> {
    let vocab = check(hidden, lm_head, targets, 1)?;
    let count = read_targets(targets, vocab, Route::Generic)?;
    Ok((generic::forward(hidden, lm_head, targets, tiles)?, count))
}

/// [`generic_forward_with_tiles`]'s backward: `(d_hidden, d_lm_head` when `weight``)` of `grad * loss`. Not
/// part of the stable API.
#[doc(hidden)]
pub fn generic_backward_with_tiles(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    tiles: LossTiles,
    grad: f64,
    weight: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let vocab = check(hidden, lm_head, targets, 1)?;
    read_targets(targets, vocab, Route::Generic)?;
    let g = Tensor::new(grad, &Device::Cpu)?.to_dtype(Precision::float(hidden.dtype()).accumulate())?;
    generic::backward(hidden, lm_head, targets, tiles, &g.to_device(hidden.device())?, weight)
}

/// The chunked loss as a tape op: inputs `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]` (i64 or
/// u32, negative = ignored, as [`IGNORE_INDEX`]); output the summed loss `[]` in f32 (f64 for f64 inputs).
/// Kind [`NodeKind::Loss`]. Apply it through [`chunked_cross_entropy`], which checks the targets: the op
/// itself reads nothing back on the generic route and trusts them there.
///
/// On a recording tape ([`chunked_cross_entropy`]) with the CPU kernel in the dtype it computes in (f32, f64),
/// the gradients come from the loss's own pass (`grads_in_forward`): the loss's gradient with respect to its
/// logits needs nothing but the upstream scalar, so the forward returns `d_hidden: [m, d]` and `d_lm_head:
/// [vocab, d]` (empty for a frozen head) for a gradient of 1 as two more outputs, which the tape holds in place
/// of the inputs, and backward only scales them: three products in all instead of four (the backward's
/// recomputed logits are gone; at the bench preset, 8K tokens, the loss took 11.1 of the step's 29.0 s). Elsewhere
/// (the generic kernel; bf16/f16 inputs, whose unscaled head gradient could overflow f16) the op has one output
/// and backward recomputes the logits.
#[derive(Debug)]
pub struct ChunkedCrossEntropyOp {
    /// Rows of `hidden` per chunk of the CPU kernel: its transient logits are `[chunk_rows, vocab]`. The
    /// generic kernel sizes its own tiles ([`LossTiles::for_inputs`]).
    pub chunk_rows: usize,
    /// The gradients from the loss's own pass (see above; only for CPU inputs in f32 or f64): `Some(head)`,
    /// `head` whether the head's gradient is wanted; `None`: the loss alone, backward recomputes.
    pub grads_in_forward: Option<bool>,
}

impl ChunkedCrossEntropyOp {
    /// The op for `hidden` on `tape`: the gradients from the loss's own pass when the tape records and the
    /// CPU kernel computes in `hidden`'s dtype.
    fn for_tape(tape: &Tape, hidden: &Value, lm_head: &Value, chunk_rows: usize) -> Self {
        let h = hidden.tensor();
        let fused =
            tape.is_recording() && select(h) == Route::Cpu && Precision::float(h.dtype()).compute() == h.dtype();
        Self { chunk_rows, grads_in_forward: fused.then(|| tape.requires_grad(lm_head)) }
    }
}

impl Op for ChunkedCrossEntropyOp {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Loss
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let vocab = check(i[0], i[1], i[2], self.chunk_rows)?;
        let Some(head) = self.grads_in_forward else {
            return Ok(vec![forward(select(i[0]), i[0], i[1], i[2], self.chunk_rows)?]);
        };
        let (loss, grads) = cpu::run(i[0], i[1], i[2], vocab, self.chunk_rows, Some(1.0), head)?;
        let (dh, dw) = grads.ok_or_else(|| Error::Internal(format!("{OP}: the fused pass produced no gradients")))?;
        let loss = Tensor::new(loss, i[0].device())?.to_dtype(Precision::float(i[0].dtype()).accumulate())?;
        let dw = match dw {
            Some(dw) => dw,
            None => Tensor::zeros(0, i[1].dtype(), i[1].device())?,
        };
        Ok(vec![loss, dh, dw])
    }
    fn saves(&self) -> Saves {
        match self.grads_in_forward {
            Some(_) => Saves::outputs(&[1, 2]),
            None => Saves::inputs(&[0, 1, 2]),
        }
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 3]) };
        let Some(head) = self.grads_in_forward else {
            let (h, w, t) = (s.input(0)?, s.input(1)?, s.input(2)?);
            let (dh, dw) = backward(select(h), h, w, t, self.chunk_rows, g, s.needs_grad(1))?;
            return Ok(vec![Some(dh), dw, None]);
        };
        // The forward's gradients for an upstream 1, scaled by the upstream gradient on their device.
        let scaled = |x: &Tensor| x.broadcast_mul(&g.to_dtype(x.dtype())?);
        let dw = match (s.needs_grad(1), head) {
            (true, true) => Some(scaled(s.output(2)?)?),
            (true, false) => {
                return Err(Error::Internal(format!(
                    "{OP}: the head was frozen when the loss ran but wants a gradient"
                )))
            }
            (false, _) => None,
        };
        Ok(vec![Some(scaled(s.output(1)?)?), dw, None])
    }
}

/// Linear + cross-entropy in chunks on the tape: `hidden: [m, d]`, `lm_head: [vocab, d]`, `targets: [m]`
/// (i64 or u32; [`IGNORE_INDEX`] skipped). Returns `(sum of token losses: []` in f32 (f64 for f64)`, valid
/// count)`, equal to `cross_entropy(linear(hidden, lm_head))` of autosp-core, while no `[m, vocab]` tensor is
/// ever made: the tape holds only the inputs. One host read (the targets' summary); on the generic route the
/// op's backward reads nothing.
pub fn chunked_cross_entropy(
    tape: &Tape,
    hidden: &Value,
    lm_head: &Value,
    targets: &Value,
    chunk_rows: usize,
) -> Result<(Value, usize)> {
    let vocab = check(hidden.tensor(), lm_head.tensor(), targets.tensor(), chunk_rows)?;
    let count = read_targets(targets.tensor(), vocab, select(hidden.tensor()))?;
    let op = ChunkedCrossEntropyOp::for_tape(tape, hidden, lm_head, chunk_rows);
    Ok((tape.apply(op, &[hidden, lm_head, targets])?.remove(0), count))
}

/// `vocab` after checking shapes, dtypes, the chunk size and that the vocabulary is not empty.
fn check(hidden: &Tensor, lm_head: &Tensor, targets: &Tensor, chunk_rows: usize) -> Result<usize> {
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
    if vocab == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: "lm_head has no rows: a vocabulary of 0 has no loss".into(),
        });
    }
    Precision::of(OP, hidden.dtype())?;
    Ok(vocab)
}

/// The valid-target count of `targets: [m]` (i64 or u32, negative = ignored) in one counted host read of
/// `[targets >= vocab, largest target, targets >= 0]` (i64 on the device, u32 sums); on the generic route
/// out-of-range targets are a typed error naming the largest (the CPU kernel refuses them itself on the
/// host). No read for `m = 0`.
fn read_targets(targets: &Tensor, vocab: usize, route: Route) -> Result<usize> {
    if targets.elem_count() == 0 {
        return Ok(0);
    }
    let t = targets.to_dtype(DType::I64)?;
    let count = |mask: Tensor| mask.to_dtype(DType::U32)?.sum_all()?.to_dtype(DType::I64);
    let summary = Tensor::stack(&[count(t.ge(vocab as i64)?)?, t.max_all()?, count(t.ge(0i64)?)?], 0)?;
    let &[bad, max, valid] = read_vec::<i64>(&summary)?.as_slice() else {
        return Err(Error::Internal(format!("{OP}: the targets' summary is not three numbers")));
    };
    if route == Route::Generic && bad > 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!(
                "target {max} is out of range for {vocab} classes ({bad} targets are; use {IGNORE_INDEX} to ignore \
                 a position)"
            ),
        });
    }
    Ok(valid as usize)
}
