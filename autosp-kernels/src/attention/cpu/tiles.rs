//! Where things are in the CPU flash kernel: the tile sizes, the offsets of a head's rows in the
//! `[batch, seq, heads, head_dim]` layout, which tiles a query tile sees and which need a mask (asked of
//! [`AttentionSpec`]'s key and row intervals, so whole tiles outside them are skipped), the packing of a
//! head's rows into transposed tiles or contiguous rows, and the raw pointer that lets parallel tasks write
//! their own disjoint parts of one output buffer.

use std::ops::Range;

use autosp_core::ops::attention::{AttentionDims, AttentionSpec};
use autosp_core::simd::{simd_path, SimdPath};

use crate::vector::Real;

/// Query rows per tile.
pub(crate) const BR: usize = 64;
/// Key rows per tile (a multiple of 16: score rows are whole vectors).
pub(crate) const BC: usize = 64;
/// Elements added to the row stride of every packed operand of the tile products (one 64-byte line of f32).
/// Unpadded, a `[d][BC]` key tile's rows are 256 B apart and a `[n][d]` row block's `4·d` bytes: both
/// multiples of 256 B, so a product's column panel (one line per row of k) lands in a quarter or less of the
/// L1's 64 sets and evicts itself and the A rows; a stride of an odd number of lines spreads it over all of
/// them. (The L1 data caches of Zen 2-5 and Intel since Skylake: 32 or 48 KiB, 64 sets of 64 B lines.)
pub(crate) const PAD: usize = 16;
/// Row stride of a packed transposed key tile `[d][KT_LD]` (its first `BC` columns used).
pub(crate) const KT_LD: usize = BC + PAD;

/// The dimensions, strides, mask and vector path of one attention call, as the kernels use them.
#[derive(Clone, Debug)]
pub(crate) struct Geometry {
    pub b: usize,
    pub nq: usize,
    pub nk: usize,
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    pub group: usize,
    /// Row stride of q, o, dO, dq: `heads * head_dim`.
    pub q_rs: usize,
    /// Row stride of k, v, dk, dv: `kv_heads * head_dim`.
    pub k_rs: usize,
    pub scale: f64,
    /// Which keys each row sees.
    pub spec: AttentionSpec,
    /// The vector path the tile products and rows run on (the one in force when the call began).
    pub path: SimdPath,
}

impl Geometry {
    pub fn new(dims: &AttentionDims, spec: &AttentionSpec) -> Self {
        Self {
            b: dims.batch,
            nq: dims.q_len,
            nk: dims.k_len,
            h: dims.heads,
            hkv: dims.kv_heads,
            d: dims.head_dim,
            group: dims.group(),
            q_rs: dims.heads * dims.head_dim,
            k_rs: dims.kv_heads * dims.head_dim,
            scale: spec.scale_for(dims.head_dim),
            spec: spec.clone(),
            path: simd_path(),
        }
    }

    /// Offset of row 0 of query head `hi` of batch `bi` in q, o, dO, dq.
    pub fn q_base(&self, bi: usize, hi: usize) -> usize {
        (bi * self.nq * self.h + hi) * self.d
    }

    /// Offset of row 0 of kv head `kh` of batch `bi` in k, v, dk, dv.
    pub fn k_base(&self, bi: usize, kh: usize) -> usize {
        (bi * self.nk * self.hkv + kh) * self.d
    }

    pub fn q_tiles(&self) -> usize {
        self.nq.div_ceil(BR)
    }

    pub fn k_tiles(&self) -> usize {
        self.nk.div_ceil(BC)
    }

    /// Row stride of packed `[n][d]` rows (`d + PAD`; see [`PAD`]).
    pub fn row_ld(&self) -> usize {
        self.d + PAD
    }

    /// The keys query row `i` sees (the spec's interval; see `autosp_core::ops::attention::spec`).
    pub fn key_range(&self, i: usize) -> Range<usize> {
        self.spec.key_range(i, self.nk)
    }

    /// The query rows that see key `j`.
    pub fn row_range(&self, j: usize) -> Range<usize> {
        self.spec.row_range(j, self.nq)
    }

    /// The key tiles that query rows `i0..i0 + rows` see (`rows >= 1`): `first..end`, every one of them seen by
    /// at least one of the rows; the others are never computed.
    pub fn key_tiles_seen(&self, i0: usize, rows: usize) -> std::ops::Range<usize> {
        let (lo, hi) = (self.key_range(i0).start, self.key_range(i0 + rows - 1).end);
        if hi <= lo {
            return 0..0;
        }
        lo / BC..hi.div_ceil(BC)
    }

