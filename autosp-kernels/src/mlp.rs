//! Chunked SwiGLU feed-forward: `y = (silu(x Wg^T) * (x Wu^T)) Wd^T` computed in row chunks, as one tape op
//! that saves only its input. Forward never holds more than one chunk's `[chunk_rows, f]` intermediates;
//! backward recomputes each chunk's gate and up projections, and accumulates the weight gradients chunk by
//! chunk in order (deterministic). This is recompute of cheap linear work at the granularity of a sequence
//! chunk: inside a checkpoint region that recomputes anyway (Full, SequenceAware) the `[n, f]` gate, up and
//! SwiGLU tensors (three times the hidden size per token for Llama) never exist for the whole sequence, in
//! the replay or in the gradients. It is device-generic as it is (candle's matmuls, and SwiGLU through its
//! door, [`crate::swiglu`], which picks SwiGLU's kernel); nothing is read on the host, so this file is the
//! op's whole door and kernel.
//!
//! Every GEMM runs in the storage dtype, as [`autosp_core::ops::linear`] does: the op makes no widened copy
//! of a weight (the old path held all three in f32 for the whole call) and bf16 GEMMs are what candle runs:
//! cuBLAS with f32 accumulation on CUDA (tensor cores); on the CPU candle 0.11 widens a bf16 GEMM's operands
//! to f32 for the duration of that one call and accumulates in f32. The products are rounded once to the
//! storage dtype, as the unchunked composition rounds them; what is summed over chunks (the weight
//! gradients) and the two halves of `dx` are summed in the accumulation dtype and rounded once.

use candle_core::{DType, Tensor};

use autosp_core::{Error, NodeKind, Op, Precision, Result, SavedTensors, Saves, Tape, Value};

use crate::shape_error::mismatch;
use crate::swiglu::{swiglu_backward, swiglu_forward};

const OP: &str = "chunked_swiglu_mlp";

/// The chunked MLP tape op: inputs `x: [.., d]`, `w_gate: [f, d]`, `w_up: [f, d]`, `w_down: [d, f]`; output
/// `[.., d]`. Saves only its inputs (the weights are parameters, held anyway). Kind [`NodeKind::Linear`].
#[derive(Debug)]
pub struct ChunkedMlpOp {
    /// Rows (tokens) per chunk: the transient intermediates are a few `[chunk_rows, f]` tensors.
    pub chunk_rows: usize,
}

/// `(m, d, f)` after checking shapes, dtypes and the chunk size.
fn check(x: &Tensor, wg: &Tensor, wu: &Tensor, wd: &Tensor, chunk_rows: usize) -> Result<(usize, usize, usize)> {
    if chunk_rows == 0 {
        return Err(Error::InvalidArgument { op: OP, msg: "chunk_rows must be at least 1 (try 1024)".into() });
    }
    let Some(&d) = x.dims().last() else {
        return Err(mismatch(OP, "x", x.dims(), "w_gate", wg.dims(), "x must be [.., d]".into()));
    };
    let &[f, dg] = wg.dims() else {
        return Err(mismatch(OP, "x", x.dims(), "w_gate", wg.dims(), "w_gate must be [f, d]".into()));
    };
    if dg != d {
        return Err(mismatch(OP, "x", x.dims(), "w_gate", wg.dims(), format!("w_gate must be [f, {d}], d from x")));
    }
    if wu.dims() != wg.dims() {
        return Err(mismatch(OP, "w_up", wu.dims(), "w_gate", wg.dims(), "w_up must have w_gate's shape".into()));
    }
    if wd.dims() != [d, f] {
        return Err(mismatch(OP, "w_down", wd.dims(), "w_gate", wg.dims(), format!("w_down must be [{d}, {f}]")));
    }
    for (name, w) in [("w_gate", wg), ("w_up", wu), ("w_down", wd)] {
        if w.dtype() != x.dtype() {
            return Err(Error::InvalidArgument {
                op: OP,
                msg: format!("x is {:?} but {name} is {:?}; convert them to one dtype", x.dtype(), w.dtype()),
            });
        }
    }
    Ok((x.elem_count() / d, d, f))
}

/// The inputs in their storage dtype, `x` flattened to `[m, d]`, all contiguous (a weight that already is,
/// as a parameter is, is shared, not copied), and the dtype sums over chunks run in.
struct Inputs {
    x: Tensor,
    wg: Tensor,
    wu: Tensor,
    wd: Tensor,
    acc: DType,
}

