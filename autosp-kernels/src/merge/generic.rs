//! The LSE merge of two partial attention results of the same queries over disjoint key sets (Ring
//! attention) in candle tensor ops: the device-generic twin of the CPU loop (`cpu.rs`), in the accumulation dtype (f32, or f64 for f64), in the stable form of ALGORITHMS.md:
//!
//! ```text
//! lse = max(a, b) + log1p(exp(-|a - b|)),   O = exp(a - lse)·O_a + exp(b - lse)·O_b
//! ```
//!
//! A side with LSE = -inf (its rows saw no key) has weight 0 and the other side passes unchanged; two -inf
//! sides give `O = 0`, `lse = -inf`. The -inf cases are chosen by `where_cond` masks, so no `-inf - -inf`
//! reaches the output (no NaN).

use candle_core::{Result, Tensor};

/// `log(1 + x)` for `x >= 0`, accurate for small x (Kahan: `x · log(u) / (u - 1)` with `u = 1 + x`, and x
/// itself where `u` rounds to 1). candle has no `log1p`.
fn log1p(x: &Tensor) -> Result<Tensor> {
    let u = (x + 1.0)?;
    let ratio = (u.log()? / (&u - 1.0)?)?;
    // Where u == 1 the ratio is 0/0; the mask picks x there.
    u.eq(1.0)?.where_cond(x, &(x * ratio)?)
}

/// Merges `(o_b, lse_b)` into `(o_a, lse_a)`: `o_a, o_b: [b, n, h, d]`, `lse_a, lse_b: [b, h, n]`. The
/// accumulation dtype is `lse_a`'s (f32 or f64); the other inputs are converted to it. Returns the merged
/// `(o: [b, n, h, d], lse: [b, h, n])` in that dtype. A side whose lse is -inf must have a finite `o` (the
/// flash kernels give 0 for a row that saw no key): its weight is 0.
pub(crate) fn merge(o_a: &Tensor, lse_a: &Tensor, o_b: &Tensor, lse_b: &Tensor) -> Result<(Tensor, Tensor)> {
    let acc = lse_a.dtype();
    let (o_a, o_b, lse_b) = (o_a.to_dtype(acc)?, o_b.to_dtype(acc)?, lse_b.to_dtype(acc)?);
    let (a_inf, b_inf) = (lse_a.eq(f64::NEG_INFINITY)?, lse_b.eq(f64::NEG_INFINITY)?);
    let (zeros, ones) = (lse_a.zeros_like()?, lse_a.ones_like()?);
    // Finite stand-ins where a side is -inf, so the arithmetic below never sees -inf - -inf.
    let a = a_inf.where_cond(&zeros, lse_a)?;
    let b = b_inf.where_cond(&zeros, &lse_b)?;
    let lse = (a.maximum(&b)? + log1p(&(&a - &b)?.abs()?.neg()?.exp()?)?)?;
    let (wa, wb) = ((&a - &lse)?.exp()?, (&b - &lse)?.exp()?);
    let wa = a_inf.where_cond(&zeros, &b_inf.where_cond(&ones, &wa)?)?;
    let wb = b_inf.where_cond(&zeros, &a_inf.where_cond(&ones, &wb)?)?;
    // a = -inf: b's lse (-inf too when both are); b = -inf: a's.
    let lse = a_inf.where_cond(&lse_b, &b_inf.where_cond(lse_a, &lse)?)?;
    // Weights [b, h, n] -> [b, n, h, 1], to scale the rows of o.
    let rows = |w: Tensor| w.transpose(1, 2)?.unsqueeze(3);
    let o = (o_a.broadcast_mul(&rows(wa)?)? + o_b.broadcast_mul(&rows(wb)?)?)?;
    Ok((o, lse))
}
