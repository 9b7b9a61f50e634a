//! AdamW's update on the CPU: the moments (owned by the optimiser) are updated in place and the new weights
//! written into one fresh copy (or into the optimiser's own master copy), element by element in the generic
//! kernel's arithmetic (bit for bit: tested), the f32 loops on the vector path in force ([`crate::simd`]).

use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout, Tensor};

use super::coefficients::Coefficients;
use crate::Result;

/// The update on the CPU: the moments (owned by the optimiser) are updated in place and the new weights are
/// written into one fresh copy, element by element in the same arithmetic as the generic kernel
/// (bit for bit: tested).
/// Peak extra memory: one weight-sized tensor (the update of a 16M-parameter embedding would otherwise hold
/// about six such temporaries at once).
pub(crate) fn update(
    wf: &Tensor,
    gf: &Tensor,
    m: Tensor,
    v: Tensor,
    k: &Coefficients,
) -> Result<(Tensor, Tensor, Tensor)> {
    update_master(wf.copy()?, gf, m, v, k)
}

/// [`update`] on the optimiser's own f32 master copy: the master itself is updated, no copy.
pub(crate) fn update_master(
    master: Tensor,
    gf: &Tensor,
    m: Tensor,
    v: Tensor,
    k: &Coefficients,
) -> Result<(Tensor, Tensor, Tensor)> {
    let gf = gf.contiguous()?;
    m.inplace_op2(&gf, &Moment { beta: k.beta1, square: false })?;
    v.inplace_op2(&gf, &Moment { beta: k.beta2, square: true })?;
    master.inplace_op3(&m, &v, &Weights(*k))?;
    Ok((master, m, v))
}

/// The element range of a contiguous layout.
fn range(l: &Layout, what: &str) -> candle_core::Result<std::ops::Range<usize>> {
    let (a, b) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("adamw: {what} must be contiguous")))?;
    Ok(a..b)
}

/// The moment dtypes (f32, f64): candle's arithmetic plus a square root, and the vector versions of the two
/// loops on the vector path in force ([`crate::simd`]; f32 only, `false` when they did not run).
trait MomentFloat: candle_core::WithDType {
    fn root(self) -> Self;

    /// [`Moment::run`]'s loop on a vector path; `false` (nothing done) when there is none.
    fn moment_simd(_m: &mut [Self], _g: &[Self], _b: Self, _one_b: Self, _square: bool) -> bool {
        false
    }

    /// [`Weights::run`]'s loop on a vector path, `c = [1/bc1, 1/bc2, eps, lr, decay]`; `false` (nothing
    /// done) when there is none.
    fn weights_simd(_w: &mut [Self], _m: &[Self], _v: &[Self], _c: [Self; 5]) -> bool {
        false
    }
}

impl MomentFloat for f32 {
    fn root(self) -> Self {
        self.sqrt()
    }
    fn moment_simd(m: &mut [f32], g: &[f32], b: f32, one_b: f32, square: bool) -> bool {
        crate::simd::vectorize(crate::simd::simd_path(), MomentF32 { m, g, b, one_b, square }).is_some()
    }
    fn weights_simd(w: &mut [f32], m: &[f32], v: &[f32], c: [f32; 5]) -> bool {
        crate::simd::vectorize(crate::simd::simd_path(), WeightsF32 { w, m, v, c }).is_some()
    }
}

impl MomentFloat for f64 {
    fn root(self) -> Self {
        self.sqrt()
    }
}

/// `m <- beta m + (1 - beta) g` (or with `g^2` for the second moment), in place.
struct Moment {
    beta: f64,
    square: bool,
}

impl Moment {
    fn run<T: MomentFloat>(&self, m: &mut [T], g: &[T]) {
        let (b, one_b) = (T::from_f64(self.beta), T::from_f64(1.0 - self.beta));
        if T::moment_simd(m, g, b, one_b, self.square) {
            return;
        }
        for (m, &g) in m.iter_mut().zip(g) {
            let g = if self.square { g * g } else { g };
            *m = *m * b + g * one_b;
        }
    }
}

/// [`Moment`] on f32 with pulp (AVX2+FMA, NEON): the scalar arithmetic lane by lane, unfused, so the bits
/// are the scalar loop's.
struct MomentF32<'a> {
    m: &'a mut [f32],
    g: &'a [f32],
    b: f32,
    one_b: f32,
    square: bool,
}

impl pulp::WithSimd for MomentF32<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, s: S) {
        let MomentF32 { m, g, b, one_b, square } = self;
        let ((mh, mt), (gh, gt)) = (S::as_mut_simd_f32s(m), S::as_simd_f32s(g));
        let (bv, obv) = (s.splat_f32s(b), s.splat_f32s(one_b));
        for (m, &g) in mh.iter_mut().zip(gh) {
            let g = if square { s.mul_f32s(g, g) } else { g };
            *m = s.add_f32s(s.mul_f32s(*m, bv), s.mul_f32s(g, obv));
        }
        for (m, &g) in mt.iter_mut().zip(gt) {
            let g = if square { g * g } else { g };
            *m = *m * b + g * one_b;
        }
    }
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw_moment"
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<()> {
        let (r1, r2) = (range(l1, "moment")?, range(l2, "gradient")?);
        match (s1, s2) {
            (CpuStorage::F32(m), CpuStorage::F32(g)) => self.run(&mut m[r1], &g[r2]),
            (CpuStorage::F64(m), CpuStorage::F64(g)) => self.run(&mut m[r1], &g[r2]),
            _ => candle_core::bail!("adamw: moment and gradient must both be f32 or both f64"),
        }
        Ok(())
    }
}