    /// The query tiles that see key rows `j0..j0 + cols` (`cols >= 1`): `first..end`, every one of them seeing
    /// at least one of the keys; the others are never computed.
    pub fn query_tiles_seeing(&self, j0: usize, cols: usize) -> std::ops::Range<usize> {
        let (first, end) = (self.row_range(j0).start, self.row_range(j0 + cols - 1).end);
        if end <= first {
            return 0..0;
        }
        first / BR..end.div_ceil(BR)
    }

    /// Whether the score tile of query rows `i0..i0 + rows` and key tile `j0..j0 + BC` hides any entry (a
    /// causal cut, the window's edges, or padding columns past the last key).
    pub fn tile_needs_mask(&self, i0: usize, rows: usize, j0: usize) -> bool {
        self.key_range(i0).end < j0 + BC || self.key_range(i0 + rows - 1).start > j0
    }

    /// Sets the hidden entries of the score tile `s: [rows, BC]` (query rows from `i0`, keys from `j0`) to -inf.
    pub fn mask_tile<T: Real>(&self, s: &mut [T], rows: usize, i0: usize, j0: usize) {
        for r in 0..rows {
            let Range { start: lo, end: hi } = self.key_range(i0 + r);
            let row = &mut s[r * BC..(r + 1) * BC];
            row[..lo.saturating_sub(j0).min(BC)].fill(T::NEG_INF);
            row[hi.saturating_sub(j0).min(BC)..].fill(T::NEG_INF);
        }
    }

    /// Packs the keys (or values) of kv head `kh` of batch `bi` as transposed tiles `[k_tiles][d][KT_LD]`, zero
    /// past the last key, into `dst`.
    pub fn pack_transposed<T: Real>(&self, src: &[T], bi: usize, kh: usize, dst: &mut [T]) {
        for (t, tile) in dst.chunks_exact_mut(self.d * KT_LD).enumerate() {
            self.pack_tile_transposed(src, bi, kh, t, tile);
        }
    }

    /// Packs key tile `t` of kv head `kh` of batch `bi` transposed, `[d][KT_LD]` (the first `BC` columns), zero
    /// past the last key. Sixteen keys at a time: for each of the `d` rows of the tile, their sixteen values
    /// fill one cache line of it, read from sixteen source rows that stay in L1 (key by key, each key wrote
    /// one element into each of `d` lines, a working set larger than the L1 at d = 128).
    pub fn pack_tile_transposed<T: Real>(&self, src: &[T], bi: usize, kh: usize, t: usize, tile: &mut [T]) {
        const KEYS: usize = 16;
        let base = self.k_base(bi, kh);
        let j0 = t * BC;
        let cols = (self.nk - j0).min(BC);
        for c0 in (0..BC).step_by(KEYS) {
            let n = cols.saturating_sub(c0).min(KEYS);
            let rows: [&[T]; KEYS] =
                std::array::from_fn(|c| if c < n { &src[base + (j0 + c0 + c) * self.k_rs..][..self.d] } else { &[] });
            for kk in 0..self.d {
                let line = &mut tile[kk * KT_LD + c0..][..KEYS];
                for (x, row) in line.iter_mut().zip(&rows[..n]) {
                    *x = row[kk];
                }
                line[n..].fill(T::ZERO);
            }
        }
    }
}

/// Copies `n` rows of `d` elements, strided by `rs` from `src[base..]`, into `dst: [n, ld]` (the first `d`
/// of each row; `ld` is [`Geometry::row_ld`]): packing a head's rows so that the tile products read them at a
/// stride of an odd number of cache lines, where the `[b, n, h, d]` layout's `heads · d` would make them
/// fight for the same L1 sets (see [`PAD`]).
pub(crate) fn pack_rows<T: Real>(src: &[T], base: usize, rs: usize, d: usize, ld: usize, dst: &mut [T]) {
    for (i, row) in dst.chunks_exact_mut(ld).enumerate() {
        row[..d].copy_from_slice(&src[base + i * rs..][..d]);
    }
}

/// A pointer into an output buffer that parallel tasks share; each task writes only its own disjoint part.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut<T>(pub *mut T);

// SAFETY: the tasks that share a `SharedOut` write disjoint elements (each function that uses one says which).
unsafe impl<T> Send for SharedOut<T> {}
unsafe impl<T> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    /// # Safety
    /// The range must be inside the buffer and written by no other task.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}
