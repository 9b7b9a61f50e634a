//! AdamW: Adam with decoupled weight decay and bias correction (PyTorch's `torch.optim.AdamW`). Moments
//! are kept in f32 (f64 for f64 parameters) whatever the parameter dtype. Mixed precision: a bf16/f16
//! parameter also gets an f32 master copy of its weights in the optimiser state; every step updates the
//! master in f32 and writes the master rounded to the parameter's dtype into the [`Param`], so the small
//! updates that bf16 would round away accumulate in the master. f32/f64 parameters have no copy.

use std::collections::HashMap;

use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor};

use super::Optimizer;
use crate::ops::attention::accum_dtype;
use crate::{Error, Gradients, Param, ParamId, Result};

/// AdamW hyper-parameters (PyTorch's defaults but weight decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

/// AdamW state: step count, the two moments of every parameter, and the f32 master weights of every
/// bf16/f16 parameter.
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    step: u64,
    moments: HashMap<ParamId, (Tensor, Tensor)>,
    masters: HashMap<ParamId, Tensor>,
}

/// The dtype of the master weights and moments of a parameter of `dtype`: f32 for bf16, f16 and f32, f64
/// for f64.
pub fn master_dtype(dtype: DType) -> DType {
    accum_dtype(dtype)
}

/// Whether a parameter of `dtype` gets an f32 master copy (bf16 and f16 do; f32 and f64 are their own
/// master).
pub fn needs_master(dtype: DType) -> bool {
    master_dtype(dtype) != dtype
}

