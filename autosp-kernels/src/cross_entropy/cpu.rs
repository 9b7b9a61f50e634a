//! The chunked linear + cross-entropy on the CPU: per chunk of rows the logits `h · Wᵀ` (candle's matmul),
//! then the log-softmax and its gradient `softmax - onehot` row by row on the host, on the vector path in
//! force; `d_hidden` chunk by chunk and `d_lm_head` as a running sum in chunk order (deterministic). Inputs
//! are checked by the door (`mod.rs`); the targets are read on the host and refused here when out of range.

use candle_core::{CpuStorage, DType, InplaceOp3, Layout, Tensor};
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

/// `g * (softmax(x) - onehot(target))` of each row of a chunk's logits, 0 for ignored rows.
fn chunk_dlogits<T: Real>(logits: &[T], vocab: usize, targets: &[i64], g: T, path: SimdPath) -> Vec<T> {
    let mut dl = vec![T::ZERO; logits.len()];
    dl.par_chunks_mut(vocab).zip(logits.par_chunks(vocab).zip(targets.par_iter())).for_each(|(dr, (row, &t))| {
        if t < 0 {
            return;
        }
        let m = T::max_row(path, row);
        let sum = T::exp_row(path, dr, row, m);
        let scale = g / sum;
        for d in dr.iter_mut() {
            *d *= scale;
        }
        dr[t as usize] -= g;
    });
    dl
}

/// The loss sum (f64) and, when `grad` is given, `(d_hidden, d_lm_head)` scaled by it (`d_lm_head` only when
/// `weight`: a frozen head skips its product); all in `T`.
fn run_typed<T: Real>(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &[i64],
    chunk_rows: usize,
    grad: Option<f64>,
    weight: bool,
) -> Result<(f64, super::LossGrads)> {
    let (m, _) = hidden.dims2()?;
    let vocab = lm_head.dim(0)?;
    let wt = lm_head.t()?;
    let mut total = 0.0f64;
    let mut dh_chunks = Vec::new();
    let mut dw: Option<Tensor> = None;
    let mut start = 0;
    while start < m {
        let rows = chunk_rows.min(m - start);
        let h = hidden.narrow(0, start, rows)?;
        let logits = h.matmul(&wt)?;
        let tg = &targets[start..start + rows];
        match grad {
            None => {
                let logits = logits.contiguous()?;
                let host = Host::new(OP, "logits", &logits)?;
                total += chunk_losses::<T>(host.slice()?, vocab, tg, simd_path()).iter().sum::<f64>();
            }
            Some(g) => {
                let dl = {
                    let logits = logits.contiguous()?;
                    let host = Host::new(OP, "logits", &logits)?;
                    chunk_dlogits::<T>(host.slice()?, vocab, tg, T::from_f64(g), simd_path())
                };
                drop(logits);
                let dl = tensor_from(dl, (rows, vocab))?;
                dh_chunks.push(dl.matmul(lm_head)?);
                // `d_lm_head += dlᵀ · h` in place (gemm reading its destination): no whole `[vocab, hidden]`
                // product or sum besides the accumulator (1 GiB each at a 128K vocabulary and hidden 2048 in
                // f32). The first chunk's product is the accumulator, owned by nothing else.
                match &dw {
                    _ if !weight => {}
                    Some(acc) => acc.inplace_op3(&dl, &h, &AccumulateProduct)?,
                    None => dw = Some(dl.t()?.matmul(&h)?),
                }
            }
        }
        start += rows;
    }
    let grads = match grad {
        None => None,
        Some(_) => {
            let dh = if dh_chunks.is_empty() { hidden.zeros_like()? } else { Tensor::cat(&dh_chunks, 0)? };
            let dw = match dw {
                Some(dw) => Some(dw),
                None if weight => Some(lm_head.zeros_like()?),
                None => None,
            };
            Some((dh, dw))
        }
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

/// `acc += xᵀ · y` in place with gemm (the engine behind candle's CPU matmul), for `acc: [vocab, hidden]`
/// contiguous, `x: [rows, vocab]` and `y: [rows, hidden]` (any strides), f32 or f64: the running sum of
/// `d_lm_head`.
struct AccumulateProduct;

impl InplaceOp3 for AccumulateProduct {
    fn name(&self) -> &'static str {
        "chunked_cross_entropy_accumulate_product"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let (&[m, n], &[k, m2], &[k2, n2]) = (l1.dims(), l2.dims(), l3.dims()) else {
            candle_core::bail!("{OP}: d_lm_head's sum needs 2-d operands");
        };
        if m2 != m || k2 != k || n2 != n || !l1.is_contiguous() {
            candle_core::bail!("{OP}: d_lm_head {:?} += {:?}ᵀ · {:?} does not fit", l1.dims(), l2.dims(), l3.dims());
        }
        let (xs, ys) = (l2.stride(), l3.stride());
        let parallelism = match rayon::current_num_threads() {
            1 => gemm::Parallelism::None,
            t => gemm::Parallelism::Rayon(t),
        };
        macro_rules! run {
            ($acc:expr, $x:expr, $y:expr, $one:expr) => {
                // SAFETY: the pointers are offset by each layout's start and read or written within its dims
                // and strides (checked above against one another), and `acc` is borrowed mutably alone.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        $acc[l1.start_offset()..].as_mut_ptr(),
                        1,
                        n as isize,
                        true,
                        $x[l2.start_offset()..].as_ptr(),
                        xs[0] as isize,
                        xs[1] as isize,
                        $y[l3.start_offset()..].as_ptr(),
                        ys[1] as isize,
                        ys[0] as isize,
                        $one,
                        $one,
                        false,
                        false,
                        false,
                        parallelism,
                    )
                }
            };
        }
        match (s1, s2, s3) {
            (CpuStorage::F32(a), CpuStorage::F32(x), CpuStorage::F32(y)) => run!(a, x, y, 1.0f32),
            (CpuStorage::F64(a), CpuStorage::F64(x), CpuStorage::F64(y)) => run!(a, x, y, 1.0f64),
            _ => candle_core::bail!("{OP}: d_lm_head's sum and its operands must all be f32 or all f64"),
        }
        Ok(())
    }
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
        let d0 = chunk_dlogits(&logits, vocab, &targets, 0.5, SimdPath::Scalar);
        let dscale = d0.iter().fold(0f32, |m, v| m.max(v.abs()));
        for p in supported_paths() {
            let l = chunk_losses(&logits, vocab, &targets, p);
            for (a, b) in l.iter().zip(&l0) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{p}: loss {a} vs {b}");
            }
            let d = chunk_dlogits(&logits, vocab, &targets, 0.5, p);
            let e = d.iter().zip(&d0).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / dscale;
            assert!(e <= 1e-6, "{p}: dlogits max relative error {e:e}");
        }
    }
}
