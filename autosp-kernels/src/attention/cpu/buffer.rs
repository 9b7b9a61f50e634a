//! The buffers the CPU flash kernel packs its operands into: each starts on a 64-byte cache line, and a
//! large one (a long sequence's packed K/V, Q/dO rows or dQ partials) is offered to Linux for transparent
//! huge pages.

/// Bytes of the alignment of every packed operand and tile buffer: one cache line.
const LINE: usize = 64;

/// Buffers of at least this many bytes are advised for huge pages (they then hold at least one whole
/// 2 MiB page).
const HUGE_FROM: usize = 4 << 20;

/// A buffer of `len` elements, all `fill`, whose first element starts a 64-byte cache line.
///
/// Alignment: the allocator only promises 16 bytes (glibc's large blocks start 16 bytes past a page), so a
/// 16-float column panel of a packed tile, one line when aligned, straddled two: twice the L1 lines per row
/// of k and every other 32-byte load split across lines. Aligning every packed operand and tile buffer
/// took forward + backward at N = 8192, d = 128 (AVX2, Zen 4) from 3.48 to 2.98 s (docs/BENCHMARKS.md).
///
/// Huge pages (Linux): a tile pair's operands (~330 KiB at d = 128) span ~80 4 KiB pages, more than the
/// first-level data TLB holds (64-72 entries on Zen 2-4 and Intel cores): the likely reason huge pages took
/// forward + backward there a further 14% faster (median of per-round ratios; the machine had no event
/// counters to count TLB misses).
/// Buffers of [`HUGE_FROM`] bytes or more are `madvise`d `MADV_HUGEPAGE` before their first write (a zero
/// fill is a fresh `calloc` mapping, untouched until the kernel's tasks write it), which takes effect where
/// `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` or `always` and is ignored under `never`.
pub(crate) struct LineBuf<T> {
    buf: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Copy> LineBuf<T> {
    pub fn new(len: usize, fill: T) -> Self {
        let size = std::mem::size_of::<T>().max(1);
        let extra = LINE / size;
        let buf = vec![fill; len + extra];
        advise_huge_pages(buf.as_ptr() as usize, buf.len() * size);
        let off = buf.as_ptr().align_offset(LINE).min(extra);
        Self { buf, off, len }
    }
}

impl<T> std::ops::Deref for LineBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl<T> std::ops::DerefMut for LineBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// Advises the whole 2 MiB pages inside `[start, start + bytes)` for transparent huge pages (a hint: an
/// error, such as a kernel without THP, changes nothing and is ignored).
#[cfg(target_os = "linux")]
fn advise_huge_pages(start: usize, bytes: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    if bytes < HUGE_FROM {
        return;
    }
    let first = start.next_multiple_of(HUGE_PAGE);
    let end = (start + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end > first {
        // SAFETY: the range lies inside one live allocation of ours; MADV_HUGEPAGE changes no contents.
        unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_start: usize, _bytes: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_a_line_and_hold_their_fill() {
        for len in [0, 1, 17, 4096, (HUGE_FROM / 4) + 3] {
            let b = LineBuf::new(len, 2.5f32);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % LINE, 0, "len {len}");
            assert!(b.iter().all(|&x| x == 2.5));
            let z = LineBuf::new(len, 0.0f64);
            assert_eq!(z.as_ptr() as usize % LINE, 0);
            assert!(z.iter().all(|&x| x == 0.0));
        }
    }
}
