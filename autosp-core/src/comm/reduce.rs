//! Combining the ranks' contributions element by element, always in rank order, so that whichever rank
//! does the work the result has the same bits.

use candle_core::{Result, Tensor};

use super::collective::ReduceOp;
use crate::precision::Precision;

/// `parts[0] op parts[1] op ... op parts[P-1]`, left to right. `parts`: same shape and dtype, at least one.
/// Floats accumulate in their reduction dtype ([`Precision::reduce`]: bf16 and f16 in f32, rounded once at the
/// end); integers in their own type.
pub(crate) fn reduce_in_rank_order(parts: &[Tensor], op: ReduceOp) -> Result<Tensor> {
    let dtype = parts[0].dtype();
    let acc_dtype = if dtype.is_float() { Precision::float(dtype).reduce() } else { dtype };
    let mut acc = parts[0].to_dtype(acc_dtype)?;
    for part in &parts[1..] {
        let part = part.to_dtype(acc_dtype)?;
        acc = match op {
            ReduceOp::Sum => acc.add(&part)?,
            ReduceOp::Max => acc.maximum(&part)?,
        };
    }
    acc.to_dtype(dtype)
}

/// Sizes of `p` nearly equal chunks of `n` elements: the first `n % p` chunks get one more.
pub(crate) fn chunk_sizes(n: usize, p: usize) -> Vec<usize> {
    (0..p).map(|j| n / p + usize::from(j < n % p)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn chunk_sizes_cover_n() {
        assert_eq!(chunk_sizes(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(chunk_sizes(3, 4), vec![1, 1, 1, 0]);
        assert_eq!(chunk_sizes(8, 4), vec![2, 2, 2, 2]);
    }

    #[test]
    fn sum_is_left_to_right_and_halves_accumulate_in_f32() -> Result<()> {
        let dev = Device::Cpu;
        // In f32 (spacing 8 at 1e8), (1e8 + 4) + 4 = 1e8 (ties to even) but 1e8 + (4 + 4) = 1e8 + 8:
        // the order is observable, and must be left to right.
        let parts = [Tensor::new(&[1e8f32], &dev)?, Tensor::new(&[4f32], &dev)?, Tensor::new(&[4f32], &dev)?];
        let s = reduce_in_rank_order(&parts, ReduceOp::Sum)?.to_vec1::<f32>()?;
        assert_eq!(s, vec![100_000_000f32]);
        // bf16: 256 + 1 + 1 is 258 in f32, but 256 in bf16 step by step (bf16 has 8 mantissa bits).
        let parts = [
            Tensor::new(&[256f32], &dev)?.to_dtype(DType::BF16)?,
            Tensor::new(&[1f32], &dev)?.to_dtype(DType::BF16)?,
            Tensor::new(&[1f32], &dev)?.to_dtype(DType::BF16)?,
        ];
        let s = reduce_in_rank_order(&parts, ReduceOp::Sum)?.to_dtype(DType::F32)?;
        assert_eq!(s.to_vec1::<f32>()?, vec![258.0]);
        let m = reduce_in_rank_order(&parts, ReduceOp::Max)?.to_dtype(DType::F32)?;
        assert_eq!(m.to_vec1::<f32>()?, vec![256.0]);
        Ok(())
    }
}
