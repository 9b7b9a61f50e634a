//! The CPU flash-attention kernel, forward and backward, on candle's CPU storage read in place.
//!
//! How it works:
//! - Tiles of 64 query rows × 64 keys; the online softmax of ALGORITHMS.md in the log2 domain; never an
//!   N × N buffer. Key tiles that a query tile cannot see (as [`AttentionSpec`] answers: after it under a
//!   causal mask, further than a sliding window's `max_distance`) are never visited; only tiles that cross the
//!   diagonal, a window edge or the last key are masked (`tiles.rs`).
//! - Memory: O(N·d) per head besides the outputs. Every operand of a tile product is packed, at a row stride
//!   of an odd number of cache lines (`tiles::PAD`): Kᵀ in 64-key tiles and V rows once per kv head for the
//!   forward (shared by its GQA group), and each forward task's query rows; for the backward each key tile is
//!   packed by the one task that owns it, and Q, dO rows once per query head. Packing is 4-6% of the forward and
//!   avoids the `heads · d` row stride (and any multiple of 256 B), which maps a tile's rows onto a few of
//!   the 64 L1 sets. Every packed buffer starts on a cache line and the large ones are advised for huge
//!   pages (`buffer.rs`). dQ is accumulated in packed partials, one per (query head, chunk of key tiles) of a
//!   wave, and added into the output in chunk order; when batch × kv_heads < 8 the key tiles are split into
//!   chunks. Non-contiguous tensors are made contiguous first. While a tile runs, the rows the task reads
//!   next (the forward's next key tile, the backward's next query tile) are prefetched into L2
//!   (`prefetch.rs`, x86-64).
//! - Accumulation in f32 (f64 for f64 inputs; [`Precision`]); bf16/f16 inputs are converted to f32 once and
//!   the outputs converted back (lse stays f32).
//! - Threads: rayon over (batch, head, group of up to 8 query tiles, by bytes) forward and (batch, kv head,
//!   chunk of key tiles) backward; a backward task runs its key tiles in groups of 1-4 (by bytes). Grouping
//!   lets one fetch of a key tile (forward) or of a query tile's Q, dO rows (backward) serve several tile
//!   products.
//!   Backward is FlashAttention-2's from the saved `o` and `lse`; each task owns its outputs (dK/dV rows of its
//!   key tiles, summed over the GQA group in order; its own dQ partials) and the dQ partials are summed in a
//!   fixed order, so two runs give the same bits whatever the scheduling or thread count.
//! - The tile products run through one register-blocked micro-kernel on the vector path in force
//!   ([`crate::vector::Real::gemm`]: AVX-512 with a 6 × 64 block of C in 24 registers, AVX2+FMA with 6 × 16 in
//!   12, NEON with 8 × 12 in 24, a portable loop for the scalar path and for f64). Measured against calling
//!   the `gemm` crate (0.19, candle's) per tile, one thread, L1-resident 64 × 64 × 64 f32 tiles: the AVX-512
//!   kernel ~240 GFLOP/s (near the Zen 5 core's FMA peak), `gemm::gemm` ~115 GFLOP/s (its packing and
//!   dispatch dominate at this size). The exponential is a vectorised `exp2` (about 1 ulp).
//! - NaN propagates: a NaN in a query (key) row makes that row (every row that sees that key) NaN in `o` and
//!   `lse`, on every vector path and the scalar one alike (`tests/flash_nan.rs`).
//!
//! Measured numbers and the commands behind them: docs/BENCHMARKS.md, "Flash attention (CPU)".

mod backward;
mod buffer;
mod forward;
mod prefetch;
mod tiles;

use autosp_core::ops::attention::{AttentionDims, AttentionSpec};
use autosp_core::Precision;
use candle_core::{DType, Tensor};

use crate::host::{tensor_from, Host};
use crate::vector::Real;
use crate::Result;
use backward::BackwardInputs;
use tiles::Geometry;

/// Query rows and key rows per tile.
pub(crate) const TILE: (usize, usize) = (tiles::BR, tiles::BC);

const FWD: &str = "attention_forward (CPU)";
const BWD: &str = "attention_backward (CPU)";

/// `t` in `dtype`, contiguous (no copy when it already is both).
fn prepared(t: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(t.to_dtype(dtype)?.contiguous()?)
}

/// The forward of checked inputs (`dims` from the door's checks): `((o, lse), tile products computed)`.
/// `poison` pre-fills every output and internal buffer with NaN (the tests' check that every element is
/// written before it is read or returned).
pub(crate) fn forward(
    dims: &AttentionDims,
    spec: &AttentionSpec,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    poison: bool,
) -> Result<((Tensor, Tensor), usize)> {
    let g = Geometry::new(dims, spec);
    let cd = Precision::float(q.dtype()).compute();
    let (q2, k2, v2) = (prepared(q, cd)?, prepared(k, cd)?, prepared(v, cd)?);
    let ((o, lse), n) = match cd {
        DType::F64 => forward_typed::<f64>(&g, &q2, &k2, &v2, if poison { f64::NAN } else { 0.0 })?,
        _ => forward_typed::<f32>(&g, &q2, &k2, &v2, if poison { f32::NAN } else { 0.0 })?,
    };
    Ok(((o.to_dtype(q.dtype())?, lse), n))
}

fn forward_typed<T: Real>(
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
    Ok(((tensor_from(o, q.shape())?, tensor_from(lse, (g.b, g.h, g.nq))?), n))
}

/// The backward of checked inputs: `((dq, dk, dv), tile products computed)`; `poison` as in [`forward`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dims: &AttentionDims,
    spec: &AttentionSpec,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    poison: bool,
) -> Result<((Tensor, Tensor, Tensor), usize)> {
    let g = Geometry::new(dims, spec);
    let cd = Precision::float(q.dtype()).compute();
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

fn backward_typed<T: Real>(
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
    Ok(((tensor_from(dq, q.shape())?, tensor_from(dk, k.shape())?, tensor_from(dv, v.shape())?), n))
}
