//! Flash attention on the CPU, forward and backward, as plain functions on candle tensors (no tape), so any
//! candle program can call them.
//!
//! Layout (autosp's, see `autosp_core::ops::attention`): `q: [batch, q_len, heads, head_dim]`,
//! `k, v: [batch, k_len, kv_heads, head_dim]`, `o` like `q`, `lse: [batch, heads, q_len]` (natural log, f32;
//! f64 for f64 inputs). Query head `h` reads kv head `h / (heads / kv_heads)` (GQA/MQA) straight from `k, v`:
//! repeated K/V are never materialised. Masks, scale and position offsets come from [`AttentionSpec`]; a row
//! that sees no key gets `lse = -inf` and `o = 0`.
//!
//! How it works:
//! - Tiles of 64 query rows × 64 keys; the online softmax of ALGORITHMS.md in the log2 domain; never an
//!   N × N buffer. Key tiles that a query tile cannot see (after it under a causal mask, further than a
//!   sliding window's `max_distance`) are never visited; only tiles that cross the diagonal, a window edge or
//!   the last key are masked.
//! - Memory: O(N·d) per head besides the outputs. The inputs are read in their `[b, n, h, d]` layout where
//!   they are the broadcast (A) operand of a tile product; where they are the streamed (B) operand they are
//!   packed: Kᵀ in 64-key tiles and V rows contiguous once per kv head for the forward (shared by its GQA
//!   group); for the backward each key tile is packed by the one task that owns it, and Q, dO rows once per
//!   query head. Packing is ~2% of the time and avoids the `heads · d` row stride, which maps a tile's rows
//!   onto 8 of the 64 L1 sets. dQ goes straight into the output when each kv head is one backward task;
//!   when batch × kv_heads < 16 the key tiles are split into chunks and each (query head, chunk) keeps a dQ
//!   partial. Non-contiguous tensors are made contiguous first.
//! - Accumulation in f32 (f64 for f64 inputs); bf16/f16 inputs are converted to f32 once and the outputs
//!   converted back (lse stays f32).
//! - Threads: rayon over (batch, head, query tile) forward and (batch, kv head, chunk of key tiles) backward.
//!   Backward is FlashAttention-2's from the saved `o` and `lse`; each task owns its outputs (dK/dV rows of its
//!   key tiles, summed over the GQA group in order; its own dQ partials) and the dQ partials are summed in a
//!   fixed order, so two runs give the same bits whatever the scheduling or thread count.
//! - The tile products run through one register-blocked micro-kernel (`microkernel.rs`) on the vector path
//!   in force ([`crate::simd`]: `AUTOSP_SIMD`, else the best the CPU has, detected at run time): AVX-512 with
//!   a 6 × 64 block of C in 24 registers (hand-written intrinsics), AVX2+FMA with a 6 × 16 block in 12
//!   registers and NEON with 8 × 12 in 24 (one generic source over `pulp`, `crate::vector`), a portable
//!   loop for the scalar path and for f64. Measured against calling the `gemm` crate (0.19, candle's) per
//!   tile, one thread, L1-resident 64 × 64 × 64 f32 tiles, best of 20 × 500 calls: the AVX-512 kernel ~240
//!   GFLOP/s (near the Zen 5 core's FMA peak), `gemm::gemm` ~115 GFLOP/s (its packing and dispatch dominate
//!   at this size). Every head_dim that is a multiple of 16 (64 and 128 in particular) runs in whole vectors;
//!   others use masked tail vectors (AVX-512) or scalar tail columns (pulp paths). The exponential is a
//!   vectorised `exp2` (degree-6 polynomial, then `vscalefps` on AVX-512 or the exponent bits on the pulp
//!   paths; about 1 ulp).
//! - NaN propagates: a NaN in a query (key) row makes that row (every row that sees that key) NaN in `o` and
//!   `lse`, on every vector path and the scalar one alike (`tests/flash_nan.rs`).
//! - Speed (2-core Zen 5, batch 1, 8 heads, head_dim 64, causal, f32, both cores free): forward+backward
//!   0.71 s at N = 8192 (PyTorch SDPA, the reference: 0.88 s) and 0.21 s at N = 4096 (0.24 s);
//!   forward 0.21 s (0.25 s) and 0.063 s (0.069 s). 150 – 180 GFLOP per CPU-second with the FLOP
//!   convention.
//!
//! Measured numbers and the command that produced them: docs/BENCHMARKS.md, "Flash attention (CPU)".
//!
//! Other devices: the public functions here are the one place that picks the kernel (`device.rs`): this
//! fast CPU kernel for CPU tensors, the device-generic kernel of [`crate::generic::attention`] (candle tensor
//! ops: CUDA, Metal, or the CPU when `AUTOSP_KERNELS=generic` forces it, or for a head_dim above
//! [`MAX_HEAD_DIM`]) everywhere else, with the same contract, LSE and backward included. With feature
//! `flash-attn`, [`flash_attention_output`] on CUDA runs candle-flash-attn when it takes the inputs
//! (`cuda.rs`, `cuda_plan.rs`).

