//! Decode attention over a KV cache split among the ranks of a group (Meta's "pass-Q" context-parallel
//! decode): every rank holds the same new query, attends it to its own part of the cache ([`KvBlocks`]),
//! block by block, and the partial results are merged exactly by their LSE (ALGORITHMS.md, "Merging partial
//! attention over disjoint key sets"; [`RunningAttention`]). One collective per call: an all-gather of
//! each rank's partial `(o, lse)`, `heads · (head_dim + 1)` values in f32 (f64 for f64) per query row, and
//! one value more, whether the rank failed, so a rank receives `P · (heads · (head_dim + 1) + 1) · 4` bytes
//! per layer per token for one query row. Every rank then merges the parts in rank order, so every rank gets
//! the same bits. A sliding window is a first position: each rank attends only its rows at that position or
//! later ([`KvBlocks::views_from`]: a narrowed view per block, no copy), and a rank left with none sends
//! `lse = -inf`, which the merge weighs as nothing. A rank that fails before the collective (its part could
//! not take the new token's row, or its attention failed) still enters it, flagged, so that its peers fail
//! at once naming it rather than wait in the all-gather until the group's timeout.

use autosp_core::comm::ProcessGroup;
use candle_core::{DType, Tensor};

use super::kv_blocks::KvBlocks;
use super::route::{backend, Backend};
use crate::merge::RunningAttention;
use crate::Result;
use autosp_core::simd::simd_path;

mod cpu;

/// Attention of `q: [1, q_len, heads, head_dim]` over every key of `part` at position `first` or later
/// (0: every key; a sliding window's first visible position otherwise), unmasked past that (every cached key
/// is at an earlier position than the query), with softmax scale `scale` (`None`: `1 / sqrt(head_dim)`):
/// `(o: [1, q_len, heads, head_dim]` in q's dtype, `lse: [1, heads, q_len]` in f32, f64 for f64`)`, or
/// `None` when `part` holds no such row. On the CPU with f32 or bf16 queries and cache, the decode kernel (`decode/cpu.rs`:
/// per kv head and 256 cached rows, fused scores, softmax and `p · v` on the vector path, tasks on rayon's
/// pool); elsewhere (f64, f16, other devices, or the generic route forced) candle tensor ops, per block two
/// batched matmuls over the kv heads. Both read the cache once in place, never packed or copied (query head
/// `h` reads kv head `h / (heads / kv_heads)`), softmax in f32 (f64 for f64), blocks merged by LSE.
pub fn attention_over_blocks(
    q: &Tensor,
    part: &KvBlocks,
    scale: Option<f64>,
    first: usize,
) -> Result<Option<(Tensor, Tensor)>> {
    let (b, _, h, d) = q.dims4()?;
    let views = part.views_from(first)?;
    let Some((k0, _)) = views.first() else { return Ok(None) };
    let hkv = k0.dim(0)?;
    if b != 1 || hkv == 0 || h % hkv != 0 || k0.dim(2)? != d {
        return Err(crate::Error::Shape {
            op: "attention_over_blocks",
            name: "k",
            got: k0.dims().to_vec(),
            want: vec![hkv.max(1), k0.dim(1)?, d],
            q_shape: q.dims().to_vec(),
        });
    }
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    if backend(q, d) == Backend::Cpu && cpu::serves(q.dtype(), k0.dtype()) {
        if let Some(out) = cpu::attend(simd_path(), q, &views, scale)? {
            return Ok(Some(out));
        }
    }
    over_blocks_with_tensor_ops(q, &views, scale)
}

/// [`attention_over_blocks`] in candle tensor ops (any device and dtype; the CPU kernel's reference): per
/// block, two batched matmuls over the kv heads, softmax in f32 (f64), blocks merged by LSE. `views` not
/// empty, shapes checked.
fn over_blocks_with_tensor_ops(q: &Tensor, views: &[(Tensor, Tensor)], scale: f64) -> Result<Option<(Tensor, Tensor)>> {
    let (_, nq, h, d) = q.dims4()?;
    let hkv = views[0].0.dim(0)?;
    let g = h / hkv;
    let acc = if q.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    // [1, nq, h, d] -> [hkv, g·nq, d]: head h = kh·g + j.
    let qg = q.squeeze(0)?.reshape((nq, hkv, g, d))?.permute((1, 2, 0, 3))?.reshape((hkv, g * nq, d))?;
    let qg = (qg.to_dtype(acc)? * scale)?;
    let mut run: Option<RunningAttention> = None;
    for (k, v) in views {
        let (k, v) = (k.to_dtype(acc)?, v.to_dtype(acc)?);
        let s = qg.matmul(&k.t()?)?; // [hkv, g·nq, rows]
        let m = s.max_keepdim(2)?;
        let p = s.broadcast_sub(&m)?.exp()?;
        let l = p.sum_keepdim(2)?;
        let o = p.matmul(&v)?.broadcast_div(&l)?; // [hkv, g·nq, d]
        let lse = (m + l.log()?)?; // [hkv, g·nq, 1]
        let o = o.reshape((hkv, g, nq, d))?.permute((2, 0, 1, 3))?.reshape((1, nq, h, d))?.to_dtype(q.dtype())?;
        let lse = lse.reshape((h, nq))?.unsqueeze(0)?;
        match run.as_mut() {
            None => run = Some(RunningAttention::new(&o, &lse)?),
            Some(r) => r.merge(&o, &lse)?,
        }
    }
    Ok(run.map(|r| r.finish()).transpose()?)
}

