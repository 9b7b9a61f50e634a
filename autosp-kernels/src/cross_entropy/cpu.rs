//! The chunked linear + cross-entropy on the CPU: per chunk of rows the logits `h · Wᵀ`, then the
//! log-softmax (forward) or its gradient `g · (softmax - onehot)` (backward) row by row on the host, on the
//! vector path in force and in place in the logits; backward then writes `d_hidden`'s rows of the chunk and
//! adds the chunk's `dlogitsᵀ · h` into `d_lm_head`. Inputs are checked by the door (`mod.rs`); the targets
//! are read on the host and refused here when out of range.
//!
//! The three products run on gemm (the engine behind candle's CPU matmul) with explicit strides, straight
//! into buffers made once per call: the logits of one chunk (reused by every chunk, so no chunk allocates or
//! faults in fresh pages), `d_hidden` (each chunk writes its rows: no per-chunk tensors to concatenate) and
//! `d_lm_head` (accumulated in place, chunks in order: deterministic). At the bench preset (vocabulary 32000,
//! hidden 512, 8K tokens) the chunks' fresh `[rows, vocab]` logits and gradients were 7.5 GB allocated per step
//! (docs/BENCHMARKS.md "Step profile").

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use autosp_core::ops::IGNORE_INDEX;
use autosp_core::simd::{simd_path, SimdPath};
use autosp_core::{Error, Precision, Result};

use crate::host::{tensor_from, Host};
use crate::vector::Real;

const OP: &str = "chunked_cross_entropy";

/// The targets as i64, checked against the vocabulary.
fn target_ids(targets: &Tensor, vocab: usize) -> Result<Vec<i64>> {
    let t = targets.to_dtype(DType::I64)?.to_vec1::<i64>()?;
    if let Some(&bad) = t.iter().find(|&&t| t >= vocab as i64) {
        return Err(Error::InvalidArgument {
            op: OP,
            msg: format!("target {bad} is out of range for {vocab} classes (use {IGNORE_INDEX} to ignore a position)"),
        });
    }
    Ok(t)
}

/// Per-row loss `lse - x[target]` (0 for ignored rows) of a chunk's logits `[rows, vocab]`, in f64.
fn chunk_losses<T: Real>(logits: &[T], vocab: usize, targets: &[i64], path: SimdPath) -> Vec<f64> {
    logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            if t < 0 {
                return 0.0;
            }
            let m = T::max_row(path, row);
            let lse = T::exp_sum_row(path, row, m).ln() + m;
            (lse - row[t as usize]).to_f64()
        })
        .collect()
}

/// In place, each row of a chunk's logits `[rows, vocab]` becomes `g * (softmax(x) - onehot(target))`, 0 for
/// ignored rows; returns each row's loss `lse - x[target]` (0 for ignored rows) in f64, from the same pass.
fn chunk_dlogits<T: Real>(logits: &mut [T], vocab: usize, targets: &[i64], g: T, path: SimdPath) -> Vec<f64> {
    logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            if t < 0 {
                row.fill(T::ZERO);
                return 0.0;
            }
            let picked = row[t as usize];
            let m = T::max_row(path, row);
            let sum = T::exp_row(path, row, m);
            T::scale_row(path, row, g / sum);
            row[t as usize] -= g;
            (sum.ln() + m - picked).to_f64()
        })
        .collect()
}

/// `dst[m × n] (+)= lhs[m × k] · rhs[k × n]` on gemm, each operand given by its pointer and `(row stride,
/// column stride)` in elements; `accumulate` adds to `dst` instead of overwriting it.
///
/// # Safety
/// Every pointer valid for the elements its strides address, `dst` written by nothing else meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn product<T: Real + 'static>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const T,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const T,
    (rhs_rs, rhs_cs): (usize, usize),
) {
    let parallelism = match rayon::current_num_threads() {
        1 => gemm::Parallelism::None,
        t => gemm::Parallelism::Rayon(t),
    };
    let one = T::from_f64(1.0);
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_rs as isize,
        accumulate,
        lhs,
        lhs_cs as isize,
        lhs_rs as isize,
        rhs,
        rhs_cs as isize,
        rhs_rs as isize,
        one,
        one,
        false,
        false,
        false,
        parallelism,
    )
}

