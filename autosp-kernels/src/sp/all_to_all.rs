//! The all-to-all exchange as a tape op (kind `Collective`): rank r sends `x.narrow(split_dim, ranges[j])` to
//! every rank j and concatenates what it receives along `cat_dim` in rank order. Ulysses uses it to turn
//! `[N/P tokens, H heads]` into `[N tokens, H/P heads]` and back.
//!
//! - Overlapping ranges replicate: kv heads when `kv_heads < P` (rank j gets kv head ⌊j·H_kv/P⌋).
//! - Two halves (the hybrid zigzag layout): with `split_halves`, `split_dim` is read as two halves and the
//!   piece for rank j is `[range_j of half 0 ; range_j of half 1]`; with `cat_halves`, each received piece is
//!   two halves along `cat_dim`, gathered as `[first halves in rank order ; second halves in rank order]`.
//! - Backward is the inverse exchange of the gradient pieces (one `all_to_all`); the gradients of overlapping
//!   ranges are summed in rank order 0, 1, …, P-1, so the result is deterministic.
//!
//! Communication: one `all_to_all` forward and one backward. Bytes rank r sends, `s` bytes per element:
//! forward `Σ_{j≠r} elems(piece_j)·s`; backward the same pieces' gradients, i.e. the same bytes. With every
//! rank's pieces equal (what Ulysses produces), that is `(P-1)·elems(piece)·s` each way.
//! All pieces a rank receives must have one shape (equal shards); otherwise [`SpError::UnequalPieces`].

use std::ops::Range;
use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::{NodeKind, Op, SavedTensors, Tape, Value};
use candle_core::{Shape, Tensor};

use super::error::SpError;

/// Where each destination's piece comes from and how received pieces are put together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllToAllPlan {
    /// The dim the pieces are cut from.
    pub split_dim: usize,
    /// `ranges[j]`: the part of `split_dim` sent to rank j (within one half when `split_halves`); may overlap.
    pub ranges: Vec<Range<usize>>,
    /// Read `split_dim` as two halves and send `range_j` of each (see the module doc).
    pub split_halves: bool,
    /// The dim received pieces are concatenated along, in rank order.
    pub cat_dim: usize,
    /// Each received piece is two halves along `cat_dim`: gather all first halves, then all second halves.
    pub cat_halves: bool,
}

/// `p` equal, disjoint, ordered ranges covering `0..len`; [`SpError::UnevenShards`] unless `p` divides `len`.
pub fn even_ranges(what: &'static str, len: usize, p: usize) -> Result<Vec<Range<usize>>, SpError> {
    if p == 0 || !len.is_multiple_of(p) {
        return Err(SpError::UnevenShards { what, len, parts: p.max(1) });
    }
    let s = len / p;
    Ok((0..p).map(|j| j * s..(j + 1) * s).collect())
}

/// The first half of [`exchange_back`]: `dy` cut into the pieces each source rank sent and sent back; entry j
/// is the gradient of the piece this rank sent to rank j (cut by `plan.ranges[j]`, from each half when
/// `plan.split_halves`).
pub fn return_pieces(
    group: &Arc<dyn ProcessGroup>,
    dy: &Tensor,
    plan: &AllToAllPlan,
) -> autosp_core::Result<Vec<Tensor>> {
    let p = group.size();
    let piece = dy.dim(plan.cat_dim)? / p;
    let back: Vec<Tensor> = if plan.cat_halves {
        let h = piece / 2;
        (0..p).map(|i| cut(dy, plan.cat_dim, &(i * h..(i + 1) * h), Some(p * h))).collect::<candle_core::Result<_>>()?
    } else {
        (0..p).map(|i| dy.narrow(plan.cat_dim, i * piece, piece)).collect::<candle_core::Result<_>>()?
    };
    Ok(group.all_to_all(back)?)
}

/// The all-to-all tape op: input `x`, output the gathered tensor (see the module doc for shapes).
#[derive(Debug)]
pub struct AllToAllOp {
    /// The ranks that exchange.
    pub group: Arc<dyn ProcessGroup>,
    /// Cutting and gathering.
    pub plan: AllToAllPlan,
    /// What the exchange is for, in errors (e.g. `ulysses q`).
    pub what: &'static str,
}

/// Length of one half of `dim` of `x`, or an error when it is odd.
fn half(what: &'static str, x: &Tensor, dim: usize) -> autosp_core::Result<usize> {
    let len = x.dim(dim)?;
    if len % 2 != 0 {
        return Err(SpError::UnevenShards { what, len, parts: 2 }.into());
    }
    Ok(len / 2)
}

/// The piece `range` of `x` along `dim`, from each half when `halves`.
fn cut(x: &Tensor, dim: usize, range: &Range<usize>, halves: Option<usize>) -> candle_core::Result<Tensor> {
    match halves {
        None => x.narrow(dim, range.start, range.len()),
        Some(h) => {
            Tensor::cat(&[x.narrow(dim, range.start, range.len())?, x.narrow(dim, h + range.start, range.len())?], dim)
        }
    }
}