mod backward;
#[cfg(feature = "flash-attn")]
mod cuda;
#[cfg(any(feature = "flash-attn", test))]
mod cuda_plan;
mod device;
mod forward;
mod geometry;
pub(crate) mod microkernel;
mod real;

use autosp_core::ops::attention::{AttentionDims, AttentionSpec};
use candle_core::{DType, Device, Storage, StorageRef, Tensor, WithDType};

use crate::generic::attention as generic;
use crate::{Error, Result};
use backward::BackwardInputs;
use device::Backend;
use geometry::Geometry;
use real::Real;

/// The largest head dimension the fast CPU kernel takes; the public functions run larger ones on the
/// device-generic kernel.
pub const MAX_HEAD_DIM: usize = 256;

/// Flash attention forward. `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`
/// (one dtype: f32, f64, bf16 or f16; one device). Returns `(o: [batch, q_len, heads, head_dim]` in q's dtype,
/// `lse: [batch, heads, q_len]` in f32 (f64 for f64 inputs)`)`, on q's device. CPU tensors run the fast CPU
/// kernel, other devices (or a forced generic path) [`generic::attention_forward`].
pub fn flash_attention_forward(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<(Tensor, Tensor)> {
    match device::backend(FWD, q, k, v)? {
        Backend::FastCpu => Ok(forward_with_fill(q, k, v, spec, false)?.0),
        _ => generic::attention_forward(q, k, v, spec),
    }
}

/// Attention output only, for inference: `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len,
/// kv_heads, head_dim]`; returns `o: [batch, q_len, heads, head_dim]` in q's dtype on q's device: the output
/// of [`flash_attention_forward`]. With feature `flash-attn`, CUDA inputs that candle-flash-attn takes (f16/bf16,
/// head_dim a multiple of 8 up to 512, the masks `cuda_plan.rs` lists: plain causal, KV-cache decoding,
/// unmasked, and their sliding windows) run it; other CUDA inputs run the generic kernel.
pub fn flash_attention_output(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<Tensor> {
    match device::output_backend(OUT, q, k, v, spec)? {
        Backend::FastCpu => Ok(forward_with_fill(q, k, v, spec, false)?.0 .0),
        Backend::Generic => Ok(generic::attention_forward(q, k, v, spec)?.0),
        #[cfg(feature = "flash-attn")]
        Backend::FlashAttn(mask) => {
            check(OUT, q, k, v, spec, cuda_plan::CUDA_MAX_HEAD_DIM)?;
            cuda::forward_output(q, k, v, spec, mask)
        }
    }
}

/// Flash attention backward from the forward's saved `o` and `lse`. `d_o: [batch, q_len, heads, head_dim]` is
/// the gradient of `o`; `d_lse: [batch, heads, q_len]`, when given, the gradient of `lse` (it adds
/// `P ∘ d_lse` to dS; Ring attention's merge needs it). Returns `(dq, dk, dv)` shaped and typed like
/// `q, k, v`; the dk/dv of a kv head sum its query-head group. CPU tensors run the fast CPU kernel, other
/// devices (or a forced generic path) [`generic::attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    match device::backend(BWD, q, k, v)? {
        Backend::FastCpu => Ok(backward_with_fill(q, k, v, o, lse, d_o, d_lse, spec, false)?.0),
        _ => generic::attention_backward(q, k, v, o, lse, d_o, d_lse, spec),
    }
}

/// Test hooks: the same kernels with every output and internal buffer pre-filled with NaN, so a test can
/// check that every element is written before it is read or returned. Not part of the stable API.
#[doc(hidden)]
pub mod poisoned {
    use super::*;

