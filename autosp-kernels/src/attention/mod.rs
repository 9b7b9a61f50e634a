//! Attention, the op: its one door. Plain functions on candle tensors ([`attention_forward`],
//! [`attention_backward`], [`attention_output`]), the tape op ([`AttentionOp`], [`attention`]) and the
//! default of every attention slot ([`LocalAttention`]), with the checks and the choice of kernel:
//!
//! - `cpu/`: the CPU flash kernel (64 × 64 tiles, online softmax in the log2 domain, hand-written AVX-512
//!   and pulp AVX2/NEON micro-kernels; deterministic backward);
//! - `generic.rs`: the device-generic kernel in candle tensor ops (CUDA, Metal, or the CPU when forced or for
//!   head dimensions above [`CPU_MAX_HEAD_DIM`]), with the same contract, LSE and backward included;
//! - `flash_attn.rs`: candle-flash-attn (feature `flash-attn`) for the inference output on CUDA, when
//!   `flash_attn_plan.rs` can express the mask.
//!
//! `route.rs` decides which one serves a call. Which keys a query sees comes from [`AttentionSpec`] alone.
//!
//! For generation, `kv_blocks.rs` holds one layer's part of a KV cache in blocks, and `decode.rs` attends a
//! new query to the parts the ranks hold, merged by LSE.
//!
//! Layout (autosp's, see `autosp_core::ops::attention`): `q: [batch, q_len, heads, head_dim]`,
//! `k, v: [batch, k_len, kv_heads, head_dim]`, `o` like `q`, `lse: [batch, heads, q_len]` (natural log, f32;
//! f64 for f64 inputs). Query head `h` reads kv head `h / (heads / kv_heads)` (GQA/MQA) straight from `k, v`:
//! repeated K/V are never materialised. A row that sees no key gets `lse = -inf` and `o = 0`.

mod cpu;
pub mod decode;
#[cfg(feature = "flash-attn")]
mod flash_attn;
#[cfg(any(feature = "flash-attn", test))]
mod flash_attn_plan;
mod generic;
pub mod kv_blocks;
mod route;

use std::sync::Arc;

use autosp_core::ops::attention::{apply_attention, AttentionDims, AttentionSpec};
use autosp_core::{Attention, NodeKind, Op, Precision, SavedTensors, Saves, Tape, Value};
use candle_core::{DType, Tensor};

use crate::{Error, Result};
use route::Backend;

pub use decode::{attention_over_blocks, decode_attention};
pub use generic::{TileSize, CHUNK_BUDGET_CPU, CHUNK_BUDGET_GPU, KEY_BLOCKS};
pub use kv_blocks::KvBlocks;
pub use route::CPU_MAX_HEAD_DIM;

const FWD: &str = "attention_forward";
const OUT: &str = "attention_output";
const BWD: &str = "attention_backward";

/// Attention forward. `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]` (one
/// dtype: f32, f64, bf16 or f16; one device). Returns `(o: [batch, q_len, heads, head_dim]` in q's dtype,
/// `lse: [batch, heads, q_len]` in f32 (f64 for f64 inputs)`)`, on q's device.
pub fn attention_forward(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<(Tensor, Tensor)> {
    let dims = check(FWD, q, k, v, spec, usize::MAX)?;
    match route::backend(q, dims.head_dim) {
        Backend::Cpu => Ok(cpu::forward(&dims, spec, q, k, v, false)?.0),
        _ => generic::forward(q, k, v, spec, dims, TileSize::for_call(&dims, q.dtype(), q.device())),
    }
}

/// Attention output only, for inference: `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len,
/// kv_heads, head_dim]`; returns `o: [batch, q_len, heads, head_dim]` in q's dtype on q's device: the output
/// of [`attention_forward`]. With feature `flash-attn`, CUDA inputs that candle-flash-attn takes (f16/bf16,
/// head_dim a multiple of 8 up to 512, the masks `flash_attn_plan.rs` lists: plain causal, KV-cache decoding,
/// unmasked, and their sliding windows) run it; other CUDA inputs run the generic kernel.
pub fn attention_output(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<Tensor> {
    let dims = check(OUT, q, k, v, spec, usize::MAX)?;
    match route::output_backend(q, dims.k_len, spec) {
        Backend::Cpu => Ok(cpu::forward(&dims, spec, q, k, v, false)?.0 .0),
        Backend::Generic => {
            Ok(generic::forward(q, k, v, spec, dims, TileSize::for_call(&dims, q.dtype(), q.device()))?.0)
        }
        #[cfg(feature = "flash-attn")]
        Backend::FlashAttn(mask) => flash_attn::forward_output(q, k, v, spec, mask),
    }
}

/// Attention backward from the forward's saved `o` and `lse`. `d_o: [batch, q_len, heads, head_dim]` is the
/// gradient of `o`; `d_lse: [batch, heads, q_len]`, when given, the gradient of `lse` (it adds `P ∘ d_lse` to
/// dS; Ring attention's merge needs it). Returns `(dq, dk, dv)` shaped and typed like `q, k, v`; the dk/dv of
/// a kv head sum its query-head group.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = check(BWD, q, k, v, spec, usize::MAX)?;
    check_backward(q, o, lse, d_o, d_lse, &dims)?;
    match route::backend(q, dims.head_dim) {
        Backend::Cpu => Ok(cpu::backward(&dims, spec, q, k, v, o, lse, d_o, d_lse, false)?.0),
        _ => {
            generic::backward(q, k, v, o, lse, d_o, d_lse, spec, dims, TileSize::for_call(&dims, q.dtype(), q.device()))
        }
    }
}

/// Attention as a tape op: inputs `q: [b, nq, h, d]`, `k, v: [b, nk, h_kv, d]`; outputs `o: [b, nq, h, d]`
/// and `lse: [b, h, nq]`. Kind attention; saves q, k, v, o and lse; backward in the FlashAttention-2 manner.
#[derive(Debug)]
pub struct AttentionOp {
    /// Mask, scale and position offsets.
    pub spec: AttentionSpec,
}

impl Op for AttentionOp {
    fn name(&self) -> &'static str {
        "attention"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Attention
    }
    fn forward(&self, i: &[&Tensor]) -> autosp_core::Result<Vec<Tensor>> {
        let (o, lse) = attention_forward(i[0], i[1], i[2], &self.spec)?;
        Ok(vec![o, lse])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1, 2]).and_outputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> autosp_core::Result<Vec<Option<Tensor>>> {
        let o = s.output(0)?;
        let d_o = match &g[0] {
            Some(d) => d.clone(),
            None => o.zeros_like()?,
        };
        let (dq, dk, dv) = attention_backward(
            s.input(0)?,
            s.input(1)?,
            s.input(2)?,
            o,
            s.output(1)?,
            &d_o,
            g[1].as_ref(),
            &self.spec,
        )?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    }
}

