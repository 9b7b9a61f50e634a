//! Which keys a query sees, defined once: [`AttentionSpec`] (the causal mask, a sliding window, the
//! absolute positions of the rows) answers for a query row the range of keys it sees ([`key_range`]), for a
//! key the range of rows that see it ([`row_range`]), and for a block of rows and keys whether it is hidden,
//! cut or fully seen ([`block`]). Every kernel asks it: the CPU flash tiles, the generic kernel's chunks and
//! masks, Ring attention's step classes, the candle-flash-attn plan and the naive reference.
//!
//! Properties every kernel may rely on (`tests/attention_mask.rs` in autosp-kernels holds each kernel to
//! them on random specs): a row sees one interval of keys; both ends of it never decrease from one row to the
//! next, and the non-empty intervals of consecutive rows overlap or touch, so the keys a run of rows sees are
//! `key_range(first).start..key_range(last).end`. The same holds for the rows that see a key. The document
//! mask of packed sequences ([`AttentionSpec::documents`]: each row sees only keys of its own document) keeps
//! all three properties: it raises each row's start to its document's first position and lowers its end to
//! the document's end, both of which never decrease either, and every row's unclipped interval holds its own
//! position, so a run of rows in two documents touches at the boundary. Kernels need nothing of their own for
//! it: the CPU flash kernel never visits a tile before a row's document, Ring attention skips a pair of shards
//! wholly in different documents (the pair is [`Visibility::Hidden`]).
//!
//! [`key_range`]: AttentionSpec::key_range
//! [`row_range`]: AttentionSpec::row_range
//! [`block`]: AttentionSpec::block

use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;

use super::Documents;
use crate::{Error, Result};

/// How attention is computed. Positions are absolute positions in the whole sequence: query row `i` sits at
/// `q_offset + i`, key row `j` at `k_offset + j`; causal attention hides keys after the query.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Hide key position > query position.
    pub causal: bool,
    /// Softmax scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Absolute position of the first query row.
    pub q_offset: usize,
    /// Absolute position of the first key row.
    pub k_offset: usize,
    /// A sliding window: when `Some(w)`, query position `p` sees only keys at positions `p'` with
    /// `|p - p'| <= w` (and, when causal, `p' <= p`). `None` sees every key the mask allows (Mistral's
    /// `sliding_window`, `llama_longctx --max-attention-distance`).
    pub max_distance: Option<usize>,
    /// The documents of a packed sequence, indexed by the same absolute positions: when `Some`, query position
    /// `p` sees only keys of its own document ([`Documents::range_of`]; positions past the documents' window,
    /// padding, form one document of their own that no real token sees). `None`: one sequence, no document
    /// mask. Shared (`Arc`), so that every layer's and every rank's spec points at one copy.
    pub documents: Option<Arc<Documents>>,
}

/// How much of a block of keys a block of query rows sees ([`AttentionSpec::block`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Visibility {
    /// No row sees any key of the block: skip it.
    Hidden,
    /// Some rows see some keys: compute it with the mask.
    Partial,
    /// Every row sees every key: compute it without a mask.
    Full,
}

impl AttentionSpec {
    /// Causal attention of a block against itself at position 0, default scale.
    pub fn causal() -> Self {
        Self { causal: true, scale: None, q_offset: 0, k_offset: 0, max_distance: None, documents: None }
    }

    /// Full (unmasked) attention, default scale.
    pub fn full() -> Self {
        Self { causal: false, scale: None, q_offset: 0, k_offset: 0, max_distance: None, documents: None }
    }