/// Decode attention over the parts of a cache that the ranks of `group` hold (see the module doc): `q: [1,
/// q_len, heads, head_dim]`, the same on every rank; `part`: this rank's part, or the error that left this
/// rank without it (its new token's row could not be stored: the collective is entered all the same, so that
/// the peers fail at once); `holds[r]`: whether rank `r`'s part has a row (the callers know every rank's
/// fill; an empty part takes no share); `first`: the first position the query sees (0: all; `position -
/// max_distance` under a sliding window), the same on every rank. Returns `(o: [1, q_len, heads, head_dim]`
/// in q's dtype, `lse: [1, heads, q_len])`, the same on every rank; on a rank that failed, its own error, and
/// on the others [`Error::PeerFailed`](crate::Error::PeerFailed) naming it. Collective: one all-gather.
pub fn decode_attention(
    group: &dyn ProcessGroup,
    q: &Tensor,
    part: Result<&KvBlocks>,
    scale: Option<f64>,
    holds: &[bool],
    first: usize,
) -> Result<(Tensor, Tensor)> {
    let (b, nq, h, d) = q.dims4()?;
    let acc = if q.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let mine = part.and_then(|part| attention_over_blocks(q, part, scale, first));
    if group.size() == 1 {
        return mine?.ok_or_else(|| empty_cache_error(holds));
    }
    // This rank's partial result as one row: o (b·nq·h·d values), then lse (b·h·nq), then 0; when it sees no
    // row, o zeros and lse -inf (a part that weighs nothing in the merge: its factor e^(-inf - m) is 0); when
    // it failed, zeros and a last value of 1.
    let (o_len, lse_len) = (b * nq * h * d, b * h * nq);
    let dev = q.device();
    let mine = mine.and_then(|m| {
        let (o, lse) = match &m {
            Some((o, lse)) => (o.to_dtype(acc)?.flatten_all()?, lse.to_dtype(acc)?.flatten_all()?),
            None => (Tensor::zeros(o_len, acc, dev)?, Tensor::full(f32::NEG_INFINITY, lse_len, dev)?.to_dtype(acc)?),
        };
        Ok(Tensor::cat(&[o, lse, Tensor::zeros(1, acc, dev)?], 0)?)
    });
    let row = match &mine {
        Ok(row) => row.clone(),
        Err(_) => Tensor::cat(&[Tensor::zeros(o_len + lse_len, acc, dev)?, Tensor::ones(1, acc, dev)?], 0)?,
    };
    let all = group.all_gather(&row.unsqueeze(0)?, 0).map_err(autosp_core::Error::from);
    mine?;
    let all = all?;
    // One counted host read of the ranks' failure flags (P values).
    let flags = autosp_core::host_read::read_vec::<f32>(
        &all.narrow(1, o_len + lse_len, 1)?.flatten_all()?.to_dtype(DType::F32)?,
    )?;
    let failed: Vec<usize> = flags.iter().enumerate().filter(|(_, &f)| f != 0.0).map(|(r, _)| r).collect();
    if !failed.is_empty() {
        return Err(crate::Error::PeerFailed { op: "decode_attention", ranks: failed });
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use autosp_core::ops::attention::{naive_attention_forward, AttentionSpec};
    use candle_core::Device;

    /// The largest |a - b|, both widened to f32.
    fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        Ok((f32(a)? - f32(b)?)?.abs()?.flatten_all()?.max(0)?.to_scalar()?)
    }

    /// The keys and values `k`, `v` (`[1, n, hkv, d]`) cached in blocks of `block_rows`: the first `prefill`
    /// rows pushed at once (a prefill), the rest a token at a time.
    fn cached(k: &Tensor, v: &Tensor, block_rows: usize, prefill: usize) -> Result<KvBlocks> {
        let mut part = KvBlocks::with_block_rows(block_rows);
        part.push_rows(&k.narrow(1, 0, prefill)?, &v.narrow(1, 0, prefill)?, &(0..prefill).collect::<Vec<_>>())?;
        for i in prefill..k.dim(1)? {
            part.push_token(&k.narrow(1, i, 1)?, &v.narrow(1, i, 1)?, i)?;
        }
        Ok(part)
    }

    #[test]
    fn blocks_attention_equals_attention_over_all_keys_with_gqa() -> Result<()> {
        let dev = Device::Cpu;
        let (h, hkv, d) = (6, 2, 8);
        let q = Tensor::randn(0f32, 1., (1, 1, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, 13, hkv, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, 13, hkv, d), &dev)?;
        // A prefill block of 6 rows, then 7 tokens in blocks of 4.
        let part = cached(&k, &v, 4, 6)?;
        let scale = Some(0.3);
        let (o, lse) = attention_over_blocks(&q, &part, scale, 0)?.expect("rows held");
        let spec = AttentionSpec { scale, ..AttentionSpec::full() };
        let (want_o, want_lse) = naive_attention_forward(&q, &k, &v, &spec)?;
        assert!(max_diff(&o, &want_o)? < 1e-5 && max_diff(&lse, &want_lse)? < 1e-5);
        assert!(attention_over_blocks(&q, &KvBlocks::default(), None, 0)?.is_none());
        Ok(())
    }

    /// A sliding window: the query at position 12 with `max_distance` 4 sees positions 8..=12, as the
    /// training forward's mask says, on the kernel and on the tensor-op path; over two ranks, where rank 0's
    /// rows (positions 0..6) all fall outside the window and it sends `lse = -inf`, the merge equals it too,
    /// with no NaN.
    #[test]
    fn a_window_attends_only_the_rows_past_its_first_position_on_every_rank() -> Result<()> {
        let dev = Device::Cpu;
        let (h, hkv, d, n, at, w) = (4, 2, 16, 13, 12, 4);
        let q = Tensor::randn(0f32, 1., (1, 1, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?;
        let spec = AttentionSpec::causal().shifted(at, 0).with_max_distance(w);
        let (want_o, want_lse) = naive_attention_forward(&q, &k, &v, &spec)?;
        let part_of = |rows: std::ops::Range<usize>, prefill: usize| -> Result<KvBlocks> {
            let mut part = KvBlocks::with_block_rows(3);
            let pre = rows.start..rows.start + prefill;
            part.push_rows(
                &k.narrow(1, pre.start, prefill)?,
                &v.narrow(1, pre.start, prefill)?,
                &pre.collect::<Vec<_>>(),
            )?;
            for i in rows.start + prefill..rows.end {
                part.push_token(&k.narrow(1, i, 1)?, &v.narrow(1, i, 1)?, i)?;
            }
            Ok(part)
        };
        let whole = part_of(0..n, 6)?;
        let views = whole.views_from(at - w)?;
        let (o, lse) = over_blocks_with_tensor_ops(&q, &views, 0.25)?.expect("rows in the window");
        assert!(max_diff(&o, &want_o)? < 1e-5 && max_diff(&lse, &want_lse)? < 1e-5);
        let (o, lse) = attention_over_blocks(&q, &whole, None, at - w)?.expect("rows in the window");
        assert!(max_diff(&o, &want_o)? < 1e-5 && max_diff(&lse, &want_lse)? < 1e-5);
        let out =
            autosp_core::comm::run_ranks(2, std::time::Duration::from_secs(30), |g| -> Result<(Tensor, Tensor)> {
                let part = if g.rank() == 0 { part_of(0..6, 6)? } else { part_of(6..n, 2)? };
                assert_eq!(g.rank() == 0, attention_over_blocks(&q, &part, None, at - w)?.is_none());
                decode_attention(g.as_ref(), &q, Ok(&part), None, &[true, true], at - w)
            });
        for r in out {
            let (o, lse) = r.expect("rank ran")?;
            assert!(max_diff(&o, &want_o)? < 1e-5 && max_diff(&lse, &want_lse)? < 1e-5, "merged over ranks");
        }
        Ok(())
    }

    /// A rank whose part cannot take the new token's row (here a position before its last row, refused by
    /// `push_token` on that rank alone: only the token's owner stores it) still enters the all-gather: its
    /// peer fails at once naming it, not at the group's timeout (60 s here; the failing rank is kept alive, up
    /// to 30 s, until its peer's step ended), it fails with its own error, and the group is still usable: the
    /// next step over both parts equals attention over all the keys.
    #[test]
    fn a_rank_whose_row_cannot_be_stored_fails_its_peer_at_once() -> Result<()> {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::{Duration, Instant};
        let dev = Device::Cpu;
        let (h, hkv, d, n) = (4, 2, 8, 10);
        let q = Tensor::randn(0f32, 1., (1, 1, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?;
        let (start, peer_done) = (Instant::now(), AtomicBool::new(false));
        let out = autosp_core::comm::run_ranks(2, Duration::from_secs(60), |g| -> Result<_> {
            let rows = if g.rank() == 0 { 0..5 } else { 5..n };
            let mut part = KvBlocks::with_block_rows(4);
            let positions: Vec<usize> = rows.clone().collect();
            part.push_rows(&k.narrow(1, rows.start, 5)?, &v.narrow(1, rows.start, 5)?, &positions)?;
            let pushed =
                if g.rank() == 1 { part.push_token(&k.narrow(1, 0, 1)?, &v.narrow(1, 0, 1)?, 2) } else { Ok(()) };
            let failed = decode_attention(g.as_ref(), &q, pushed.map(|()| &part), None, &[true, true], 0);
            let failed_after = start.elapsed();
            if g.rank() == 0 {
                peer_done.store(true, Ordering::SeqCst);
            } else {
                while !peer_done.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(30) {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let next = decode_attention(g.as_ref(), &q, Ok(&part), None, &[true, true], 0)?;
            Ok((failed.map(|_| ()).map_err(|e| e.to_string()), failed_after, next))
        });
        let (want_o, want_lse) = naive_attention_forward(&q, &k, &v, &AttentionSpec::full())?;
        for (rank, r) in out.into_iter().enumerate() {
            let (failed, after, (o, lse)) = r.expect("rank ran")?;
            let e = failed.expect_err("the step fails on both ranks");
            let want = if rank == 0 { "rank(s) [1] of the group failed" } else { "decode tokens in order of position" };
            assert!(e.contains(want), "rank {rank}: {e}");
            assert!(after < Duration::from_secs(10), "rank {rank} failed after {after:?}");
            assert!(max_diff(&o, &want_o)? < 1e-5 && max_diff(&lse, &want_lse)? < 1e-5, "rank {rank}: the next step");
        }
        Ok(())
    }

    /// The CPU kernel (on every vector path this CPU has, and the scalar loops) against the tensor-op path,
    /// over a prefill block of 300 rows (two tasks, the second partial) and decoded rows in blocks of 7, with
    /// GQA (3 query heads per kv head) and two query rows: within 1e-5 (f32; the two sum the dot products
    /// and exponentials in different orders, each error a few ulps of values near 1).
    #[test]
    fn the_cpu_kernel_equals_the_tensor_op_path() -> Result<()> {
        let dev = Device::Cpu;
        let (h, hkv, d, n) = (6, 2, 64, 320);
        let q = Tensor::randn(0f32, 1., (1, 2, h, d), &dev)?;
        let k = (Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)? * 2.0)?;
        let v = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?;
        let part = cached(&k, &v, 7, 300)?;
        let views = part.views()?;
        let (want_o, want_lse) = over_blocks_with_tensor_ops(&q, &views, 0.125)?.expect("rows held");
        for path in autosp_core::simd::supported_paths() {
            let (o, lse) = cpu::attend(path, &q, &views, 0.125)?.expect("laid out for the kernel");
            assert!(max_diff(&o, &want_o)? < 1e-5, "{path:?} o: {}", max_diff(&o, &want_o)?);
            assert!(max_diff(&lse, &want_lse)? < 1e-5, "{path:?} lse: {}", max_diff(&lse, &want_lse)?);
        }
        // The door takes the kernel here, with the same result.
        let (o, _) = attention_over_blocks(&q, &part, Some(0.125), 0)?.expect("rows held");
        assert!(max_diff(&o, &want_o)? < 1e-5);
        Ok(())
    }

    /// A bf16 cache (widened to f32 block by block) against f32 attention over the same bf16-rounded inputs:
    /// within 1e-2 of the outputs (bf16 output rounding, 8 bits of mantissa) and 1e-4 of the LSE (kept in f32).
    #[test]
    fn a_bf16_cache_matches_f32_attention_over_the_rounded_inputs() -> Result<()> {
        let dev = Device::Cpu;
        let (h, hkv, d, n) = (4, 2, 8, 11);
        let round = |t: Tensor| t.to_dtype(DType::BF16);
        let q = round(Tensor::randn(0f32, 1., (1, 1, h, d), &dev)?)?;
        let k = round(Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?)?;
        let v = round(Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?)?;
        let part = cached(&k, &v, 4, 5)?;
        let (o, lse) = attention_over_blocks(&q, &part, None, 0)?.expect("rows held");
        assert_eq!(o.dtype(), DType::BF16);
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let (want_o, want_lse) = naive_attention_forward(&f32(&q)?, &f32(&k)?, &f32(&v)?, &AttentionSpec::full())?;
        assert!(max_diff(&o, &want_o)? < 1e-2, "o: {}", max_diff(&o, &want_o)?);
        assert!(max_diff(&lse, &want_lse)? < 1e-4, "lse: {}", max_diff(&lse, &want_lse)?);
        Ok(())
    }
    /// A bf16 cache on every vector path this CPU has (d = 64, so AVX-512's score tree; 300 prefill rows, two
    /// tasks, the second partial; GQA; two query rows), with bf16 and with f32 queries, against the tensor-op
    /// path over the same cache: within 1e-2 of the outputs (both widen the same bf16 values and sum in f32, the
    /// outputs then rounded to q's dtype, bf16's 8 bits of mantissa) and 1e-4 of the LSE (kept in f32).
    #[test]
    fn the_cpu_kernel_over_a_bf16_cache_equals_the_tensor_op_path_on_every_path() -> Result<()> {
        let dev = Device::Cpu;
        let (h, hkv, d, n) = (6, 2, 64, 310);
        let k = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?.to_dtype(DType::BF16)?;
        let part = cached(&k, &v, 7, 300)?;
        let views = part.views()?;
        let q32 = Tensor::randn(0f32, 1., (1, 2, h, d), &dev)?;
        for q in [q32.to_dtype(DType::BF16)?, q32] {
            let (want_o, want_lse) = over_blocks_with_tensor_ops(&q, &views, 0.125)?.expect("rows held");
            for path in autosp_core::simd::supported_paths() {
                let (o, lse) = cpu::attend(path, &q, &views, 0.125)?.expect("laid out for the kernel");
                assert_eq!(o.dtype(), q.dtype());
                assert!(max_diff(&o, &want_o)? < 1e-2, "{path:?} {:?} o: {}", q.dtype(), max_diff(&o, &want_o)?);
                assert!(
                    max_diff(&lse, &want_lse)? < 1e-4,
                    "{path:?} {:?} lse: {}",
                    q.dtype(),
                    max_diff(&lse, &want_lse)?
                );
            }
        }
        Ok(())
    }

    /// An f32 cache with f32 and with bf16 queries (the mix [`cpu::serves`] takes that the tests above leave
    /// out) at head_dim 42, not a multiple of 16: AVX-512 takes no score tree, every score comes from
    /// [`Real::dots`](crate::vector::Real::dots) (pulp's 8 lanes on x86: a group of four vectors, one more and
    /// a scalar tail of 2; NEON's 4: two groups, two more, the same tail), on every vector path this CPU has
    /// and the scalar loops, against the tensor-op path: within 1e-5 (f32 queries) or 1e-2 (bf16 outputs) of
    /// the outputs, 1e-5 of the LSE.
    #[test]
    fn the_cpu_kernel_at_a_head_dim_off_the_tree_with_either_query_dtype_equals_the_tensor_op_path() -> Result<()> {
        let dev = Device::Cpu;
        let (h, hkv, d, n) = (6, 2, 42, 310);
        let k = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, n, hkv, d), &dev)?;
        let part = cached(&k, &v, 7, 300)?;
        let views = part.views()?;
        let q32 = Tensor::randn(0f32, 1., (1, 2, h, d), &dev)?;
        for (q, tol) in [(q32.clone(), 1e-5), (q32.to_dtype(DType::BF16)?, 1e-2)] {
            let (want_o, want_lse) = over_blocks_with_tensor_ops(&q, &views, 0.15)?.expect("rows held");
            for path in autosp_core::simd::supported_paths() {
                let (o, lse) = cpu::attend(path, &q, &views, 0.15)?.expect("laid out for the kernel");
                assert_eq!(o.dtype(), q.dtype());
                assert!(max_diff(&o, &want_o)? < tol, "{path:?} {:?} o: {}", q.dtype(), max_diff(&o, &want_o)?);
                assert!(
                    max_diff(&lse, &want_lse)? < 1e-5,
                    "{path:?} {:?} lse: {}",
                    q.dtype(),
                    max_diff(&lse, &want_lse)?
                );
            }
        }
        Ok(())
    }
}