/// The loss sum (f64) and, when `grad` is given, `(d_hidden, d_lm_head)` scaled by it (`d_lm_head` only when
/// `weight`: a frozen head skips its product), from one pass over the chunks; all in `T`. `hidden: [m, d]` and `lm_head: [vocab, d]` are
/// contiguous `T`.
fn run_typed<T: Real + candle_core::WithDType + 'static>(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &[i64],
    chunk_rows: usize,
    grad: Option<f64>,
    weight: bool,
) -> Result<(f64, super::LossGrads)> {
    let (m, d) = hidden.dims2()?;
    let vocab = lm_head.dim(0)?;
    let (h_host, w_host) = (Host::new(OP, "hidden", hidden)?, Host::new(OP, "lm_head", lm_head)?);
    let (h, w) = (h_host.slice::<T>()?, w_host.slice::<T>()?);
    let path = simd_path();
    let chunk_rows = chunk_rows.min(m).max(1);
    let mut logits = vec![T::ZERO; chunk_rows * vocab];
    let mut total = 0.0f64;
    let (mut dh, mut dw) = match grad {
        Some(_) => (vec![T::ZERO; m * d], if weight { vec![T::ZERO; vocab * d] } else { Vec::new() }),
        None => (Vec::new(), Vec::new()),
    };
    let mut start = 0;
    while start < m {
        let rows = chunk_rows.min(m - start);
        let (hc, tg) = (&h[start * d..(start + rows) * d], &targets[start..start + rows]);
        let lc = &mut logits[..rows * vocab];
        // SAFETY (every product below): the slices hold exactly the elements their strides address, and each
        // destination is a distinct buffer borrowed mutably for the call.
        // logits [rows, vocab] = h_c [rows, d] · Wᵀ [d, vocab].
        unsafe { product((rows, vocab, d), lc.as_mut_ptr(), vocab, false, hc.as_ptr(), (d, 1), w.as_ptr(), (1, d)) };
        match grad {
            None => total += chunk_losses::<T>(lc, vocab, tg, path).iter().sum::<f64>(),
            Some(g) => {
                total += chunk_dlogits::<T>(lc, vocab, tg, T::from_f64(g), path).iter().sum::<f64>();
                let dhc = &mut dh[start * d..(start + rows) * d];
                // d_hidden's rows [rows, d] = dlogits [rows, vocab] · W [vocab, d].
                unsafe {
                    product((rows, d, vocab), dhc.as_mut_ptr(), d, false, lc.as_ptr(), (vocab, 1), w.as_ptr(), (d, 1))
                };
                if weight {
                    // d_lm_head [vocab, d] += dlogitsᵀ [vocab, rows] · h_c [rows, d].
                    unsafe {
                        product(
                            (vocab, d, rows),
                            dw.as_mut_ptr(),
                            d,
                            true,
                            lc.as_ptr(),
                            (1, vocab),
                            hc.as_ptr(),
                            (d, 1),
                        )
                    };
                }
            }
        }
        start += rows;
    }
    let grads = match grad {
        None => None,
        Some(_) => Some((tensor_from(dh, (m, d))?, weight.then(|| tensor_from(dw, (vocab, d))).transpose()?)),
    };
    Ok((total, grads))
}

/// The loss sum (f64) of checked inputs and, when `grad` is given, `(d_hidden, d_lm_head)` scaled by it in
/// the dtypes of hidden and lm_head (`d_lm_head` only when `weight`). Out-of-range targets are refused here,
/// as they are read on the host.
pub(crate) fn run(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    vocab: usize,
    chunk_rows: usize,
    grad: Option<f64>,
    weight: bool,
) -> Result<(f64, super::LossGrads)> {
    let ids = target_ids(targets, vocab)?;
    let cd = Precision::float(hidden.dtype()).compute();
    let (h, w) = (hidden.to_dtype(cd)?.contiguous()?, lm_head.to_dtype(cd)?.contiguous()?);
    let (loss, grads) = match cd {
        DType::F64 => run_typed::<f64>(&h, &w, &ids, chunk_rows, grad, weight)?,
        _ => run_typed::<f32>(&h, &w, &ids, chunk_rows, grad, weight)?,
    };
    let grads = match grads {
        Some((dh, dw)) => Some((dh.to_dtype(hidden.dtype())?, dw.map(|d| d.to_dtype(lm_head.dtype())).transpose()?)),
        None => None,
    };
    Ok((loss, grads))
}

#[cfg(test)]
mod tests {
    use autosp_core::simd::{supported_paths, SimdPath};

    use super::{chunk_dlogits, chunk_losses};

    /// Every vector path against the scalar path on f32 rows of 1003 logits in [-10, 10] (a tail shorter than
    /// a vector), one row ignored: the vector `e^x` is within ~2 ulp of libm's and the sums run in another
    /// order, so the losses (~5) agree to 1e-6 relative and the gradients to 1e-6 relative to the largest
    /// (max relative error); a wrong term would be off by ~1e-3 or more.
    #[test]
    fn vector_paths_match_scalar() {
        let (rows, vocab) = (4, 1003);
        let logits: Vec<f32> = (0..rows * vocab).map(|i| ((i * 7919) % 2001) as f32 / 100.0 - 10.0).collect();
        let targets = [5, -100, 1002, 640];
        let l0 = chunk_losses(&logits, vocab, &targets, SimdPath::Scalar);
        let dlogits = |p| {
            let mut d = logits.clone();
            let losses = chunk_dlogits(&mut d, vocab, &targets, 0.5, p);
            // The gradient pass's losses are the loss pass's.
            for (a, b) in losses.iter().zip(&chunk_losses(&logits, vocab, &targets, p)) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{p}: loss {a} vs {b}");
            }
            d
        };
        let d0 = dlogits(SimdPath::Scalar);
        let dscale = d0.iter().fold(0f32, |m, v| m.max(v.abs()));
        for p in supported_paths() {
            let l = chunk_losses(&logits, vocab, &targets, p);
            for (a, b) in l.iter().zip(&l0) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{p}: loss {a} vs {b}");
            }
            let d = dlogits(p);
            let e = d.iter().zip(&d0).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / dscale;
            assert!(e <= 1e-6, "{p}: dlogits max relative error {e:e}");
        }
    }
}