    /// The softmax scale for this head dimension.
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (head_dim as f64).sqrt())
    }

    /// The same spec with keys further than `distance` positions from the query hidden.
    pub fn with_max_distance(self, distance: usize) -> Self {
        Self { max_distance: Some(distance), ..self }
    }

    /// The same spec with `window` on top of its own: the narrower of the two wins (`None` adds nothing).
    /// Every window that stacks on another (a layer's own, an attention slot's, the compile step's) goes
    /// through [`narrower`](Self::narrower).
    pub fn narrowed(self, window: Option<usize>) -> Self {
        Self { max_distance: Self::narrower(self.max_distance, window), ..self }
    }

    /// The narrower of two windows (`None`: no window).
    pub fn narrower(a: Option<usize>, b: Option<usize>) -> Option<usize> {
        match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The same spec with the document mask of `documents` (`None`: none), whose positions are this spec's
    /// absolute positions (`q_offset + i`, `k_offset + j`).
    pub fn with_documents(self, documents: Option<Arc<Documents>>) -> Self {
        Self { documents, ..self }
    }

    /// The same spec without a mask: not causal, no window, no documents, offsets 0 (a block every row of
    /// which sees every key, as [`block`](Self::block) answers [`Visibility::Full`]); the scale stays.
    pub fn unmasked(&self) -> Self {
        Self { scale: self.scale, ..Self::full() }
    }

    /// The same spec with the rows and keys moved on: row 0 at `q_offset + rows`, key 0 at `k_offset + keys`
    /// (a block of a larger call, such as one Ring step's pair of shards).
    pub fn shifted(self, rows: usize, keys: usize) -> Self {
        Self { q_offset: self.q_offset + rows, k_offset: self.k_offset + keys, ..self }
    }

    /// Whether this spec may hide a (query, key) pair: causal, windowed or with documents.
    pub fn is_masked(&self) -> bool {
        self.causal || self.max_distance.is_some() || self.documents.is_some()
    }

    /// The keys query row `i` sees among keys `0..k_len`: one interval, empty (`start == end`) when it sees
    /// none. Both ends never decrease with `i` (see the module doc).
    #[inline]
    pub fn key_range(&self, i: usize, k_len: usize) -> Range<usize> {
        let qp = self.q_offset + i;
        let mut end = usize::MAX;
        if self.causal {
            end = qp + 1;
        }
        if let Some(w) = self.max_distance {
            end = end.min(qp.saturating_add(w).saturating_add(1));
        }
        let mut start = self.max_distance.map_or(0, |w| qp.saturating_sub(w));
        if let Some(docs) = &self.documents {
            let doc = docs.range_of(qp);
            (start, end) = (start.max(doc.start), end.min(doc.end));
        }
        let local = |p: usize| p.saturating_sub(self.k_offset).min(k_len);
        let (lo, hi) = (local(start), local(end));
        lo..hi.max(lo)
    }

    /// The query rows among `0..q_len` that see key `j`: one interval, empty when none does. Both ends never
    /// decrease with `j`.
    #[inline]
    pub fn row_range(&self, j: usize, q_len: usize) -> Range<usize> {
        let kp = self.k_offset + j;
        let mut first = 0;
        if self.causal {
            first = kp;
        }
        let mut end = usize::MAX;
        if let Some(w) = self.max_distance {
            first = first.max(kp.saturating_sub(w));
            end = kp.saturating_add(w).saturating_add(1);
        }
        if let Some(docs) = &self.documents {
            let doc = docs.range_of(kp);
            (first, end) = (first.max(doc.start), end.min(doc.end));
        }
        let local = |p: usize| p.saturating_sub(self.q_offset).min(q_len);
        let (lo, hi) = (local(first), local(end));
        lo..hi.max(lo)
    }

    /// Whether query row `i` sees key row `j`.
    #[inline]
    pub fn visible(&self, i: usize, j: usize) -> bool {
        self.key_range(i, j + 1).contains(&j)
    }

    /// How much of keys `keys` the query rows `rows` see (row by row, O(rows)).
    pub fn block(&self, rows: Range<usize>, keys: Range<usize>) -> Visibility {
        let (mut any, mut all) = (false, true);
        for i in rows {
            let r = self.key_range(i, keys.end);
            let (lo, hi) = (r.start.max(keys.start), r.end);
            any |= lo < hi;
            all &= r.start <= keys.start && r.end >= keys.end;
        }
        match (any, all) {
            (false, _) => Visibility::Hidden,
            (true, true) => Visibility::Full,
            (true, false) => Visibility::Partial,
        }
    }

    /// Checks `q: [b, nq, h, d]`, `k, v: [b, nk, h_kv, d]` and returns their dimensions.
    pub fn dims(&self, op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttentionDims> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.rank() != 4 {
                return Err(Error::InvalidArgument {
                    op,
                    msg: format!(
                        "{name} has shape {:?}; attention takes rank-4 [batch, seq, heads, head_dim]",
                        t.dims()
                    ),
                });
            }
        }
        let (b, nq, h, d) = q.dims4()?;
        let (bk, nk, hkv, dk) = k.dims4()?;
        if k.dims() != v.dims() {
            return Err(shape_err(op, "k", k, "v", v, "k and v must have the same shape"));
        }
        if bk != b || dk != d {
            return Err(shape_err(op, "q", q, "k", k, "batch and head_dim of q and k must agree"));
        }
        if hkv == 0 || h % hkv != 0 {
            return Err(shape_err(
                op,
                "q",
                q,
                "k",
                k,
                &format!("query heads ({h}) must be a multiple of kv heads ({hkv})"),
            ));
        }
        if let Some(s) = self.scale {
            if !s.is_finite() || s <= 0.0 {
                return Err(Error::InvalidArgument { op, msg: format!("scale must be finite and > 0, got {s}") });
            }
        }
        Ok(AttentionDims { batch: b, q_len: nq, k_len: nk, heads: h, kv_heads: hkv, head_dim: d })
    }
}

