//! RMSNorm, `y = x / sqrt(mean(x^2) + eps) * w` over the last dim: the op's one door. Plain functions
//! ([`rms_norm_forward`], [`rms_norm_recip`], [`rms_norm_backward`]), the tape op ([`RmsNormOp`], [`rms_norm`]),
//! the checks, and the choice of kernel: the fused CPU kernel (`cpu.rs`: one pass over each row, rows split
//! across threads) for CPU tensors, the candle-op kernel (`generic.rs`) elsewhere. f32 and f64 compute
//! natively; bf16 and f16 compute in f32 ([`Precision`]) and come back in their dtype.
//!
//! The backward recomputes the reciprocal RMS of a row while the row is in cache (measured as cheap as reading
//! a saved one, see docs/BENCHMARKS.md), so the op saves only its inputs; a caller that kept the reciprocals
//! can pass them to [`rms_norm_backward`]. The CPU kernel sums the weight gradient over fixed row blocks in
//! block order, so it is the same bits whatever the thread count.

mod cpu;
mod generic;

use autosp_core::dispatch::{select, Route};
use autosp_core::{Error, NodeKind, Op, Precision, Result, SavedTensors, Saves, Tape, Value};
use candle_core::{Tensor, D};

use crate::shape_error::mismatch;

const OP: &str = "rms_norm";

/// RMSNorm without a tape: `x: [.., d]`, `w: [d]` -> `[.., d]` in x's dtype (bf16/f16 computed in f32).
pub fn rms_norm_forward(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let d = check(x, w, eps)?;
    if x.elem_count() == 0 {
        return Ok(x.zeros_like()?);
    }
    match select(x) {
        Route::Cpu => cpu::forward(x, w, d, eps),
        Route::Generic => generic::forward(x, w, eps),
    }
}

/// The reciprocal RMS of each row, `1 / sqrt(mean(x^2) + eps)`: `x: [.., d]` -> `[..]` in the compute dtype
/// (f64 for f64, else f32). Pass it to [`rms_norm_backward`] to skip recomputing it.
pub fn rms_norm_recip(x: &Tensor, eps: f64) -> Result<Tensor> {
    if x.rank() == 0 || x.dim(D::Minus1)? == 0 {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!("x has shape {:?}; it must be [.., d] with d > 0", x.dims()),
        });
    }
    Precision::of(OP, x.dtype())?;
    match select(x) {
        Route::Cpu => cpu::recip(x, eps),
        Route::Generic => generic::recip(x, eps),
    }
}

/// RMSNorm's backward without a tape: `x: [.., d]`, `w: [d]`, `g: [.., d]` (the output's gradient), and
/// optionally `recip: [..]` from [`rms_norm_recip`]. Returns `(dx: [.., d], dw: [d])` in the dtypes of x and w.
pub fn rms_norm_backward(
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    eps: f64,
    recip: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let d = check_backward(x, w, g, eps, recip)?;
    if x.elem_count() == 0 {
        return Ok((x.zeros_like()?, w.zeros_like()?));
    }
    match select(x) {
        Route::Cpu => cpu::backward(x, w, g, recip, d, eps),
        Route::Generic => generic::backward(x, w, g, recip, d, eps),
    }
}

/// RMSNorm as a tape op: inputs `x: [.., d]` and `w: [d]`, output `[.., d]`. Kind [`NodeKind::Norm`].
#[derive(Debug)]
pub struct RmsNormOp {
    /// Added to the mean square before the square root.
    pub eps: f64,
}

impl Op for RmsNormOp {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Norm
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![rms_norm_forward(i[0], i[1], self.eps)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let (dx, dw) = rms_norm_backward(s.input(0)?, s.input(1)?, g, self.eps, None)?;
        Ok(vec![Some(dx), Some(dw)])
    }
}

/// RMSNorm on the tape: `x: [.., d]`, `w: [d]` -> `[.., d]`; the same maths as [`autosp_core::ops::rms_norm`],
/// one pass over memory on the CPU.
pub fn rms_norm(tape: &Tape, x: &Value, w: &Value, eps: f64) -> Result<Value> {
    check(x.tensor(), w.tensor(), eps)?;
    Ok(tape.apply(RmsNormOp { eps }, &[x, w])?.remove(0))
}

/// `d` after checking `x: [.., d]`, `w: [d]`, the dtype and `eps`.
fn check(x: &Tensor, w: &Tensor, eps: f64) -> Result<usize> {
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidArgument { op: OP, msg: format!("eps must be finite and >= 0, got {eps}") });
    }
    if x.rank() == 0 {
        return Err(mismatch(OP, "x", x.dims(), "weight", w.dims(), "x must be [.., d] with rank >= 1".into()));
    }
    let d = x.dim(D::Minus1)?;
    if w.dims() != [d] {
        return Err(mismatch(
            OP,
            "x",
            x.dims(),
            "weight",
            w.dims(),
            format!("the weight must be [{d}], the last dim of x"),
        ));
    }
    Precision::of(OP, x.dtype())?;
    Ok(d)
}

/// `d` after checking the backward's inputs: [`check`], `g` of x's shape, `recip` of x's shape without the
/// last dim.
fn check_backward(x: &Tensor, w: &Tensor, g: &Tensor, eps: f64, recip: Option<&Tensor>) -> Result<usize> {
    let d = check(x, w, eps)?;
    if g.dims() != x.dims() {
        return Err(mismatch(OP, "grad", g.dims(), "x", x.dims(), "the output gradient must have x's shape".into()));
    }
    if let Some(r) = recip {
        if r.dims() != &x.dims()[..x.rank() - 1] {
            return Err(mismatch(
                OP,
                "recip",
                r.dims(),
                "x",
                x.dims(),
                "recip must be x's shape without the last dim".into(),
            ));
        }
    }
    Ok(d)
}
