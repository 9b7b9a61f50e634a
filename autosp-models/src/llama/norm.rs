//! The RMSNorms of a Llama-family model through autosp-kernels' fused kernel, with the family's scale
//! (`offset + weight`: Gemma's `1 + w`, see `autosp_core::nn::RmsNorm`). Gemma's scale is made in f32 for a
//! bf16/f16 model, as transformers' `Gemma3RMSNorm` computes `x̂ · (1 + w.float())` and rounds once: the kernel
//! takes that f32 scale as it is, so `x̂ · (1 + w)` is one f32 product rounded once to the storage dtype.

use autosp_core::nn::RmsNorm;
use autosp_core::{Tape, Value};

/// RMSNorm through the fused kernel (scale `offset + weight`, [`RmsNorm::scale`]): `x: [.., d]` -> `[.., d]`.
pub(crate) fn fused_norm(tape: &Tape, norm: &RmsNorm, x: &Value) -> autosp_core::Result<Value> {
    autosp_kernels::rms_norm::rms_norm(tape, x, &norm.scale(tape)?, norm.eps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use autosp_core::dispatch::{with_kernels, Kernels};
    use autosp_core::{CheckpointPolicy, Param};
    use candle_core::{DType, Device, Tensor, D};

    const EPS: f64 = 1e-6;

    /// `n` values in [-amp, amp) from a fixed sequence.
    fn values(n: usize, seed: f64, amp: f64) -> Vec<f32> {
        (0..n).map(|i| (amp * ((i as f64 + seed) * 0.7548776662).fract().mul_add(2.0, -1.0)) as f32).collect()
    }

    /// Gemma weights whose `1 + w` bf16 cannot hold: `|w| < 2^-8` (1 + w rounds to 1 in bf16, whose
    /// spacing above 1 is 2^-7) on most of the row, then larger ones.
    fn gemma_weight(d: usize) -> Tensor {
        let w: Vec<f32> = (0..d)
            .map(|i| if i % 4 == 3 { 0.3 - 0.02 * i as f32 } else { 0.0035 * (1.0 + (i % 3) as f32) / 3.0 })
            .collect();
        Tensor::from_vec(w, d, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap()
    }

    /// transformers' `Gemma3RMSNorm` of bf16 `x: [n, d]`, `w: [d]`: `(x̂ · (1 + w.float()))` in f32, and `x̂`.
    fn reference(x: &Tensor, w: &Tensor) -> (Tensor, Tensor) {
        let xf = x.to_dtype(DType::F32).unwrap();
        let r = (xf.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + EPS).unwrap().sqrt().unwrap().recip().unwrap();
        let xhat = xf.broadcast_mul(&r).unwrap();
        let s = (w.to_dtype(DType::F32).unwrap() + 1.0).unwrap();
        (xhat.broadcast_mul(&s).unwrap(), xhat)
    }

    /// Elementwise distance of bf16 `a` to `b` (f32) in units of bf16's spacing at `b` (2^-7 of `|b|`'s power
    /// of two), and how many elements of `a` are `b` rounded to bf16 exactly.
    fn ulps(a: &Tensor, b: &Tensor) -> (f32, usize) {
        let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let rounded = b.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let r = rounded.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / (2f32.powi(y.abs().max(1e-30).log2().floor() as i32 - 7)))
            .fold(0f32, f32::max);
        (worst, a.iter().zip(&r).filter(|(x, y)| x == y).count())
    }

    /// A Gemma norm on bf16 `x: [64, 48]`: the output is transformers' f32 computation rounded once (every
    /// element within half a bf16 spacing plus the f32 sum's rounding, so at most 0.51 spacings, and at least
    /// 99% bit-equal to it; the f32 sums of squares run in another order), where the old scale rounded to
    /// bf16 (`1 + 0.0035` is 1 in bf16) is more than a spacing off on many elements. The gradients: the
    /// weight's is the f32 `Σ g · x̂` rounded once (the same bound), the input's matches the f32 backward with
    /// the f32 scale to 2^-8 of its largest element. On the CPU kernel and the device-generic one.
    #[test]
    fn gemma_scale_is_made_in_f32_for_bf16() {
        let (n, d) = (64, 48);
        let x = Tensor::from_vec(values(n * d, 0.5, 3.0), (n, d), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let g = Tensor::from_vec(values(n * d, 7.0, 1.0), (n, d), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let w = gemma_weight(d);
        let (want, xhat) = reference(&x, &w);
        // Backward in f32 with the f32 scale: dw = Σ_rows g x̂; dx = (g s - x̂ mean(g s x̂)) r.
        let gf = g.to_dtype(DType::F32).unwrap();
        let want_dw = (&gf * &xhat).unwrap().sum(0).unwrap();
        let s = (w.to_dtype(DType::F32).unwrap() + 1.0).unwrap();
        let gs = gf.broadcast_mul(&s).unwrap();
        let proj = (&gs * &xhat).unwrap().mean_keepdim(D::Minus1).unwrap();
        let xf = x.to_dtype(DType::F32).unwrap();
        let r = (xf.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + EPS).unwrap().sqrt().unwrap().recip().unwrap();
        let want_dx = gs.sub(&xhat.broadcast_mul(&proj).unwrap()).unwrap().broadcast_mul(&r).unwrap();
        for k in [Kernels::Auto, Kernels::Generic] {
            with_kernels(k, || {
                let norm = RmsNorm { weight: Param::new("norm.weight", w.clone()), eps: EPS, offset: 1.0 };
                let tape = Tape::new(CheckpointPolicy::None);
                let xv = tape.leaf(x.clone());
                let y = fused_norm(&tape, &norm, &xv).unwrap();
                assert_eq!(y.tensor().dtype(), DType::BF16);
                let (worst, equal) = ulps(y.tensor(), &want);
                assert!(worst <= 0.51, "{k:?}: {worst} bf16 spacings from transformers' output");
                assert!(equal * 100 >= 99 * n * d, "{k:?}: {equal} of {} elements bit-equal", n * d);

                // The old computation: the scale rounded to bf16 before the kernel.
                let old_scale = w.affine(1.0, 1.0).unwrap();
                let old = autosp_kernels::rms_norm::rms_norm_forward(&x, &old_scale, EPS).unwrap();
                let (old_worst, old_equal) = ulps(&old, &want);
                assert!(
                    old_worst > 1.0 && old_equal * 10 < 9 * n * d,
                    "{k:?}: the old scale is off ({old_worst}, {old_equal})"
                );

                let loss = autosp_core::ops::sum_all(
                    &tape,
                    &autosp_core::ops::mul(&tape, &y, &tape.constant(g.clone())).unwrap(),
                )
                .unwrap();
                tape.backward(&loss).unwrap();
                let dw = tape.param_grads().get(&norm.weight).unwrap().clone();
                let (dw_worst, _) = ulps(&dw, &want_dw);
                assert!(dw_worst <= 0.51, "{k:?}: the weight's gradient is {dw_worst} bf16 spacings off");
                let dx = tape.grad(&xv).unwrap().unwrap().to_dtype(DType::F32).unwrap();
                let top = want_dx.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let off = (dx - &want_dx).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(off <= top / 256.0, "{k:?}: the input's gradient off by {off} (largest {top})");
            });
        }
    }

    /// In f64 the offset scale's gradient is the norm's (`d(1 + w)/dw = 1`): central differences of
    /// `Σ y · g` in each weight, to 1e-8 relative.
    #[test]
    fn gemma_weight_gradient_by_finite_differences() {
        let (n, d) = (5, 12);
        let x = Tensor::from_vec(values(n * d, 0.25, 2.0), (n, d), &Device::Cpu).unwrap().to_dtype(DType::F64).unwrap();
        let g = Tensor::from_vec(values(n * d, 3.0, 1.0), (n, d), &Device::Cpu).unwrap().to_dtype(DType::F64).unwrap();
        let w0: Vec<f64> = values(d, 9.0, 0.5).into_iter().map(f64::from).collect();
        let run = |w: &[f64], grad: bool| -> (f64, Option<Vec<f64>>) {
            let t = Tensor::from_vec(w.to_vec(), d, &Device::Cpu).unwrap();
            let norm = RmsNorm { weight: Param::new("norm.weight", t), eps: EPS, offset: 1.0 };
            let tape = Tape::new(CheckpointPolicy::None);
            let y = fused_norm(&tape, &norm, &tape.constant(x.clone())).unwrap();
            let loss =
                autosp_core::ops::sum_all(&tape, &autosp_core::ops::mul(&tape, &y, &tape.constant(g.clone())).unwrap())
                    .unwrap();
            let value = loss.tensor().to_scalar::<f64>().unwrap();
            if !grad {
                return (value, None);
            }
            tape.backward(&loss).unwrap();
            (value, Some(tape.param_grads().get(&norm.weight).unwrap().to_vec1::<f64>().unwrap()))
        };
        let dw = run(&w0, true).1.unwrap();
        let h = 1e-6;
        for i in 0..d {
            let (mut up, mut down) = (w0.clone(), w0.clone());
            up[i] += h;
            down[i] -= h;
            let fd = (run(&up, false).0 - run(&down, false).0) / (2.0 * h);
            assert!((fd - dw[i]).abs() <= 1e-8 * (1.0 + fd.abs()), "weight {i}: {} vs {fd}", dw[i]);
        }
    }
}
