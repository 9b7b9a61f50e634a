//! Merging partial attention results of the same queries over disjoint key sets by their LSE (Ring
//! attention), in f32 (f64 for f64 inputs), in the numerically stable form of ALGORITHMS.md:
//!
//! ```text
//! lse = max(a, b) + log1p(exp(-|a - b|)),   O = exp(a - lse)·O_a + exp(b - lse)·O_b
//! ```
//!
//! A side with LSE = -inf (its rows saw no key) has weight 0: merging it gives the other side unchanged.
//!
//! This file is the op's door: [`RunningAttention`] picks the kernel per merge, the CPU loop (`cpu.rs`) for
//! CPU tensors, the candle-op kernel (`generic.rs`) elsewhere.

mod cpu;
mod generic;

use autosp_core::dispatch::{select, Route};
use candle_core::{DType, Tensor};

/// The running merge of partial results for a block of query rows: `o: [b, n, h, d]`, `lse: [b, h, n]`.
#[derive(Debug)]
pub struct RunningAttention {
    o: Tensor,
    lse: Tensor,
    out_dtype: DType,
}

impl RunningAttention {
    /// Starts from the first partial result (`o` in the inputs' dtype, `lse` in f32 or f64).
    pub fn new(o: &Tensor, lse: &Tensor) -> candle_core::Result<Self> {
        let acc = lse.dtype();
        Ok(Self { o: o.to_dtype(acc)?, lse: lse.clone(), out_dtype: o.dtype() })
    }

    /// Merges another partial result for the same rows (over other keys) into this one: `o: [b, n, h, d]`,
    /// `lse: [b, h, n]`.
    pub fn merge(&mut self, o: &Tensor, lse: &Tensor) -> candle_core::Result<()> {
        let acc = self.lse.dtype();
        let (o, lse) = (o.to_dtype(acc)?, lse.to_dtype(acc)?);
        (self.o, self.lse) = match select(&self.o) {
            Route::Cpu => match acc {
                DType::F64 => cpu::merge::<f64>(&self.o, &self.lse, &o, &lse)?,
                _ => cpu::merge::<f32>(&self.o, &self.lse, &o, &lse)?,
            },
            Route::Generic => generic::merge(&self.o, &self.lse, &o, &lse)?,
        };
        Ok(())
    }

    /// The merged `(o` in the inputs' dtype`, lse)`.
    pub fn finish(self) -> candle_core::Result<(Tensor, Tensor)> {
        Ok((self.o.to_dtype(self.out_dtype)?, self.lse))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use autosp_core::ops::attention::{naive_attention_forward, AttentionSpec};
    use candle_core::Device;

    #[test]
    fn merging_two_key_halves_equals_attention_over_all_keys() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (1, 5, 2, 4), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, 8, 2, 4), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, 8, 2, 4), &dev)?;
        let spec = AttentionSpec::full();
        let (o, lse) = naive_attention_forward(&q, &k, &v, &spec).unwrap();
        let (oa, la) = naive_attention_forward(&q, &k.narrow(1, 0, 3)?, &v.narrow(1, 0, 3)?, &spec).unwrap();
        let (ob, lb) = naive_attention_forward(&q, &k.narrow(1, 3, 5)?, &v.narrow(1, 3, 5)?, &spec).unwrap();
        let mut run = RunningAttention::new(&oa, &la)?;
        // A side that saw no key (lse = -inf) changes nothing.
        run.merge(&ob.zeros_like()?, &lb.ones_like()?.affine(0., f64::NEG_INFINITY)?)?;
        run.merge(&ob, &lb)?;
        let (om, lm) = run.finish()?;
        let err =
            |a: &Tensor, b: &Tensor| -> candle_core::Result<f32> { (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar() };
        // Two f32 merges of values of size ~1: a few ulps.
        assert!(err(&o, &om)? < 1e-5 && err(&lse, &lm)? < 1e-5);
        Ok(())
    }
}
