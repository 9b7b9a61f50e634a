//! How one attention call maps onto candle-flash-attn (pure functions, unit-tested without a GPU): which of
//! its masks gives the [`AttentionSpec`]'s mask (causal cut and sliding window), and which dtypes and head
//! dimensions it takes.
//!
//! candle-flash-attn (FlashAttention-2) aligns its masks to the bottom right: with a left window `l` and a
//! right window `r` (`flash_attn_windowed(.., Some(l), Some(r))`, each at most `k_len`; `None` on the left is
//! no left limit, and `(None, Some(0))` is its causal kernel) query row `i` sees key row `j` iff
//! `i + (k_len - q_len) - l <= j <= i + (k_len - q_len) + r` (flash-attention's `mask.h`). Our spec lets query
//! `i` see key `j` iff `k_offset + j <= q_offset + i` (when causal) and `|q_offset + i - k_offset - j| <= w`
//! (with `max_distance = Some(w)`): per row an interval of keys of the same form, with the right limit at
//! `shift + (0 or w)` and the left at `shift - w`, `shift = q_offset - k_offset`. So a plan sets `r` and `l` to
//! those limits less `k_len - q_len` (clamped to what candle takes), then checks, row by row (O(q_len)), that
//! every row sees exactly the keys the spec gives it; the unmasked kernel serves a spec under which every row
//! sees every key. Anything else (e.g. a query shard that starts before its keys end, as Ring attention's
//! shards do, or packed documents: candle-flash-attn 0.11 has no varlen entry point that takes `cu_seqlens`
//! with a window, so a document mask of more than one document agrees with none of its masks), other dtypes (f32, f64) and other head dimensions have no plan: the dispatch (`route.rs`) runs
//! the device-generic kernel for them.

use autosp_core::ops::AttentionSpec;
use candle_core::DType;

/// The largest head dimension candle-flash-attn 0.11 compiles kernels for.
pub const CUDA_MAX_HEAD_DIM: usize = 512;

/// The mask to ask candle-flash-attn for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FlashAttnMask {
    /// Every query row sees every key row: `flash_attn(.., causal = false)`.
    Full,
    /// `flash_attn_windowed(.., left, Some(right))` (`left, right <= k_len`): query `i` sees key `j` iff
    /// `j <= i + k_len - q_len + right` and, when `left` is `Some(l)`, `j >= i + k_len - q_len - l`.
    Window { left: Option<usize>, right: usize },
}

impl FlashAttnMask {
    /// The keys query row `i` sees under this mask, as flash-attention's kernel decides them: `lo..hi` (empty
    /// when `hi <= lo`).
    fn key_range(self, i: usize, q_len: usize, k_len: usize) -> (i128, i128) {
        let (i, nq, nk) = (i as i128, q_len as i128, k_len as i128);
        match self {
            FlashAttnMask::Full => (0, nk),
            FlashAttnMask::Window { left, right } => {
                let lo = left.map_or(0, |l| (i + nk - nq - l as i128).max(0));
                (lo, (i + 1 + nk - nq + right as i128).min(nk))
            }
        }
    }

    /// Whether query row `i` sees key row `j` under this mask.
    #[cfg(test)]
    fn visible(self, i: usize, j: usize, q_len: usize, k_len: usize) -> bool {
        let (lo, hi) = self.key_range(i, q_len, k_len);
        (lo..hi).contains(&(j as i128))
    }
}