/// Attention on the tape: `q: [b, nq, h, d]`, `k, v: [b, nk, h_kv, d]` -> `(o: [b, nq, h, d], lse: [b, h, nq])`.
pub fn attention(
    tape: &Tape,
    q: &Value,
    k: &Value,
    v: &Value,
    spec: AttentionSpec,
) -> autosp_core::Result<(Value, Value)> {
    apply_attention(tape, Arc::new(AttentionOp { spec }), q, k, v)
}

/// Attention of the tensors a rank holds, with no communication: the default of every attention slot (the
/// CPU flash kernel on the CPU, the device-generic kernel elsewhere), and the inner attention of Ulysses.
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalAttention;

impl Attention for LocalAttention {
    fn describe(&self) -> String {
        "local".into()
    }

    fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        attention(tape, q, k, v, spec.clone())
    }

    fn as_op(&self, spec: &AttentionSpec) -> Option<Arc<dyn Op>> {
        Some(Arc::new(AttentionOp { spec: spec.clone() }))
    }

    /// The output of [`forward`](Attention::forward), recorded on the tape, when the tape records a gradient
    /// through q, k or v (training, any device). Otherwise (inference) the untracked output of
    /// [`attention_output`]: the same kernels, and candle-flash-attn for CUDA inputs it takes.
    fn forward_output(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<Value> {
        if tape.is_recording() && [q, k, v].iter().any(|x| x.is_tracked()) {
            return Ok(self.forward(tape, q, k, v, spec)?.0);
        }
        autosp_core::alloc::phase("forward", "attention");
        Ok(Value::constant(attention_output(q.tensor(), k.tensor(), v.tensor(), spec)?))
    }
}

/// Test hooks: the CPU flash kernel (CPU tensors, head_dim up to [`CPU_MAX_HEAD_DIM`], whatever the dispatch
/// says) with every output and internal buffer pre-filled with NaN, so a test can check that every element is
/// written before it is read or returned. Not part of the stable API.
#[doc(hidden)]
pub mod poisoned {
    use super::*;

    /// The CPU forward with NaN-filled buffers: `(o, lse)`.
    pub fn cpu_forward(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<(Tensor, Tensor)> {
        Ok(checked_cpu_forward(q, k, v, spec, true)?.0)
    }

    /// The CPU backward with NaN-filled buffers: `(dq, dk, dv)`.
    #[allow(clippy::too_many_arguments)]
    pub fn cpu_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        lse: &Tensor,
        d_o: &Tensor,
        d_lse: Option<&Tensor>,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Ok(checked_cpu_backward([q, k, v, o, lse, d_o], d_lse, spec, true)?.0)
    }
}

/// Test hooks: the CPU flash kernel with the number of (query tile, key tile) products it computed, summed
/// over batch and query heads, so a test can check that the tiles a causal mask or a sliding window hides
/// entirely are never computed. Not part of the stable API.
#[doc(hidden)]
pub mod counted {
    use super::*;

    /// Query rows and key rows per tile.
    pub const TILE: (usize, usize) = cpu::TILE;