/// The dimensions of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    pub batch: usize,
    pub q_len: usize,
    pub k_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionDims {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

fn shape_err(op: &'static str, ln: &'static str, l: &Tensor, rn: &'static str, r: &Tensor, hint: &str) -> Error {
    Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
        op,
        lhs_name: ln,
        lhs: l.dims().to_vec(),
        rhs_name: rn,
        rhs: r.dims().to_vec(),
        hint: hint.to_string(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The visibility rule written out pair by pair from the definition (absolute positions, causal cut,
    /// window, same document), the reference for the interval forms.
    fn sees(s: &AttentionSpec, i: usize, j: usize) -> bool {
        let (qp, kp) = (s.q_offset + i, s.k_offset + j);
        (!s.causal || kp <= qp)
            && s.max_distance.is_none_or(|w| qp.abs_diff(kp) <= w)
            && s.documents.as_ref().is_none_or(|d| d.document_of(qp) == d.document_of(kp))
    }

    /// No documents; one document shorter than the positions used (the rest is padding); four documents of
    /// 1 to 5 tokens, the first going on from position 6.
    fn documents() -> [Option<Arc<Documents>>; 3] {
        [None, Some(Arc::new(Documents::whole(12))), Some(Arc::new(Documents::from_lengths(&[3, 1, 5, 5], 6).unwrap()))]
    }

    fn specs() -> impl Iterator<Item = AttentionSpec> {
        [false, true].into_iter().flat_map(|causal| {
            std::iter::once(None).chain((0..6).map(Some)).flat_map(move |w| {
                documents().into_iter().flat_map(move |documents| {
                    [(0, 0), (3, 0), (0, 4), (7, 2), (2, 9)].into_iter().map(move |(q_offset, k_offset)| {
                        AttentionSpec {
                            causal,
                            scale: None,
                            q_offset,
                            k_offset,
                            max_distance: w,
                            documents: documents.clone(),
                        }
                    })
                })
            })
        })
    }

    /// key_range and row_range are exactly the pairs of the definition, their ends never decrease, and the
    /// non-empty intervals of consecutive rows (keys) overlap or touch.
    #[test]
    fn intervals_are_the_definition_and_monotone() {
        let (nq, nk) = (9, 11);
        for s in specs() {
            for i in 0..nq {
                let r = s.key_range(i, nk);
                for j in 0..nk {
                    assert_eq!(r.contains(&j), sees(&s, i, j), "{s:?} row {i} key {j}: {r:?}");
                    assert_eq!(s.visible(i, j), sees(&s, i, j));
                    assert_eq!(s.row_range(j, nq).contains(&i), sees(&s, i, j), "{s:?} key {j} row {i}");
                }
            }
            let rows: Vec<_> = (0..nq).map(|i| s.key_range(i, nk)).collect();
            let keys: Vec<_> = (0..nk).map(|j| s.row_range(j, nq)).collect();
            for ranges in [&rows, &keys] {
                for w in ranges.windows(2) {
                    assert!(w[0].start <= w[1].start && w[0].end <= w[1].end, "{s:?}: {ranges:?}");
                    if !w[0].is_empty() && !w[1].is_empty() {
                        assert!(w[1].start <= w[0].end, "{s:?}: consecutive ranges leave a gap: {ranges:?}");
                    }
                }
            }
        }
    }

    /// `block` agrees with the definition pair by pair: Hidden exactly when no pair is visible, Full exactly
    /// when every pair is.
    #[test]
    fn block_visibility_is_the_definition() {
        let mut seen = [0usize; 3];
        for s in specs() {
            for (r0, r1, k0, k1) in (0..5).flat_map(|r0| {
                (r0 + 1..7).flat_map(move |r1| (0..5).flat_map(move |k0| (k0 + 1..8).map(move |k1| (r0, r1, k0, k1))))
            }) {
                let pairs: Vec<bool> =
                    (r0..r1).flat_map(|i| (k0..k1).map(move |j| (i, j))).map(|(i, j)| sees(&s, i, j)).collect();
                let want = if !pairs.iter().any(|&x| x) {
                    Visibility::Hidden
                } else if pairs.iter().all(|&x| x) {
                    Visibility::Full
                } else {
                    Visibility::Partial
                };
                assert_eq!(s.block(r0..r1, k0..k1), want, "{s:?} rows {r0}..{r1} keys {k0}..{k1}");
                seen[want as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    }
}

#[cfg(test)]
mod document_tests {
    use super::*;

    /// Rows of a packed sequence see their own document's keys only (with a window, the last W of them);
    /// a block wholly in different documents is hidden, one inside a document is as without documents.
    #[test]
    fn documents_hide_other_documents() {
        let docs = Arc::new(Documents::from_lengths(&[4, 3, 5], 0).unwrap());
        let s = AttentionSpec::causal().with_documents(Some(docs.clone()));
        assert!(s.is_masked());
        assert_eq!(s.key_range(2, 12), 0..3);
        assert_eq!(s.key_range(4, 12), 4..5);
        assert_eq!(s.key_range(11, 12), 7..12);
        assert_eq!(s.clone().with_max_distance(2).key_range(11, 12), 9..12);
        assert_eq!(s.row_range(5, 12), 5..7);
        assert_eq!(s.block(7..12, 0..7), Visibility::Hidden);
        assert_eq!(s.block(8..12, 7..8), Visibility::Full);
        assert_eq!(s.block(6..9, 5..8), Visibility::Partial);
        // Non-causal: the whole document, and padding past the window (12..) sees only padding.
        let f = AttentionSpec::full().with_documents(Some(docs));
        assert_eq!(f.key_range(5, 14), 4..7);
        assert_eq!(f.key_range(12, 14), 12..14);
        assert_eq!(f.key_range(11, 14), 7..12);
        assert_eq!(f.unmasked(), AttentionSpec::full());
    }
}