/// The keys query row `i` sees under `spec` ([`AttentionSpec::key_range`]) as `(lo, hi)`.
fn spec_key_range(spec: &AttentionSpec, i: usize, k_len: usize) -> (i128, i128) {
    let r = spec.key_range(i, k_len);
    (r.start as i128, r.end as i128)
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
/// it has none. Every candidate is checked row by row (O(q_len)) before it is returned.
pub(crate) fn flash_attn_mask(spec: &AttentionSpec, q_len: usize, k_len: usize) -> Option<FlashAttnMask> {
    let agrees = |m: FlashAttnMask| {
        (0..q_len).all(|i| {
            let (a, b) = (spec_key_range(spec, i, k_len), m.key_range(i, q_len, k_len));
            // Two empty ranges agree whatever their ends.
            a == b || (a.1 <= a.0 && b.1 <= b.0)
        })
    };
    if k_len == 0 || agrees(FlashAttnMask::Full) {
        return Some(FlashAttnMask::Full);
    }
    let nk = k_len as i128;
    let base = nk - q_len as i128;
    let shift = spec.q_offset as i128 - spec.k_offset as i128;
    let w = spec.max_distance.map(|w| w.min(usize::MAX / 4) as i128);
    // The spec's right limit (query row i sees keys up to i + right_limit) and left limit, bottom-right aligned.
    let right = match (spec.causal, w) {
        (true, _) => shift,
        (false, Some(w)) => shift + w,
        (false, None) => nk,
    } - base;
    let clamp = |x: i128| x.clamp(0, nk) as usize;
    // No left limit first (with right = 0, candle's causal kernel), then the window's.
    let mut lefts = vec![None];
    if let Some(w) = w {
        lefts.push(Some(clamp(base - (shift - w))));
    }
    lefts.into_iter().map(|left| FlashAttnMask::Window { left, right: clamp(right) }).find(|&m| agrees(m))
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
        AttentionSpec { causal, scale: None, q_offset, k_offset, max_distance: None, documents: None }
    }

    /// Every mask candle-flash-attn can be asked for with these lengths.
    fn all_masks(k_len: usize) -> impl Iterator<Item = FlashAttnMask> {
        let lefts = std::iter::once(None).chain((0..=k_len).map(Some));
        std::iter::once(FlashAttnMask::Full)
            .chain(lefts.flat_map(move |left| (0..=k_len).map(move |right| FlashAttnMask::Window { left, right })))
    }

    /// Every translated mask agrees with the spec on every (query, key) pair, and every refusal is right:
    /// no mask candle-flash-attn takes (the full one, or any left and right window in 0..=k_len) would have
    /// agreed. Exhaustive over small shapes, causal or not, without a sliding window and with every window
    /// from 0 (a row sees only its own position) to past every key.
    #[test]
    fn mask_translation_agrees_with_the_spec_or_refuses_only_the_inexpressible() {
        let (mut translated, mut refused, mut windows_translated) = (0, 0, 0);
        for causal in [false, true] {
            for window in std::iter::once(None).chain((0..8).map(Some)) {
                for q_len in 1..7 {
                    for k_len in 1..7 {
                        for q_offset in 0..9 {
                            for k_offset in 0..9 {
                                let s = AttentionSpec { max_distance: window, ..spec(causal, q_offset, k_offset) };
                                let agrees = |m: FlashAttnMask| {
                                    (0..q_len)
                                        .all(|i| (0..k_len).all(|j| m.visible(i, j, q_len, k_len) == s.visible(i, j)))
                                };
                                match flash_attn_mask(&s, q_len, k_len) {
                                    Some(m) => {
                                        assert!(agrees(m), "{s:?} q_len {q_len} k_len {k_len}: {m:?} disagrees");
                                        translated += 1;
                                        if window.is_some() && matches!(m, FlashAttnMask::Window { left: Some(_), .. })
                                        {
                                            windows_translated += 1;
                                        }
                                    }
                                    None => {
                                        let found = all_masks(k_len).find(|&m| agrees(m));
                                        assert!(
                                            found.is_none(),
                                            "{s:?} q_len {q_len} k_len {k_len}: refused an expressible mask {found:?}"
                                        );
                                        refused += 1;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // Every branch was exercised, sliding windows (a left limit) included.
        assert!(
            translated > 0 && refused > 0 && windows_translated > 0,
            "translated {translated} ({windows_translated} with a left limit), refused {refused}"
        );
    }

    #[test]
    fn plain_causal_and_kv_cache_decoding_are_the_causal_kernel() {
        // Self-attention of a block at any position, and 3 new tokens after 10 cached ones.
        let causal = FlashAttnMask::Window { left: None, right: 0 };
        assert_eq!(flash_attn_mask(&spec(true, 5, 5), 4, 4), Some(causal));
        assert_eq!(flash_attn_mask(&spec(true, 10, 0), 3, 13), Some(causal));
        assert_eq!(flash_attn_mask(&spec(false, 0, 7), 3, 13), Some(FlashAttnMask::Full));
    }

    /// A causal sliding window of w is the causal kernel with a left window of w (self-attention and decoding
    /// after a cache); a non-causal one is left = right = w; a window past every key is the plain mask.
    #[test]
    fn sliding_windows_are_candle_flash_attn_windows() {
        let win = |left, right| Some(FlashAttnMask::Window { left, right });
        assert_eq!(flash_attn_mask(&spec(true, 0, 0).with_max_distance(3), 16, 16), win(Some(3), 0));
        assert_eq!(flash_attn_mask(&spec(true, 10, 0).with_max_distance(4), 3, 13), win(Some(4), 0));
        assert_eq!(flash_attn_mask(&spec(false, 0, 0).with_max_distance(2), 8, 8), win(Some(2), 2));
        assert_eq!(flash_attn_mask(&spec(true, 0, 0).with_max_distance(100), 8, 8), win(None, 0));
        assert_eq!(flash_attn_mask(&spec(false, 0, 0).with_max_distance(7), 8, 8), Some(FlashAttnMask::Full));
        assert_eq!(flash_attn_mask(&spec(false, 0, 0).with_max_distance(usize::MAX), 8, 8), Some(FlashAttnMask::Full));
    }

    /// Packed documents: the checked translation refuses a mask of several documents (the dispatch runs the
    /// generic kernel, which honours it), and one document covering every row and key is the causal kernel.
    #[test]
    fn packed_documents_have_no_plan_unless_one_document() {
        use autosp_core::ops::Documents;
        use std::sync::Arc;
        let packed =
            AttentionSpec::causal().with_documents(Some(Arc::new(Documents::from_lengths(&[3, 5], 0).unwrap())));
        assert_eq!(plan(&packed, DType::BF16, &[1, 8, 2, 64], 8), None);
        let one = AttentionSpec::causal().with_documents(Some(Arc::new(Documents::whole(8))));
        assert_eq!(plan(&one, DType::BF16, &[1, 8, 2, 64], 8), Some(FlashAttnMask::Window { left: None, right: 0 }));
    }

    /// Only f16/bf16 with a head_dim that is a multiple of 8 up to 512 and an expressible mask get a plan; the
    /// rest (f32, head_dim 12, a Ring shard's mask) go to the generic kernel.
    #[test]
    fn plans_only_what_candle_flash_attn_takes() {
        let causal = AttentionSpec::causal();
        let causal_mask = Some(FlashAttnMask::Window { left: None, right: 0 });
        assert_eq!(plan(&causal, DType::BF16, &[1, 4, 2, 64], 4), causal_mask);
        assert_eq!(plan(&causal, DType::F16, &[1, 4, 2, 512], 4), causal_mask);
        assert_eq!(plan(&causal, DType::F32, &[1, 4, 2, 64], 4), None);
        assert_eq!(plan(&causal, DType::F64, &[1, 4, 2, 64], 4), None);
        for d in [0, 12, 520] {
            assert_eq!(plan(&causal, DType::BF16, &[1, 4, 2, d], 4), None, "head_dim {d}");
        }
        // A later query shard that starts before its keys end (Ring's zigzag): no window expresses it.
        assert_eq!(plan(&spec(true, 2, 0), DType::BF16, &[1, 4, 2, 64], 8), None);
    }
}