    /// The CPU forward: `(o, lse, tile products computed)`.
    pub fn cpu_forward(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<(Tensor, Tensor, usize)> {
        let ((o, lse), n) = checked_cpu_forward(q, k, v, spec, false)?;
        Ok((o, lse, n))
    }

    /// The CPU backward: `(dq, dk, dv, tile products computed)`.
    #[allow(clippy::too_many_arguments)]
    pub fn cpu_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        lse: &Tensor,
        d_o: &Tensor,
        d_lse: Option<&Tensor>,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor, usize)> {
        let ((dq, dk, dv), n) = checked_cpu_backward([q, k, v, o, lse, d_o], d_lse, spec, false)?;
        Ok((dq, dk, dv, n))
    }
}

/// The CPU kernel's forward behind the checks, whatever the dispatch says (the test hooks above).
fn checked_cpu_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    poison: bool,
) -> Result<((Tensor, Tensor), usize)> {
    let dims = check(FWD, q, k, v, spec, CPU_MAX_HEAD_DIM)?;
    cpu::forward(&dims, spec, q, k, v, poison)
}

/// The CPU kernel's backward behind the checks, whatever the dispatch says (the test hooks above).
fn checked_cpu_backward(
    [q, k, v, o, lse, d_o]: [&Tensor; 6],
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
    poison: bool,
) -> Result<((Tensor, Tensor, Tensor), usize)> {
    let dims = check(BWD, q, k, v, spec, CPU_MAX_HEAD_DIM)?;
    check_backward(q, o, lse, d_o, d_lse, &dims)?;
    cpu::backward(&dims, spec, q, k, v, o, lse, d_o, d_lse, poison)
}

/// The device-generic kernel with `block` query rows per block (at least 1) and `KEY_BLOCKS · block` keys per
/// chunk ([`TileSize::from_block`]), on any device whatever the
/// dispatch says: tests run many blocks, masked and merged chunks on small shapes, and benchmarks time the
/// generic kernel on the CPU. Not part of the stable API.
#[doc(hidden)]
pub fn generic_forward_with_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    block: usize,
) -> Result<(Tensor, Tensor)> {
    let dims = check(FWD, q, k, v, spec, usize::MAX)?;
    generic::forward(q, k, v, spec, dims, TileSize::from_block(block))
}

/// [`generic_forward_with_block`]'s backward. Not part of the stable API.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn generic_backward_with_block(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
    block: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = check(BWD, q, k, v, spec, usize::MAX)?;
    check_backward(q, o, lse, d_o, d_lse, &dims)?;
    generic::backward(q, k, v, o, lse, d_o, d_lse, spec, dims, TileSize::from_block(block))
}

/// Shape, head_dim (`1..=max_head_dim`), dtype and device checks of `q, k, v`, shared by every kernel.
fn check(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    max_head_dim: usize,
) -> Result<AttentionDims> {
    let dims = spec.dims(op, q, k, v)?;
    if dims.head_dim == 0 || dims.head_dim > max_head_dim {
        return Err(Error::HeadDim { op, head_dim: dims.head_dim, max: max_head_dim, q_shape: q.dims().to_vec() });
    }
    for (name, t) in [("k", k), ("v", v)] {
        same_dtype(op, name, t, q.dtype())?;
        same_device(op, name, t, q)?;
    }
    Precision::of(op, q.dtype())?;
    Ok(dims)
}

/// The backward's checks of `o, d_o` (q's shape, dtype and device) and `lse, d_lse` (`[batch, heads, q_len]`,
/// f32 or f64 whatever q's dtype, q's device), shared by every kernel.
fn check_backward(
    q: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    dims: &AttentionDims,
) -> Result<()> {
    for (name, t) in [("o", o), ("d_o", d_o)] {
        check_shape(BWD, name, t, q.dims(), q)?;
        same_dtype(BWD, name, t, q.dtype())?;
        same_device(BWD, name, t, q)?;
    }
    for (name, t) in [("lse", Some(lse)), ("d_lse", d_lse)] {
        if let Some(t) = t {
            check_shape(BWD, name, t, &[dims.batch, dims.heads, dims.q_len], q)?;
            same_device(BWD, name, t, q)?;
            Precision::of(BWD, t.dtype())?;
        }
    }
    Ok(())
}

fn same_dtype(op: &'static str, name: &'static str, t: &Tensor, want: DType) -> Result<()> {
    if t.dtype() != want {
        return Err(Error::DTypeMismatch { op, name, got: t.dtype(), want });
    }
    Ok(())
}

/// [`Error::DeviceMismatch`] unless `t` (called `name`) is on q's device.
fn same_device(op: &'static str, name: &'static str, t: &Tensor, q: &Tensor) -> Result<()> {
    if !t.device().same_device(q.device()) {
        return Err(Error::DeviceMismatch {
            op,
            name,
            got: format!("{:?}", t.device().location()),
            want: format!("{:?}", q.device().location()),
        });
    }
    Ok(())
}

fn check_shape(op: &'static str, name: &'static str, t: &Tensor, want: &[usize], q: &Tensor) -> Result<()> {
    if t.dims() != want {
        return Err(Error::Shape { op, name, got: t.dims().to_vec(), want: want.to_vec(), q_shape: q.dims().to_vec() });
    }
    Ok(())
}