    /// [`flash_attention_forward`] with NaN-filled buffers.
    pub fn flash_attention_forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)> {
        Ok(forward_with_fill(q, k, v, spec, true)?.0)
    }

    /// [`flash_attention_backward`] with NaN-filled buffers.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        lse: &Tensor,
        d_o: &Tensor,
        d_lse: Option<&Tensor>,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        Ok(backward_with_fill(q, k, v, o, lse, d_o, d_lse, spec, true)?.0)
    }
}

/// Test hooks: the fast CPU kernels (CPU tensors only, whatever the dispatch says) with the number of
/// (query tile, key tile) products they computed, summed over batch and query heads, so a test can check that
/// the tiles a causal mask or a sliding window hides entirely are never computed. Not part of the stable API.
#[doc(hidden)]
pub mod counted {
    use super::*;

    /// Query rows and key rows per tile.
    pub const TILE: (usize, usize) = (geometry::BR, geometry::BC);

    /// The fast CPU forward: `(o, lse, tile products computed)`.
    pub fn flash_attention_forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, usize)> {
        let ((o, lse), n) = forward_with_fill(q, k, v, spec, false)?;
        Ok((o, lse, n))
    }

    /// The fast CPU backward: `(dq, dk, dv, tile products computed)`.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        lse: &Tensor,
        d_o: &Tensor,
        d_lse: Option<&Tensor>,
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor, usize)> {
        let ((dq, dk, dv), n) = backward_with_fill(q, k, v, o, lse, d_o, d_lse, spec, false)?;
        Ok((dq, dk, dv, n))
    }
}

const FWD: &str = "flash_attention_forward";
const OUT: &str = "flash_attention_output";
const BWD: &str = "flash_attention_backward";

/// Shape, head_dim (`1..=max_head_dim`), dtype and device checks of `q, k, v`, shared by every kernel.
pub(crate) fn check(
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
    }
    device::same_device(op, q, k, v)?;
    compute_dtype(op, q.dtype())?;
    Ok(dims)
}