fn prepare(x: &Tensor, wg: &Tensor, wu: &Tensor, wd: &Tensor, chunk_rows: usize) -> Result<(Inputs, usize)> {
    let (m, d, _) = check(x, wg, wu, wd, chunk_rows)?;
    let acc = Precision::of(OP, x.dtype())?.accumulate();
    let c = |t: &Tensor| -> Result<Tensor> { Ok(t.contiguous()?) };
    Ok((Inputs { x: c(&x.reshape((m, d))?)?, wg: c(wg)?, wu: c(wu)?, wd: c(wd)?, acc }, m))
}

/// Rows `start..start + rows` of `t: [m, ..]`, contiguous: a copy of the chunk only (`[rows, d]`), so that a
/// GEMM that converts its operands' storage (candle's CPU bf16 GEMM widens the whole storage to f32) converts
/// the chunk, not all m rows, once per chunk.
fn chunk(t: &Tensor, start: usize, rows: usize) -> Result<Tensor> {
    let c = t.narrow(0, start, rows)?;
    Ok(if rows == t.dim(0)? { c } else { c.contiguous()? })
}

/// `acc += x` with the sum in `wide` (x in the storage dtype); the first term is kept as it is, so one chunk
/// widens nothing and f32/f64 sums are the plain running sum.
fn add_wide(acc: &mut Option<Tensor>, x: Tensor, wide: DType) -> Result<()> {
    *acc = Some(match acc.take() {
        Some(a) => (a.to_dtype(wide)? + x.to_dtype(wide)?)?,
        None => x,
    });
    Ok(())
}

/// `a + b` summed in `wide` and rounded once to their dtype.
fn sum_rounded(a: &Tensor, b: &Tensor, wide: DType) -> Result<Tensor> {
    if a.dtype() == wide {
        return Ok((a + b)?);
    }
    Ok((a.to_dtype(wide)? + b.to_dtype(wide)?)?.to_dtype(a.dtype())?)
}

/// One chunk's gate and up projections: `xc: [rows, d]` -> `([rows, f], [rows, f])`.
fn gate_up(xc: &Tensor, w: &Inputs) -> Result<(Tensor, Tensor)> {
    Ok((xc.matmul(&w.wg.t()?)?, xc.matmul(&w.wu.t()?)?))
}

/// The MLP without a tape: `x: [.., d]`, `w_gate, w_up: [f, d]`, `w_down: [d, f]` -> `[.., d]` in x's dtype.
/// Transient memory: one chunk's `[chunk_rows, f]` gate, up and SwiGLU.
pub fn chunked_mlp_forward(x: &Tensor, wg: &Tensor, wu: &Tensor, wd: &Tensor, chunk_rows: usize) -> Result<Tensor> {
    let (w, m) = prepare(x, wg, wu, wd, chunk_rows)?;
    let mut parts = Vec::with_capacity(m.div_ceil(chunk_rows));
    let mut start = 0;
    while start < m {
        let rows = chunk_rows.min(m - start);
        let xc = chunk(&w.x, start, rows)?;
        let (g, u) = gate_up(&xc, &w)?;
        parts.push(swiglu_forward(&g, &u)?.matmul(&w.wd.t()?)?);
        start += rows;
    }
    let y = match parts.len() {
        0 => w.x.zeros_like()?,
        1 => parts.remove(0),
        _ => Tensor::cat(&parts, 0)?,
    };
    Ok(y.reshape(x.shape())?)
}

/// The MLP's backward without a tape: `dy: [.., d]` (the output's gradient) -> `(dx: [.., d], d_gate: [f, d],
/// d_up: [f, d], d_down: [d, f])`, recomputing each chunk's gate and up projections.
pub fn chunked_mlp_backward(
    x: &Tensor,
    wg: &Tensor,
    wu: &Tensor,
    wd: &Tensor,
    dy: &Tensor,
    chunk_rows: usize,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let (dx, dw) = chunked_mlp_grads(x, wg, wu, wd, dy, chunk_rows, true)?;
    let (dwg, dwu, dwd) = dw.expect("weight gradients were asked for");
    Ok((dx, dwg, dwu, dwd))
}

