//! How one attention call maps onto candle-flash-attn (pure functions, unit-tested without a GPU): which of
//! its masks gives the [`AttentionSpec`]'s causal mask, and which dtypes and head dimensions it takes.
//!
//! candle-flash-attn (FlashAttention-2) aligns its causal mask to the bottom right: with a right window `w`
//! (`flash_attn_windowed(.., None, Some(w))`; `w = 0` is plain causal) query row `i` sees key row `j` iff
//! `j <= i + (k_len - q_len) + w` (flash-attention's `mask.h`; the left limit it then sets, `k_len`, never
//! binds). Our spec lets query `i` see key `j` iff `k_offset + j <= q_offset + i`. So the two agree iff
//! `w = (q_offset - k_offset) - (k_len - q_len)` lies in `0..=k_len` (candle turns a larger window into "no
//! limit"), or every row sees every key, which the unmasked kernel gives. Other layouts (e.g. a query shard
//! that starts before its keys end, as Ring attention's shards do), other dtypes (f32, f64) and other head
//! dimensions have no plan: the dispatch (`device.rs`) runs the device-generic kernel for them.

use autosp_core::ops::AttentionSpec;
use candle_core::DType;

/// The largest head dimension candle-flash-attn 0.11 compiles kernels for.
pub const CUDA_MAX_HEAD_DIM: usize = 512;

/// The mask to ask candle-flash-attn for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlashAttnMask {
    /// Every query row sees every key row: `flash_attn(.., causal = false)`.
    Full,
    /// `flash_attn_windowed(.., None, Some(right))`: query `i` sees key `j` iff `j <= i + k_len - q_len + right`.
    Window { right: usize },
}

impl FlashAttnMask {
    /// Whether query row `i` sees key row `j` under this mask, as flash-attention's kernel decides it.
    #[cfg(test)]
    fn visible(self, i: usize, j: usize, q_len: usize, k_len: usize) -> bool {
        match self {
            FlashAttnMask::Full => true,
            FlashAttnMask::Window { right } => {
                let limit = (i + 1 + k_len + right) as i128 - q_len as i128;
                (j as i128) < limit.min(k_len as i128)
            }
        }
    }
}

/// How candle-flash-attn computes one call, when it can: the mask for `spec`, given that it takes `dtype` and
/// q's shape `q_shape: [batch, q_len, heads, head_dim]` against `k_len` keys. `None`: the dtype, head
/// dimension or mask is one it does not take.
pub(crate) fn plan(spec: &AttentionSpec, dtype: DType, q_shape: &[usize], k_len: usize) -> Option<FlashAttnMask> {
    if !takes_inputs(dtype, q_shape) {
        return None;
    }
    flash_attn_mask(spec, q_shape.get(1).copied().unwrap_or(0), k_len)
}

/// The candle-flash-attn mask equal to `spec`'s for `q_len` query rows and `k_len` key rows, or `None` when
/// it has none.
pub(crate) fn flash_attn_mask(spec: &AttentionSpec, q_len: usize, k_len: usize) -> Option<FlashAttnMask> {
    let shift = spec.q_offset as i128 - spec.k_offset as i128;
    // Row 0 seeing the last key means every row sees every key.
    if !spec.causal || k_len == 0 || shift >= k_len as i128 - 1 {
        return Some(FlashAttnMask::Full);
    }
    let w = shift - (k_len as i128 - q_len as i128);
    (0..=k_len as i128).contains(&w).then_some(FlashAttnMask::Window { right: w as usize })
}

/// Whether candle-flash-attn takes this dtype (f16, bf16) and head dimension (a multiple of 8, at most
/// [`CUDA_MAX_HEAD_DIM`]); `q_shape` is q's shape `[batch, q_len, heads, head_dim]`.
pub(crate) fn takes_inputs(dtype: DType, q_shape: &[usize]) -> bool {
    let head_dim = q_shape.last().copied().unwrap_or(0);
    matches!(dtype, DType::F16 | DType::BF16) && head_dim != 0 && head_dim % 8 == 0 && head_dim <= CUDA_MAX_HEAD_DIM
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(causal: bool, q_offset: usize, k_offset: usize) -> AttentionSpec {
        AttentionSpec { causal, scale: None, q_offset, k_offset, max_distance: None }
    }

    /// Every translated mask agrees with the spec on every (query, key) pair, and every refusal is right:
    /// no window in 0..=k_len and not the full mask would have agreed. Exhaustive over small shapes.
    #[test]
    fn mask_translation_agrees_with_the_spec_or_refuses_only_the_inexpressible() {
        let (mut translated, mut refused) = (0, 0);
        for causal in [false, true] {
            for q_len in 1..7 {
                for k_len in 1..7 {
                    for q_offset in 0..9 {
                        for k_offset in 0..9 {
                            let s = spec(causal, q_offset, k_offset);
                            let agrees = |m: FlashAttnMask| {
                                (0..q_len).all(|i| (0..k_len).all(|j| m.visible(i, j, q_len, k_len) == s.visible(i, j)))
                            };
                            match flash_attn_mask(&s, q_len, k_len) {
                                Some(m) => {
                                    assert!(agrees(m), "{s:?} q_len {q_len} k_len {k_len}: {m:?} disagrees");
                                    translated += 1;
                                }
                                None => {
                                    let any = std::iter::once(FlashAttnMask::Full)
                                        .chain((0..=k_len).map(|right| FlashAttnMask::Window { right }))
                                        .any(agrees);
                                    assert!(!any, "{s:?} q_len {q_len} k_len {k_len}: refused an expressible mask");
                                    refused += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        // Both branches were exercised.
        assert!(translated > 0 && refused > 0, "translated {translated}, refused {refused}");
    }

    #[test]
    fn plain_causal_and_kv_cache_decoding_are_the_causal_kernel() {
        // Self-attention of a block at any position, and 3 new tokens after 10 cached ones.
        assert_eq!(flash_attn_mask(&spec(true, 5, 5), 4, 4), Some(FlashAttnMask::Window { right: 0 }));
        assert_eq!(flash_attn_mask(&spec(true, 10, 0), 3, 13), Some(FlashAttnMask::Window { right: 0 }));
        assert_eq!(flash_attn_mask(&spec(false, 0, 7), 3, 13), Some(FlashAttnMask::Full));
    }

    /// Only f16/bf16 with a head_dim that is a multiple of 8 up to 512 and an expressible mask get a plan; the
    /// rest (f32, head_dim 12, a Ring shard's mask) go to the generic kernel.
    #[test]
    fn plans_only_what_candle_flash_attn_takes() {
        let causal = AttentionSpec::causal();
        assert_eq!(plan(&causal, DType::BF16, &[1, 4, 2, 64], 4), Some(FlashAttnMask::Window { right: 0 }));
        assert_eq!(plan(&causal, DType::F16, &[1, 4, 2, 512], 4), Some(FlashAttnMask::Window { right: 0 }));
        assert_eq!(plan(&causal, DType::F32, &[1, 4, 2, 64], 4), None);
        assert_eq!(plan(&causal, DType::F64, &[1, 4, 2, 64], 4), None);
        for d in [0, 12, 520] {
            assert_eq!(plan(&causal, DType::BF16, &[1, 4, 2, d], 4), None, "head_dim {d}");
        }
        // A later query shard that starts before its keys end (Ring's zigzag): no window expresses it.
        assert_eq!(plan(&spec(true, 2, 0), DType::BF16, &[1, 4, 2, 64], 8), None);
    }
}