/// `w <- decay w - lr (m / bc1) / (sqrt(v / bc2) + eps)`, in place on a fresh copy of the weights.
struct Weights(Coefficients);

impl Weights {
    fn run<T: MomentFloat>(&self, w: &mut [T], m: &[T], v: &[T]) {
        let k = &self.0;
        let f = T::from_f64;
        // candle's `tensor / scalar` multiplies by the reciprocal: the same here, for the same bits.
        let (ibc1, ibc2, eps, lr, decay) = (f(1.0 / k.bc1), f(1.0 / k.bc2), f(k.eps), f(k.lr), f(k.decay));
        if T::weights_simd(w, m, v, [ibc1, ibc2, eps, lr, decay]) {
            return;
        }
        for ((w, &m), &v) in w.iter_mut().zip(m).zip(v) {
            let update = (m * ibc1) / ((v * ibc2).root() + eps);
            *w = *w * decay - update * lr;
        }
    }
}

/// [`Weights`] on f32 with pulp (AVX2+FMA, NEON): the scalar arithmetic lane by lane (IEEE division and
/// square root, no fused multiply-add), so the bits are the scalar loop's and candle's. `c` holds
/// `[1/bc1, 1/bc2, eps, lr, decay]`.
struct WeightsF32<'a> {
    w: &'a mut [f32],
    m: &'a [f32],
    v: &'a [f32],
    c: [f32; 5],
}

impl pulp::WithSimd for WeightsF32<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, s: S) {
        let WeightsF32 { w, m, v, c } = self;
        let ((wh, wt), (mh, mt), (vh, vt)) = (S::as_mut_simd_f32s(w), S::as_simd_f32s(m), S::as_simd_f32s(v));
        let [ibc1, ibc2, eps, lr, decay] = c.map(|x| s.splat_f32s(x));
        for ((w, &m), &v) in wh.iter_mut().zip(mh).zip(vh) {
            let update = s.div_f32s(s.mul_f32s(m, ibc1), s.add_f32s(s.sqrt_f32s(s.mul_f32s(v, ibc2)), eps));
            *w = s.sub_f32s(s.mul_f32s(*w, decay), s.mul_f32s(update, lr));
        }
        let [ibc1, ibc2, eps, lr, decay] = c;
        for ((w, &m), &v) in wt.iter_mut().zip(mt).zip(vt) {
            let update = (m * ibc1) / ((v * ibc2).sqrt() + eps);
            *w = *w * decay - update * lr;
        }
    }
}

impl InplaceOp3 for Weights {
    fn name(&self) -> &'static str {
        "adamw_weights"
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
        let (r1, r2, r3) = (range(l1, "weights")?, range(l2, "m")?, range(l3, "v")?);
        match (s1, s2, s3) {
            (CpuStorage::F32(w), CpuStorage::F32(m), CpuStorage::F32(v)) => self.run(&mut w[r1], &m[r2], &v[r3]),
            (CpuStorage::F64(w), CpuStorage::F64(m), CpuStorage::F64(v)) => self.run(&mut w[r1], &m[r2], &v[r3]),
            _ => candle_core::bail!("adamw: weights and moments must all be f32 or all f64"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f32 vector loops on every vector path this CPU has equal the scalar loops bit for bit (the same
    /// unfused IEEE operations per element), lengths with a tail shorter than a vector included.
    #[test]
    fn vector_paths_equal_the_scalar_loops_bit_for_bit() {
        let n = 203;
        let f = |k: usize| -> Vec<f32> { (0..n).map(|i| ((i * 37 + k * 11) % 101) as f32 / 50.0 - 1.0).collect() };
        let (g, m0, v0, w0) = (f(0), f(1), f(2).iter().map(|x| x * x).collect::<Vec<_>>(), f(3));
        let c = [1.0 / 0.271f32, 1.0 / 0.002997, 1e-8, 1e-3, 1.0 - 1e-5];
        for path in crate::simd::supported_paths().into_iter().filter(|&p| p != crate::simd::SimdPath::Scalar) {
            for square in [false, true] {
                let (mut a, mut b) = (m0.clone(), m0.clone());
                assert!(
                    crate::simd::vectorize(path, MomentF32 { m: &mut a, g: &g, b: 0.9, one_b: 0.1, square }).is_some()
                );
                for (m, &g) in b.iter_mut().zip(&g) {
                    let g = if square { g * g } else { g };
                    *m = *m * 0.9 + g * 0.1;
                }
                assert_eq!(a, b, "{path}: moment, square {square}");
            }
            let (mut a, mut b) = (w0.clone(), w0.clone());
            assert!(crate::simd::vectorize(path, WeightsF32 { w: &mut a, m: &m0, v: &v0, c }).is_some());
            let [ibc1, ibc2, eps, lr, decay] = c;
            for ((w, &m), &v) in b.iter_mut().zip(&m0).zip(&v0) {
                let update = (m * ibc1) / ((v * ibc2).sqrt() + eps);
                *w = *w * decay - update * lr;
            }
            assert_eq!(a, b, "{path}: weights");
        }
    }
}
