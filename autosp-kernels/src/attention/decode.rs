//! Decode attention over a KV cache split among the ranks of a group (Meta's "pass-Q" context-parallel
//! decode): every rank holds the same new query, attends it to its own part of the cache ([`KvBlocks`]),
//! block by block, and the partial results are merged exactly by their LSE (ALGORITHMS.md, "Merging partial
//! attention over disjoint key sets"; [`RunningAttention`]). One collective per call: an all-gather of
//! each rank's partial `(o, lse)`, `heads · (head_dim + 1)` values in f32 (f64 for f64) per query row, so a
//! rank receives `P · heads · (head_dim + 1) · 4` bytes per layer per token. Every rank then merges the
//! parts in rank order, so every rank gets the same bits.

use autosp_core::comm::ProcessGroup;
use autosp_core::ops::AttentionSpec;
use candle_core::{DType, Tensor};

use super::attention_forward;
use super::kv_blocks::KvBlocks;
use crate::merge::RunningAttention;
use crate::Result;

/// Attention of `q: [1, q_len, heads, head_dim]` over every key of `part`, unmasked (every cached key is at
/// an earlier position than the query), with softmax scale `scale` (`None`: `1 / sqrt(head_dim)`): `(o: [1,
/// q_len, heads, head_dim]` in q's dtype, `lse: [1, heads, q_len]` in f32, f64 for f64`)`, or `None` when
/// `part` holds no row.
pub fn attention_over_blocks(q: &Tensor, part: &KvBlocks, scale: Option<f64>) -> Result<Option<(Tensor, Tensor)>> {
    let spec = AttentionSpec { scale, ..AttentionSpec::full() };
    let mut run: Option<RunningAttention> = None;
    for (k, v) in part.views()? {
        let (o, lse) = attention_forward(q, &k, &v, &spec)?;
        match run.as_mut() {
            None => run = Some(RunningAttention::new(&o, &lse)?),
            Some(r) => r.merge(&o, &lse)?,
        }
    }
    Ok(run.map(|r| r.finish()).transpose()?)
}

/// Decode attention over the parts of a cache that the ranks of `group` hold (see the module doc): `q: [1,
/// q_len, heads, head_dim]`, the same on every rank; `part`: this rank's part; `holds[r]`: whether rank `r`'s
/// part has a row (the callers know every rank's fill; an empty part takes no share). Returns `(o: [1, q_len,
/// heads, head_dim]` in q's dtype, `lse: [1, heads, q_len])`, the same on every rank. Collective: one
/// all-gather.
pub fn decode_attention(
    group: &dyn ProcessGroup,
    q: &Tensor,
    part: &KvBlocks,
    scale: Option<f64>,
    holds: &[bool],
) -> Result<(Tensor, Tensor)> {
    let (b, nq, h, d) = q.dims4()?;
    let acc = if q.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let mine = attention_over_blocks(q, part, scale)?;
    if group.size() == 1 {
        return mine.ok_or_else(|| empty_cache_error(holds));
    }
    // This rank's partial result as one row: o (b·nq·h·d values), then lse (b·h·nq); zeros when it holds none.
    let (o_len, lse_len) = (b * nq * h * d, b * h * nq);
    let row = match &mine {
        Some((o, lse)) => Tensor::cat(&[o.to_dtype(acc)?.flatten_all()?, lse.to_dtype(acc)?.flatten_all()?], 0)?,
        None => Tensor::zeros(o_len + lse_len, acc, q.device())?,
    };
    let all = group.all_gather(&row.unsqueeze(0)?, 0).map_err(autosp_core::Error::from)?;
    let mut run: Option<RunningAttention> = None;
    for (r, _) in holds.iter().enumerate().filter(|(_, &held)| held) {
        let row = all.get(r)?;
        let o = row.narrow(0, 0, o_len)?.reshape((b, nq, h, d))?;
        let lse = row.narrow(0, o_len, lse_len)?.reshape((b, h, nq))?;
        match run.as_mut() {
            None => run = Some(RunningAttention::new(&o, &lse)?),
            Some(m) => m.merge(&o, &lse)?,
        }
    }
    let (o, lse) = run.ok_or_else(|| empty_cache_error(holds))?.finish()?;
    Ok((o.to_dtype(q.dtype())?, lse))
}

/// The error of a decode step with no cached key on any rank (a query always sees at least itself).
fn empty_cache_error(holds: &[bool]) -> crate::Error {
    crate::Error::Core(Box::new(autosp_core::Error::InvalidArgument {
        op: "decode_attention",
        msg: format!(
            "no rank holds a cached key (parts held: {holds:?}); append the new token's key to one rank's part \
             before attending"
        ),
    }))
}
