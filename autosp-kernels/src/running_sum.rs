//! A running sum of tensors in a fixed order (chunk by chunk, step by step): the accumulation pattern of the
//! chunked and sequence-parallel kernels, whose results are deterministic because the order is.

use candle_core::Tensor;

/// `acc += x`, or `acc = x` when nothing was added yet.
pub(crate) fn add_to(acc: &mut Option<Tensor>, x: Tensor) -> candle_core::Result<()> {
    *acc = Some(match acc.take() {
        Some(a) => (a + x)?,
        None => x,
    });
    Ok(())
}