/// The backward's checks of `o, d_o` (q's shape, dtype and device) and `lse, d_lse` (`[batch, heads, q_len]`,
/// f32 or f64 whatever q's dtype, q's device), shared by every kernel.
pub(crate) fn check_backward(
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
        device::check_device(BWD, name, t, q)?;
    }
    for (name, t) in [("lse", Some(lse)), ("d_lse", d_lse)] {
        if let Some(t) = t {
            check_shape(BWD, name, t, &[dims.batch, dims.heads, dims.q_len], q)?;
            device::check_device(BWD, name, t, q)?;
            compute_dtype(BWD, t.dtype())?;
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

fn check_shape(op: &'static str, name: &'static str, t: &Tensor, want: &[usize], q: &Tensor) -> Result<()> {
    if t.dims() != want {
        return Err(Error::Shape { op, name, got: t.dims().to_vec(), want: want.to_vec(), q_shape: q.dims().to_vec() });
    }
    Ok(())
}

/// The compute dtype (f64 or f32) of an input dtype, or an error for a dtype the kernel does not take.
pub(crate) fn compute_dtype(op: &'static str, dtype: DType) -> Result<DType> {
    match dtype {
        DType::F64 => Ok(DType::F64),
        DType::F32 | DType::BF16 | DType::F16 => Ok(DType::F32),
        dtype => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// `t` in `dtype`, contiguous (no copy when it already is both).
fn prepared(t: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(t.to_dtype(dtype)?.contiguous()?)
}

/// A contiguous CPU tensor's storage, read-locked for as long as the kernel reads it.
struct Host<'a> {
    guard: StorageRef<'a>,
    start: usize,
    end: usize,
}

impl<'a> Host<'a> {
    fn new(op: &'static str, name: &'static str, t: &'a Tensor) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        if !matches!(&*guard, Storage::Cpu(_)) {
            return Err(Error::NotCpu { op, name, device: format!("{:?}", t.device().location()) });
        }
        let (start, end) = layout.contiguous_offsets().expect("prepared() makes tensors contiguous");
        Ok(Self { guard, start, end })
    }

    fn slice<T: WithDType>(&self) -> Result<&[T]> {
        match &*self.guard {
            Storage::Cpu(cpu) => Ok(&cpu.as_slice::<T>()?[self.start..self.end]),
            _ => unreachable!("Host::new checked the device"),
        }
    }
}

fn forward_with_fill(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    poison: bool,
) -> Result<((Tensor, Tensor), usize)> {
    let dims = check(FWD, q, k, v, spec, MAX_HEAD_DIM)?;
    let g = Geometry::new(&dims, spec);
    let cd = compute_dtype(FWD, q.dtype())?;
    let (q2, k2, v2) = (prepared(q, cd)?, prepared(k, cd)?, prepared(v, cd)?);
    let ((o, lse), n) = match cd {
        DType::F64 => forward_typed::<f64>(&g, &q2, &k2, &v2, if poison { f64::NAN } else { 0.0 })?,
        _ => forward_typed::<f32>(&g, &q2, &k2, &v2, if poison { f32::NAN } else { 0.0 })?,
    };
    Ok(((o.to_dtype(q.dtype())?, lse), n))
}

fn forward_typed<T: Real + WithDType>(
    g: &Geometry,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    fill: T,
) -> Result<((Tensor, Tensor), usize)> {
    let mut o = vec![fill; q.elem_count()];
    let mut lse = vec![fill; g.b * g.h * g.nq];
    let (hq, hk, hv) = (Host::new(FWD, "q", q)?, Host::new(FWD, "k", k)?, Host::new(FWD, "v", v)?);
    let n = forward::forward(g, hq.slice()?, hk.slice()?, hv.slice()?, &mut o, &mut lse);
    Ok(((Tensor::from_vec(o, q.shape(), &Device::Cpu)?, Tensor::from_vec(lse, (g.b, g.h, g.nq), &Device::Cpu)?), n))
}

#[allow(clippy::too_many_arguments)]
fn backward_with_fill(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
    poison: bool,
) -> Result<((Tensor, Tensor, Tensor), usize)> {
    let dims = check(BWD, q, k, v, spec, MAX_HEAD_DIM)?;
    check_backward(q, o, lse, d_o, d_lse, &dims)?;
    let g = Geometry::new(&dims, spec);
    let cd = compute_dtype(BWD, q.dtype())?;
    // lse and d_lse may come in f32 or f64 whatever q's dtype: they are converted to the compute dtype.
    let p = |t: &Tensor| prepared(t, cd);
    let (q2, k2, v2, o2, lse2, do2) = (p(q)?, p(k)?, p(v)?, p(o)?, p(lse)?, p(d_o)?);
    let dl2 = d_lse.map(p).transpose()?;
    let tensors = [&q2, &k2, &v2, &o2, &lse2, &do2];
    let ((dq, dk, dv), n) = match cd {
        DType::F64 => backward_typed::<f64>(&g, tensors, dl2.as_ref(), if poison { f64::NAN } else { 0.0 })?,
        _ => backward_typed::<f32>(&g, tensors, dl2.as_ref(), if poison { f32::NAN } else { 0.0 })?,
    };
    Ok(((dq.to_dtype(q.dtype())?, dk.to_dtype(k.dtype())?, dv.to_dtype(v.dtype())?), n))
}

fn backward_typed<T: Real + WithDType>(
    g: &Geometry,
    [q, k, v, o, lse, d_o]: [&Tensor; 6],
    d_lse: Option<&Tensor>,
    fill: T,
) -> Result<((Tensor, Tensor, Tensor), usize)> {
    let mut dq = vec![fill; q.elem_count()];
    let mut dk = vec![fill; k.elem_count()];
    let mut dv = vec![fill; v.elem_count()];
    let h = |name, t| Host::new(BWD, name, t);
    let (hq, hk, hv, ho, hl, hdo) = (h("q", q)?, h("k", k)?, h("v", v)?, h("o", o)?, h("lse", lse)?, h("d_o", d_o)?);
    let hdl = d_lse.map(|t| h("d_lse", t)).transpose()?;
    let x = BackwardInputs {
        q: hq.slice()?,
        k: hk.slice()?,
        v: hv.slice()?,
        o: ho.slice()?,
        lse: hl.slice()?,
        d_o: hdo.slice()?,
        d_lse: hdl.as_ref().map(|h| h.slice()).transpose()?,
    };
    let n = backward::backward(g, &x, &mut dq, &mut dk, &mut dv, fill);
    let dev = &Device::Cpu;
    Ok((
        (
            Tensor::from_vec(dq, q.shape(), dev)?,
            Tensor::from_vec(dk, k.shape(), dev)?,
            Tensor::from_vec(dv, v.shape(), dev)?,
        ),
        n,
    ))
}
