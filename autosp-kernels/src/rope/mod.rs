//! Rotary position embedding (rotate-half, as Llama in HF transformers): the op's one door. Plain functions
//! ([`rope_forward`], [`rope_backward`]), the tape op ([`RopeOp`], [`rope`]), the checks, and the choice of
//! kernel: the fused CPU kernel (`cpu.rs`: one pass that reads x through its strides) for CPU tensors, the
//! candle-op kernel (`generic.rs`) elsewhere. The backward is the inverse rotation of the gradient.

mod cpu;
mod generic;

use autosp_core::dispatch::{select, Route};
use autosp_core::{NodeKind, Op, Precision, Result, SavedTensors, Saves, Tape, Value};
use candle_core::Tensor;

use crate::shape_error::mismatch;

const OP: &str = "rope";

/// RoPE without a tape: `x: [b, n, h, d]` (any strides; a view is read in place), `cos, sin: [n, d/2]` or
/// `[b, n, d/2]` (from [`autosp_core::ops::rope_tables`]) -> contiguous `[b, n, h, d]` in x's dtype.
pub fn rope_forward(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotate(x, cos, sin, false)
}

/// RoPE's backward without a tape: the gradient `g: [b, n, h, d]` of the output rotated back, `[b, n, h, d]`.
pub fn rope_backward(g: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rotate(g, cos, sin, true)
}

/// The door of both directions: checks, then the kernel for x's device.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    let dims = check(x, cos, sin)?;
    if x.elem_count() == 0 {
        return Ok(x.zeros_like()?);
    }
    match select(x) {
        Route::Cpu => cpu::rotate(x, cos, sin, dims, inverse),
        Route::Generic => generic::rotate(x, cos, sin, dims, inverse),
    }
}

/// RoPE as a tape op: inputs `x: [b, n, h, d]` (any strides), `cos, sin: [n, d/2]` or `[b, n, d/2]`; output
/// `[b, n, h, d]`. Kind [`NodeKind::Elementwise`]. No gradient flows to the tables.
#[derive(Debug)]
pub struct RopeOp;

impl Op for RopeOp {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![rope_forward(i[0], i[1], i[2])?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[1, 2])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 3]) };
        Ok(vec![Some(rope_backward(g, s.input(1)?, s.input(2)?)?), None, None])
    }
}

/// RoPE on the tape: `x: [b, n, h, d]` (a strided view is fine), `cos, sin: [n, d/2]` or `[b, n, d/2]`
/// -> `[b, n, h, d]`; the same maths as [`autosp_core::ops::rope`]. No gradient flows to the tables.
pub fn rope(tape: &Tape, x: &Value, cos: &Value, sin: &Value) -> Result<Value> {
    check(x.tensor(), cos.tensor(), sin.tensor())?;
    Ok(tape.apply(RopeOp, &[x, cos, sin])?.remove(0))
}

/// `(b, n, h, d, table batch)` after checking the shapes and the dtype.
fn check(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
    let &[b, n, h, d] = x.dims() else {
        return Err(mismatch(
            OP,
            "x",
            x.dims(),
            "cos",
            cos.dims(),
            "rope takes x [batch, seq, heads, head_dim]".into(),
        ));
    };
    for (name, t) in [("cos", cos), ("sin", sin)] {
        let tb = match t.dims() {
            [tn, th] if *tn == n && *th * 2 == d => 1,
            [tb, tn, th] if *tb == b && *tn == n && *th * 2 == d => b,
            _ => 0,
        };
        if tb == 0 || d % 2 != 0 {
            return Err(mismatch(
                OP,
                "x",
                x.dims(),
                name,
                t.dims(),
                "rope takes x [b, n, h, d] (d even) and cos/sin [n, d/2] or [b, n, d/2]".into(),
            ));
        }
    }
    if cos.dims() != sin.dims() {
        return Err(mismatch(OP, "cos", cos.dims(), "sin", sin.dims(), "cos and sin must have one shape".into()));
    }
    Precision::of(OP, x.dtype())?;
    Ok((b, n, h, d, if cos.rank() == 3 { b } else { 1 }))
}