/// [`chunked_mlp_backward`], with the weights' gradients only when `weights` asks for them (frozen weights
/// skip three of the five products per chunk).
#[allow(clippy::type_complexity)]
fn chunked_mlp_grads(
    x: &Tensor,
    wg: &Tensor,
    wu: &Tensor,
    wd: &Tensor,
    dy: &Tensor,
    chunk_rows: usize,
    weights: bool,
) -> Result<(Tensor, Option<(Tensor, Tensor, Tensor)>)> {
    let (w, m) = prepare(x, wg, wu, wd, chunk_rows)?;
    if dy.dims() != x.dims() {
        return Err(mismatch(OP, "grad", dy.dims(), "x", x.dims(), "the output gradient must have x's shape".into()));
    }
    let dy = dy.to_dtype(x.dtype())?.reshape(w.x.shape())?.contiguous()?;
    let (mut dwg, mut dwu, mut dwd) = (None, None, None);
    let mut dx_parts = Vec::with_capacity(m.div_ceil(chunk_rows));
    let mut start = 0;
    while start < m {
        let rows = chunk_rows.min(m - start);
        let (xc, dyc) = (chunk(&w.x, start, rows)?, chunk(&dy, start, rows)?);
        let (g, u) = gate_up(&xc, &w)?;
        if weights {
            add_wide(&mut dwd, dyc.t()?.matmul(&swiglu_forward(&g, &u)?)?, w.acc)?;
        }
        let ds = dyc.matmul(&w.wd)?;
        let (dg, du) = swiglu_backward(&g, &u, &ds)?;
        drop((g, u, ds));
        if weights {
            add_wide(&mut dwg, dg.t()?.matmul(&xc)?, w.acc)?;
            add_wide(&mut dwu, du.t()?.matmul(&xc)?, w.acc)?;
        }
        dx_parts.push(sum_rounded(&dg.matmul(&w.wg)?, &du.matmul(&w.wu)?, w.acc)?);
        start += rows;
    }
    let dx = match dx_parts.len() {
        0 => w.x.zeros_like()?,
        1 => dx_parts.remove(0),
        _ => Tensor::cat(&dx_parts, 0)?,
    };
    let or_zeros = |acc: Option<Tensor>, like: &Tensor, dtype: DType| -> Result<Tensor> {
        Ok(match acc {
            Some(t) => t,
            None => like.zeros_like()?,
        }
        .to_dtype(dtype)?)
    };
    let dw = if weights {
        Some((or_zeros(dwg, &w.wg, wg.dtype())?, or_zeros(dwu, &w.wu, wu.dtype())?, or_zeros(dwd, &w.wd, wd.dtype())?))
    } else {
        None
    };
    Ok((dx.reshape(x.shape())?, dw))
}

impl Op for ChunkedMlpOp {
    fn name(&self) -> &'static str {
        OP
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Linear
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![chunked_mlp_forward(i[0], i[1], i[2], i[3], self.chunk_rows)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1, 2, 3])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 4]) };
        let weights = (1..4).any(|i| s.needs_grad(i));
        let (dx, dw) =
            chunked_mlp_grads(s.input(0)?, s.input(1)?, s.input(2)?, s.input(3)?, g, self.chunk_rows, weights)?;
        Ok(match dw {
            Some((dwg, dwu, dwd)) => vec![Some(dx), Some(dwg), Some(dwu), Some(dwd)],
            None => vec![Some(dx), None, None, None],
        })
    }
}

/// The chunked SwiGLU MLP on the tape: `x: [.., d]`, `w_gate, w_up: [f, d]`, `w_down: [d, f]` -> `[.., d]`,
/// equal to `linear(swiglu(linear(x, w_gate), linear(x, w_up)), w_down)` while the tape holds only `x`
/// (and the weights) and no `[n, f]` tensor outlives a chunk, forward or backward.
pub fn chunked_mlp(
    tape: &Tape,
    x: &Value,
    w_gate: &Value,
    w_up: &Value,
    w_down: &Value,
    chunk_rows: usize,
) -> Result<Value> {
    check(x.tensor(), w_gate.tensor(), w_up.tensor(), w_down.tensor(), chunk_rows)?;
    Ok(tape.apply(ChunkedMlpOp { chunk_rows }, &[x, w_gate, w_up, w_down])?.remove(0))
}
