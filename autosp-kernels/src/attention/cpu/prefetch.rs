//! Software prefetch of the packed rows a flash task reads next, so that they arrive in L2 while the current
//! tile products run instead of stalling the first products of the next tile.

/// Bytes of one cache line (every packed row starts on one; see `buffer.rs`).
const LINE: usize = 64;

/// Asks for part `part` of `parts` (in equal shares of lines, in order) of the first `width` elements of each
/// of `rows` rows `ld` elements apart from `base` to be fetched into L2 (x86-64 `prefetcht1`; nothing on
/// other targets). A hint: it reads no memory the program can see, so any address is allowed, though
/// the callers only name rows of their own packed buffers.
#[inline]
pub(crate) fn prefetch_rows<T>(base: *const T, rows: usize, width: usize, ld: usize, part: usize, parts: usize) {
    #[cfg(target_arch = "x86_64")]
    for at in line_offsets(rows, width, ld, std::mem::size_of::<T>(), part, parts) {
        // SAFETY: a prefetch is a hint that never faults and changes no memory, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(base.wrapping_add(at) as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (base, rows, width, ld, part, parts);
}

/// The element offsets of the line starts [`prefetch_rows`] names for part `part` of `parts`: the lines of
/// the rows in order (`width.div_ceil(elements per line)` per row) cut into `parts` runs of equal length (±1).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn line_offsets(
    rows: usize,
    width: usize,
    ld: usize,
    elem_bytes: usize,
    part: usize,
    parts: usize,
) -> impl Iterator<Item = usize> {
    let per_line = (LINE / elem_bytes.max(1)).max(1);
    let lines_per_row = width.div_ceil(per_line).max(1);
    let total = if width == 0 { 0 } else { rows * lines_per_row };
    let parts = parts.max(1);
    let (first, end) = (total * part / parts, total * (part + 1) / parts);
    // Row and line walked alongside the counter: no division per line.
    let (mut row, mut line) = (first / lines_per_row, first % lines_per_row);
    (first..end).map(move |_| {
        let at = row * ld + line * per_line;
        line += 1;
        if line == lines_per_row {
            (row, line) = (row + 1, 0);
        }
        at
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_name_every_line_of_every_row_once() {
        // (rows, width, ld, element bytes, parts): f32 rows of 128 (8 lines) and of 72 (5 lines, the last
        // partial), f64, more parts than lines, and empty rows.
        for (rows, width, ld, eb, parts) in [
            (64, 128, 144, 4, 2),
            (64, 128, 144, 4, 3),
            (7, 72, 80, 4, 4),
            (5, 40, 48, 8, 2),
            (2, 16, 32, 4, 9),
            (3, 0, 16, 4, 2),
        ] {
            let mut got: Vec<usize> = (0..parts).flat_map(|p| line_offsets(rows, width, ld, eb, p, parts)).collect();
            let per_line = 64 / eb;
            let want: Vec<usize> = (0..if width == 0 { 0 } else { rows })
                .flat_map(|r| (0..width.div_ceil(per_line)).map(move |l| r * ld + l * per_line))
                .collect();
            assert_eq!(got, want, "in order, rows {rows} width {width} parts {parts}");
            got.dedup();
            assert_eq!(got.len(), want.len());
            let sizes: Vec<usize> = (0..parts).map(|p| line_offsets(rows, width, ld, eb, p, parts).count()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "equal shares: {sizes:?}");
        }
    }
}
