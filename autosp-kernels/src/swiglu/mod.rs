//! SwiGLU, `y = silu(gate) * up` with `silu(a) = a / (1 + e^-a)`: the op's one door. Plain functions
//! ([`swiglu_forward`], [`swiglu_backward`]), the tape op ([`SwiGluOp`], [`swiglu`]), the checks, and the
//! choice of kernel: the fused CPU kernel (`cpu.rs`: one pass each way) for CPU tensors, the candle-op kernel
//! (`generic.rs`) elsewhere.

mod cpu;
mod generic;

use autosp_core::dispatch::{select, Route};
use autosp_core::{NodeKind, Op, Precision, Result, SavedTensors, Saves, Tape, Value};
use candle_core::Tensor;

use crate::shape_error::mismatch;

const OP: &str = "swiglu";

/// SwiGLU without a tape: `gate, up: [.., f]` -> `silu(gate) * up`, `[.., f]` in gate's dtype.
pub fn swiglu_forward(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check(gate, up)?;
    match select(gate) {
        Route::Cpu => cpu::forward(gate, up),
        Route::Generic => generic::forward(gate, up),
    }
}

/// SwiGLU's backward without a tape: `gate, up, g: [.., f]` (g the output's gradient) -> `(d_gate, d_up)`.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor)> {
    check_backward(gate, up, g)?;
    match select(gate) {
        Route::Cpu => cpu::backward(gate, up, g),
        Route::Generic => generic::backward(gate, up, g),
    }
}

/// SwiGLU as a tape op: inputs `gate, up: [.., f]`, output `[.., f]`. Kind [`NodeKind::Elementwise`].
#[derive(Debug)]
pub struct SwiGluOp;

impl Op for SwiGluOp {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![swiglu_forward(i[0], i[1])?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let (da, du) = swiglu_backward(s.input(0)?, s.input(1)?, g)?;
        Ok(vec![Some(da), Some(du)])
    }
}

/// SwiGLU on the tape: `gate, up: [.., f]` -> `silu(gate) * up`, the same maths as
/// `ops::mul(ops::silu(gate), up)` from autosp-core in one pass.
pub fn swiglu(tape: &Tape, gate: &Value, up: &Value) -> Result<Value> {
    check(gate.tensor(), up.tensor())?;
    Ok(tape.apply(SwiGluOp, &[gate, up])?.remove(0))
}

/// Checks that `gate` and `up` have one shape and a float dtype.
fn check(gate: &Tensor, up: &Tensor) -> Result<()> {
    if gate.dims() != up.dims() {
        return Err(mismatch(
            OP,
            "gate",
            gate.dims(),
            "up",
            up.dims(),
            "gate and up must have one shape [.., f]".into(),
        ));
    }
    Precision::of(OP, gate.dtype())?;
    Ok(())
}

/// Checks the backward's inputs: [`check`], and `g` of gate's shape.
fn check_backward(gate: &Tensor, up: &Tensor, g: &Tensor) -> Result<()> {
    check(gate, up)?;
    if g.dims() != gate.dims() {
        return Err(mismatch(
            OP,
            "grad",
            g.dims(),
            "gate",
            gate.dims(),
            "the output gradient must have gate's shape".into(),
        ));
    }
    Ok(())
}