impl AdamW {
    /// A fresh optimiser; fails on out-of-range hyper-parameters.
    pub fn new(cfg: AdamWConfig) -> Result<Self> {
        let ok = (0.0..1.0).contains(&cfg.beta1)
            && (0.0..1.0).contains(&cfg.beta2)
            && cfg.eps > 0.0
            && cfg.weight_decay >= 0.0;
        if !ok {
            return Err(Error::Optimizer {
                msg: format!("AdamW needs 0 <= beta1, beta2 < 1, eps > 0 and weight_decay >= 0, got {cfg:?}"),
            });
        }
        Ok(Self { cfg, step: 0, moments: HashMap::new(), masters: HashMap::new() })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The first and second moments of `p` (after at least one step with a gradient for it). Later steps
    /// update them in place on the CPU: copy them to keep a snapshot.
    pub fn moments(&self, p: &Param) -> Option<(&Tensor, &Tensor)> {
        self.moments.get(&p.id()).map(|(m, v)| (m, v))
    }

    /// Restores a parameter's moments and the step count (resuming from a checkpoint). The optimiser
    /// updates its moments in place on the CPU, so it takes its own copies of `m` and `v`.
    pub fn set_state(&mut self, step: u64, p: &Param, m: Tensor, v: Tensor) -> Result<()> {
        self.step = step;
        self.moments.insert(p.id(), (m.copy()?, v.copy()?));
        Ok(())
    }

    /// The f32 master weights of a bf16/f16 parameter `p` (same shape as `p`), once the optimiser has one:
    /// after its first step with a gradient for `p`, or after [`set_master`](Self::set_master). `None` for
    /// f32/f64 parameters (the parameter is its own master). Later steps update it in place on the CPU:
    /// copy it to keep a snapshot.
    pub fn master(&self, p: &Param) -> Option<&Tensor> {
        self.masters.get(&p.id())
    }

    /// Sets the f32 master weights of the bf16/f16 parameter `p` (resuming from a checkpoint, or starting
    /// from weights more precise than the parameter, such as an f32 checkpoint trained in bf16) and writes
    /// `master` rounded to the parameter's dtype into `p`, so the two agree. Takes its own copy. Fails for
    /// f32/f64 parameters (they have no master: restore the parameter itself) and on a shape mismatch.
    pub fn set_master(&mut self, p: &Param, master: &Tensor) -> Result<()> {
        let w = p.tensor();
        if !needs_master(w.dtype()) {
            return Err(Error::Optimizer {
                msg: format!(
                    "parameter `{}` is {:?} and has no master copy: set the parameter's own weights instead",
                    p.name(),
                    w.dtype()
                ),
            });
        }
        if master.dims() != w.dims() {
            return Err(Error::Optimizer {
                msg: format!(
                    "the master weights of `{}` have shape {:?} but the parameter has {:?}: they belong to another model",
                    p.name(),
                    master.dims(),
                    w.dims()
                ),
            });
        }
        let master = master.to_dtype(accum_dtype(w.dtype()))?.to_device(w.device())?.copy()?;
        p.set(master.to_dtype(w.dtype())?)?;
        self.masters.insert(p.id(), master);
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[Param], grads: &Gradients, lr: f64) -> Result<()> {
        self.step += 1;
        let c = self.cfg;
        let k = Coefficients {
            beta1: c.beta1,
            beta2: c.beta2,
            bc1: 1.0 - c.beta1.powi(self.step as i32),
            bc2: 1.0 - c.beta2.powi(self.step as i32),
            eps: c.eps,
            lr,
            decay: 1.0 - lr * c.weight_decay,
        };
        for p in super::distinct(params) {
            let Some(g) = grads.get(p) else { continue };
            let w = p.tensor();
            if g.dims() != w.dims() {
                return Err(Error::Optimizer {
                    msg: format!(
                        "the gradient of `{}` has shape {:?} but the parameter has {:?}",
                        p.name(),
                        g.dims(),
                        w.dims()
                    ),
                });
            }
            let acc = accum_dtype(w.dtype());
            let gf = g.to_dtype(acc)?;
            let (m, v) = match self.moments.remove(&p.id()) {
                Some(mv) => mv,
                None => (gf.zeros_like()?, gf.zeros_like()?),
            };
            let (m, v) = if needs_master(w.dtype()) {
                // Mixed precision: the update runs on the f32 master; the parameter gets it rounded.
                let master = match self.masters.remove(&p.id()) {
                    Some(master) => master,
                    None => w.to_dtype(acc)?,
                };
                let (master, m, v) = if w.device().is_cpu() {
                    update_master_in_place(master, &gf, m, v, &k)?
                } else {
                    update_with_tensor_ops(&master, &gf, m, v, &k)?
                };
                p.set(master.to_dtype(w.dtype())?)?;
                self.masters.insert(p.id(), master);
                (m, v)
            } else {
                let (new, m, v) = if w.device().is_cpu() {
                    update_in_place(&w, &gf, m, v, &k)?
                } else {
                    update_with_tensor_ops(&w, &gf, m, v, &k)?
                };
                p.set(new)?;
                (m, v)
            };
            self.moments.insert(p.id(), (m, v));
        }
        Ok(())
    }
}

/// One step's scalars.
#[derive(Clone, Copy, Debug)]
struct Coefficients {
    beta1: f64,
    beta2: f64,
    /// Bias corrections `1 - beta^t`.
    bc1: f64,
    bc2: f64,
    eps: f64,
    lr: f64,
    /// `1 - lr * weight_decay`.
    decay: f64,
}

/// The update on any device with candle ops: `(new weights, m, v)`. Allocates several weight-sized
/// temporaries; the CPU path below allocates one.
fn update_with_tensor_ops(
    wf: &Tensor,
    gf: &Tensor,
    m: Tensor,
    v: Tensor,
    k: &Coefficients,
) -> Result<(Tensor, Tensor, Tensor)> {
    let m = ((m * k.beta1)? + (gf * (1.0 - k.beta1))?)?;
    let v = ((v * k.beta2)? + (gf.sqr()? * (1.0 - k.beta2))?)?;
    let update = ((&m / k.bc1)? / ((&v / k.bc2)?.sqrt()? + k.eps)?)?;
    let new = ((wf * k.decay)? - (update * k.lr)?)?;
    Ok((new, m, v))
}

/// The update on the CPU: the moments (owned by the optimiser) are updated in place and the new weights are
/// written into one fresh copy, element by element in the same arithmetic as [`update_with_tensor_ops`]
/// (bit for bit: tested).
/// Peak extra memory: one weight-sized tensor (the update of a 16M-parameter embedding would otherwise hold
/// about six such temporaries at once).
fn update_in_place(
    wf: &Tensor,
    gf: &Tensor,
    m: Tensor,
    v: Tensor,
    k: &Coefficients,
) -> Result<(Tensor, Tensor, Tensor)> {
    update_master_in_place(wf.copy()?, gf, m, v, k)
}

/// [`update_in_place`] on the optimiser's own f32 master copy: the master itself is updated, no copy.
fn update_master_in_place(
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
    use crate::gradcheck::probe;
    use candle_core::{DType, Device};

    #[test]
    fn in_place_update_equals_the_tensor_op_update_bit_for_bit() {
        let k = Coefficients {
            beta1: 0.9,
            beta2: 0.999,
            bc1: 1.0 - 0.9f64.powi(3),
            bc2: 1.0 - 0.999f64.powi(3),
            eps: 1e-8,
            lr: 1e-3,
            decay: 1.0 - 1e-3 * 0.01,
        };
        for dtype in [DType::F32, DType::F64] {
            let t = |seed| probe(&[7, 33], seed, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let (w, g, m, v) = (t(1), t(2), t(3), t(4).sqr().unwrap());
            let a = update_with_tensor_ops(&w, &g, m.copy().unwrap(), v.copy().unwrap(), &k).unwrap();
            let b = update_in_place(&w, &g, m.copy().unwrap(), v.copy().unwrap(), &k).unwrap();
            for (x, y) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
                let d = x.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
                let e = y.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
                assert_eq!(d, e, "{dtype:?}");
            }
            // The weights passed in are not modified (the update writes a copy).
            assert_eq!(
                w.to_dtype(DType::F64).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap(),
                t(1).to_dtype(DType::F64).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
            );
        }
    }

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

    /// A deterministic f32 probe tensor.
    fn p32(shape: &[usize], seed: u64) -> Tensor {
        probe(shape, seed, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
    }

    fn f64s(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
    }

    #[test]
    fn master_in_place_update_equals_the_tensor_op_update_bit_for_bit() {
        let k = Coefficients { beta1: 0.9, beta2: 0.999, bc1: 0.1, bc2: 0.001, eps: 1e-8, lr: 1e-3, decay: 1.0 - 1e-5 };
        let t = |seed| p32(&[5, 19], seed);
        let (w, g, m, v) = (t(1), t(2), t(3), t(4).sqr().unwrap());
        let a = update_with_tensor_ops(&w, &g, m.copy().unwrap(), v.copy().unwrap(), &k).unwrap();
        let b = update_master_in_place(w.copy().unwrap(), &g, m.copy().unwrap(), v.copy().unwrap(), &k).unwrap();
        for (x, y) in [(&a.0, &b.0), (&a.1, &b.1), (&a.2, &b.2)] {
            assert_eq!(f64s(x), f64s(y));
        }
    }

    /// A bf16 parameter trained with AdamW keeps an f32 master (f32 moments too); the parameter is always
    /// the master rounded to bf16; updates far below bf16's resolution accumulate in the master. An f32
    /// parameter has no master and trains exactly as before.
    #[test]
    fn half_parameters_get_an_f32_master_and_f32_parameters_do_not() {
        for half in [DType::BF16, DType::F16] {
            let w0 = p32(&[4, 6], 11);
            let p = Param::new("w", w0.to_dtype(half).unwrap());
            // The same start in f32: the master must take exactly its steps.
            let start = w0.to_dtype(half).unwrap().to_dtype(DType::F32).unwrap();
            let q = Param::new("q", start.clone());
            // lr 1e-5: each step moves a weight by about 1e-5, far below bf16's spacing near 1 (2^-7).
            let mut opt = AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() }).unwrap();
            let mut opt_f32 = AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() }).unwrap();
            let g = p32(&[4, 6], 12);
            for _ in 0..50 {
                let mut grads = Gradients::new();
                // Gradients in the parameter's dtype are accepted as well as f32 ones.
                grads.insert(&p, g.to_dtype(half).unwrap());
                opt.step(std::slice::from_ref(&p), &grads, 1e-5).unwrap();
                let mut grads = Gradients::new();
                grads.insert(&q, g.to_dtype(half).unwrap().to_dtype(DType::F32).unwrap());
                opt_f32.step(std::slice::from_ref(&q), &grads, 1e-5).unwrap();
            }
            let master = opt.master(&p).expect("a bf16/f16 parameter has a master copy");
            assert_eq!(master.dtype(), DType::F32);
            let (m, v) = opt.moments(&p).unwrap();
            assert_eq!((m.dtype(), v.dtype()), (DType::F32, DType::F32));
            assert_eq!(p.tensor().dtype(), half);
            assert_eq!(f64s(&p.tensor()), f64s(&master.to_dtype(half).unwrap()));
            // The master took exactly the f32 parameter's steps, and they moved it although each step is far
            // below the parameter dtype's resolution.
            assert_eq!(f64s(master), f64s(&q.tensor()));
            let moved = f64s(&(master - &start).unwrap());
            assert!(moved.iter().all(|d| d.abs() > 1e-4), "the test needs visible movement: {moved:?}");
            assert!(opt_f32.master(&q).is_none(), "f32 parameters are their own master");
        }
    }

    #[test]
    fn set_master_restores_and_rounds_the_parameter() {
        let w = p32(&[3, 5], 21);
        let p = Param::new("w", w.to_dtype(DType::BF16).unwrap());
        let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
        let exact = (&w * 1.001).unwrap();
        opt.set_master(&p, &exact).unwrap();
        assert_eq!(f64s(opt.master(&p).unwrap()), f64s(&exact));
        assert_eq!(f64s(&p.tensor()), f64s(&exact.to_dtype(DType::BF16).unwrap()));
        // A step continues from the restored master, not from the rounded parameter.
        let mut grads = Gradients::new();
        grads.insert(&p, Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap());
        opt.step(std::slice::from_ref(&p), &grads, 0.5).unwrap();
        let want = f64s(&(&exact * (1.0 - 0.5 * 0.01)).unwrap());
        assert_eq!(f64s(opt.master(&p).unwrap()), want);
        let f = Param::new("f", w.clone());
        let e = opt.set_master(&f, &w).unwrap_err().to_string();
        assert!(e.contains("no master copy"), "{e}");
        let e = opt.set_master(&p, &w.narrow(0, 0, 2).unwrap()).unwrap_err().to_string();
        assert!(e.contains("another model"), "{e}");
    }
}
