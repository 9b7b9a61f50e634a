//! The online-softmax step of the flash forward (ALGORITHMS.md, log2 domain) over the rows of a score tile,
//! written once over the row operations it is given, so the fused AVX2/NEON kernel (`pulp.rs`) and the
//! row-by-row path (`mod.rs`: f64, scalar, AVX-512) share the formulas and give the same bits.

use super::float::Float;

/// The row maximum and in-place `exp2` (returning the row's sum) an online-softmax step runs on.
pub(crate) struct RowOps<M, E> {
    pub max: M,
    pub exp2: E,
}

/// The online-softmax step of [`super::Real::online_softmax`] over the rows of `s`, with the row operations
/// given: the one copy of the formulas, run through `Real`'s row operations by `online_softmax_rows` (mod.rs)
/// and through pulp's inlined row code by the fused AVX2/NEON kernel (`pulp::online_softmax`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn online_softmax_with<T: Float>(
    s: &mut [T],
    ld: usize,
    c: T,
    m: &mut [T],
    l: &mut [T],
    acc: &mut [T],
    d: usize,
    mut rows: RowOps<impl FnMut(&[T]) -> T, impl FnMut(&mut [T], T, T) -> T>,
    mut scale: impl FnMut(&mut [T], T),
) {
    for (r, row) in s.chunks_exact_mut(ld).enumerate() {
        let mx = (rows.max)(row);
        if mx == T::NEG_INF {
            // This row sees no key of this tile: weight 0, state unchanged.
            row.fill(T::ZERO);
            continue;
        }
        let mx = mx * c;
        let m_new = if m[r] > mx { m[r] } else { mx };
        let sum = (rows.exp2)(row, c, m_new);
        if m[r] != m_new {
            let alpha = (m[r] - m_new).exp2();
            scale(&mut acc[r * d..(r + 1) * d], alpha);
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
        } else {
            l[r] += sum;
        }
    }
}