/// Concatenation of `pieces` along `dim`, halves first when `halves`.
fn join(pieces: &[Tensor], dim: usize, halves: bool, what: &'static str) -> autosp_core::Result<Tensor> {
    if !halves {
        return Ok(Tensor::cat(pieces, dim)?);
    }
    let h = half(what, &pieces[0], dim)?;
    let mut parts: Vec<Tensor> = pieces.iter().map(|p| p.narrow(dim, 0, h)).collect::<candle_core::Result<_>>()?;
    for p in pieces {
        parts.push(p.narrow(dim, h, h)?);
    }
    Ok(Tensor::cat(&parts, dim)?)
}

fn check_ranges(plan: &AllToAllPlan, p: usize, span: usize, what: &'static str) -> autosp_core::Result<()> {
    if plan.ranges.len() != p || plan.ranges.iter().any(|r| r.end > span || r.is_empty()) {
        return Err(SpError::Config {
            what,
            msg: format!(
                "all-to-all ranges {:?} must be {p} non-empty ranges within 0..{span} (dim {})",
                plan.ranges, plan.split_dim
            ),
        }
        .into());
    }
    Ok(())
}

/// Whether the ranges are disjoint and cover `0..span` in rank order (then the inverse is a plain concat).
fn is_ordered_cover(plan: &AllToAllPlan, span: usize) -> bool {
    let mut at = 0;
    for r in &plan.ranges {
        if r.start != at {
            return false;
        }
        at = r.end;
    }
    at == span
}

impl Op for AllToAllOp {
    fn name(&self) -> &'static str {
        "all_to_all"
    }

    fn kind(&self) -> NodeKind {
        NodeKind::Collective
    }

    fn forward(&self, inputs: &[&Tensor]) -> autosp_core::Result<Vec<Tensor>> {
        Ok(vec![exchange(&self.group, inputs[0], &self.plan, self.what)?])
    }

    fn backward(&self, saved: &SavedTensors<'_>, grads: &[Option<Tensor>]) -> autosp_core::Result<Vec<Option<Tensor>>> {
        let Some(dy) = &grads[0] else { return Ok(vec![None]) };
        Ok(vec![Some(exchange_back(&self.group, dy, &self.plan, saved.input_shape(0), self.what)?)])
    }
}

/// The all-to-all exchange of `x` over `group` as `plan` says (the forward of [`AllToAllOp`]); `what` names it
/// in errors.
pub fn exchange(
    group: &Arc<dyn ProcessGroup>,
    x: &Tensor,
    plan: &AllToAllPlan,
    what: &'static str,
) -> autosp_core::Result<Tensor> {
    let halves = if plan.split_halves { Some(half(what, x, plan.split_dim)?) } else { None };
    check_ranges(plan, group.size(), halves.unwrap_or(x.dim(plan.split_dim)?), what)?;
    let pieces =
        plan.ranges.iter().map(|r| cut(x, plan.split_dim, r, halves)).collect::<candle_core::Result<Vec<_>>>()?;
    let got = group.all_to_all(pieces)?;
    for (rank, t) in got.iter().enumerate() {
        if t.dims() != got[0].dims() {
            return Err(
                SpError::UnequalPieces { what, rank, got: t.dims().to_vec(), want: got[0].dims().to_vec() }.into()
            );
        }
    }
    join(&got, plan.cat_dim, plan.cat_halves, what)
}

/// The inverse exchange (the backward of [`AllToAllOp`]): `dy`, shaped like [`exchange`]'s output, goes back
/// to the ranks its pieces came from and lands where they were cut from an input of shape `input`;
/// overlapping ranges sum in rank order.
pub fn exchange_back(
    group: &Arc<dyn ProcessGroup>,
    dy: &Tensor,
    plan: &AllToAllPlan,
    input: &Shape,
    what: &'static str,
) -> autosp_core::Result<Tensor> {
    let got = return_pieces(group, dy, plan)?;
    // got[j]: the gradient of the piece this rank sent to rank j; place it where that piece came from.
    let len = input.dims()[plan.split_dim];
    let span = if plan.split_halves { len / 2 } else { len };
    if is_ordered_cover(plan, span) {
        return join(&got, plan.split_dim, plan.split_halves, what);
    }
    let d = plan.split_dim;
    let mut dx = Tensor::zeros(input, dy.dtype(), dy.device())?;
    for (g, r) in got.iter().zip(&plan.ranges) {
        if plan.split_halves {
            let k = r.len();
            let first = g.narrow(d, 0, k)?.pad_with_zeros(d, r.start, len - r.end)?;
            let second = g.narrow(d, k, k)?.pad_with_zeros(d, span + r.start, span - r.end)?;
            dx = ((dx + first)? + second)?;
        } else {
            dx = (dx + g.pad_with_zeros(d, r.start, len - r.end)?)?;
        }
    }
    Ok(dx)
}

/// Records an all-to-all of `x` over `group` on `tape` (see [`AllToAllOp`]); `what` names it in errors.
pub fn all_to_all(
    tape: &Tape,
    group: &Arc<dyn ProcessGroup>,
    x: &Value,
    plan: AllToAllPlan,
    what: &'static str,
) -> autosp_core::Result<Value> {
    let mut out = tape.apply(AllToAllOp { group: group.clone(), plan, what }, &[x])?;
    Ok(out.pop().expect("one output"))
}
