//! AdamW: Adam with decoupled weight decay and bias correction (PyTorch's `torch.optim.AdamW`). Moments
//! are kept in f32 (f64 for f64 parameters) whatever the parameter dtype. Mixed precision: a bf16/f16
//! parameter also gets an f32 master copy of its weights in the optimiser state; every step updates the
//! master in f32 and writes the master rounded to the parameter's dtype into the [`Param`], so the small
//! updates that bf16 would round away accumulate in the master. f32/f64 parameters have no copy.
//!
//! The update runs through the kernel dispatch ([`crate::dispatch`]): the in-place CPU kernel (`cpu.rs`) for
//! CPU tensors, the candle-op kernel (`generic.rs`) elsewhere or when the generic kernels are forced; the
//! dtypes come from [`Precision`].

mod coefficients;
mod cpu;
mod generic;

use std::collections::HashMap;

use candle_core::Tensor;

use super::Optimizer;
use crate::dispatch::{select, Route};
use crate::precision::Precision;
use crate::{Error, Gradients, Param, ParamId, Result};
use coefficients::Coefficients;

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

/// AdamW state: step count, the two moments of every parameter, the f32 master weights of every
/// bf16/f16 parameter, and the parameters weight decay skips.
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    step: u64,
    moments: HashMap<ParamId, (Tensor, Tensor)>,
    masters: HashMap<ParamId, Tensor>,
    no_decay: std::collections::HashSet<ParamId>,
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
        Ok(Self { cfg, step: 0, moments: HashMap::new(), masters: HashMap::new(), no_decay: Default::default() })
    }

    /// Updates `params` without weight decay from now on (norms, biases and embeddings in fine-tuning, as
    /// PyTorch's parameter groups with `weight_decay=0` do); the others keep the config's.
    pub fn skip_decay(&mut self, params: &[Param]) {
        self.no_decay.extend(params.iter().map(Param::id));
    }

    /// Whether `p` is updated without weight decay ([`skip_decay`](Self::skip_decay)).
    pub fn skips_decay(&self, p: &Param) -> bool {
        self.no_decay.contains(&p.id())
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

    /// Restores a parameter's moments and the step count (resuming from a checkpoint), moved to the
    /// parameter's device. The optimiser updates its moments in place on the CPU, so it takes its own copies
    /// of `m` and `v`. For a sharded
    /// parameter, whole-shaped moments are cut to this rank's slice (a resume onto any mesh or sharding level
    /// reads the same whole moments).
    pub fn set_state(&mut self, step: u64, p: &Param, m: Tensor, v: Tensor) -> Result<()> {
        self.step = step;
        // The moments live where the parameter does (a checkpoint is read on the host).
        let device = p.tensor().device().clone();
        let (m, v) = (m.to_device(&device)?, v.to_device(&device)?);
        let (m, v) = match p.shard() {
            Some(s) if m.dims() == s.shape.dims() => (s.slice(&m)?, s.slice(&v)?),
            _ => (m.copy()?, v.copy()?),
        };
        self.moments.insert(p.id(), (m, v));
        Ok(())
    }

    /// The f32 master weights of a bf16/f16 parameter `p` (its shape; this rank's slice `[chunk]` when `p` is
    /// sharded), once the optimiser has one:
    /// after its first step with a gradient for `p`, or after [`set_master`](Self::set_master). `None` for
    /// f32/f64 parameters (the parameter is its own master). Later steps update it in place on the CPU:
    /// copy it to keep a snapshot.
    pub fn master(&self, p: &Param) -> Option<&Tensor> {
        self.masters.get(&p.id())
    }

    /// Sets the f32 master weights of the bf16/f16 parameter `p` (resuming from a checkpoint, or starting
    /// from weights more precise than the parameter, such as an f32 checkpoint trained in bf16) and writes
    /// `master` rounded to the parameter's dtype into `p`, so the two agree. Takes its own copy. Fails for
    /// f32/f64 parameters (they have no master: restore the parameter itself) and on a shape mismatch. A
    /// sharded parameter takes `master` whole-shaped (keeping this rank's slice of it) or as this rank's slice
    /// `[chunk]`, and is written through [`Param::set_update`] (collective below `Parameters`: every rank sets
    /// every master in one order).
    pub fn set_master(&mut self, p: &Param, master: &Tensor) -> Result<()> {
        let w = p.tensor();
        let precision = Precision::float(w.dtype());
        if !precision.needs_master() {
            return Err(Error::Optimizer {
                msg: format!(
                    "parameter `{}` is {:?} and has no master copy: set the parameter's own weights instead",
                    p.name(),
                    w.dtype()
                ),
            });
        }
        let shard = p.shard();
        let slice_given = shard.as_ref().is_some_and(|s| master.dims() == [s.layout.chunk]);
        if master.dims() != p.shape().dims() && !slice_given {
            return Err(Error::Optimizer {
                msg: format!(
                    "the master weights of `{}` have shape {:?} but the parameter has {:?}: they belong to another model",
                    p.name(),
                    master.dims(),
                    p.shape().dims()
                ),
            });
        }
        let master = master.to_dtype(precision.master())?.to_device(w.device())?;
        let master = match shard {
            Some(s) if !slice_given => s.slice(&master)?,
            _ => master.copy()?,
        };
        p.set_update(master.to_dtype(w.dtype())?)?;
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
        let plain = Coefficients { decay: 1.0, ..k };
        for p in super::distinct(params) {
            let Some(g) = grads.get(p) else { continue };
            let k = if self.no_decay.contains(&p.id()) { &plain } else { &k };
            // The whole parameter, or this rank's slice of a sharded one (the gradients are slices then).
            let w = p.update_view()?;
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
            let precision = Precision::float(w.dtype());
            let gf = g.to_dtype(precision.master())?;
            let (m, v) = match self.moments.remove(&p.id()) {
                Some(mv) => mv,
                None => (gf.zeros_like()?, gf.zeros_like()?),
            };
            let route = select(&w);
            let (m, v) = if precision.needs_master() {
                // Mixed precision: the update runs on the f32 master; the parameter gets it rounded.
                let master = match self.masters.remove(&p.id()) {
                    Some(master) => master,
                    None => w.to_dtype(precision.master())?,
                };
                let (master, m, v) = match route {
                    Route::Cpu => cpu::update_master(master, &gf, m, v, k)?,
                    Route::Generic => generic::update(&master, &gf, m, v, k)?,
                };
                p.set_update(master.to_dtype(w.dtype())?)?;
                self.masters.insert(p.id(), master);
                (m, v)
            } else {
                let (new, m, v) = match route {
                    Route::Cpu => cpu::update(&w, &gf, m, v, k)?,
                    Route::Generic => generic::update(&w, &gf, m, v, k)?,
                };
                p.set_update(new)?;
                (m, v)
            };
            self.moments.insert(p.id(), (m, v));
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
            let a = generic::update(&w, &g, m.copy().unwrap(), v.copy().unwrap(), &k).unwrap();
            let b = cpu::update(&w, &g, m.copy().unwrap(), v.copy().unwrap(), &k).unwrap();
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
        let a = generic::update(&w, &g, m.copy().unwrap(), v.copy().unwrap(), &k).unwrap();
        let b = cpu::update_master(w.copy().unwrap(), &g, m.copy().unwrap(), v.copy().unwrap(), &k).unwrap();
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

    /// `AUTOSP_KERNELS=generic` reaches the optimiser: a step under the forced generic kernels gives the CPU
    /// kernel's bits (f32, and bf16 with its master).
    #[test]
    fn the_generic_update_runs_through_the_dispatch_and_matches_the_cpu_one() {
        use crate::dispatch::{generic_calls, with_kernels, Kernels};
        for dtype in [DType::F32, DType::BF16] {
            let run = |kernels: Kernels| {
                let p = Param::new("w", p32(&[6, 9], 31).to_dtype(dtype).unwrap());
                let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
                with_kernels(kernels, || {
                    for s in 0..3 {
                        let mut grads = Gradients::new();
                        grads.insert(&p, p32(&[6, 9], 40 + s));
                        opt.step(std::slice::from_ref(&p), &grads, 1e-2).unwrap();
                    }
                });
                let (m, v) = opt.moments(&p).unwrap();
                (f64s(&p.tensor()), f64s(m), f64s(v), opt.master(&p).map(f64s))
            };
            let before = generic_calls();
            let generic = run(Kernels::Generic);
            assert!(generic_calls() >= before + 3, "the forced steps must select the generic kernel");
            assert_eq!(run(Kernels::Auto), generic, "{dtype:?}");
        }
    }

    #[test]
    fn parameters_that_skip_decay_are_updated_as_with_no_decay() {
        let grads_of = |p: &Param| {
            let mut g = Gradients::new();
            g.insert(p, (p.tensor() * 0.5).unwrap());
            g
        };
        let w = p32(&[3, 4], 7);
        let decayed = Param::new("w", w.clone());
        let skipped = Param::new("norm.weight", w.clone());
        let reference = Param::new("r", w);
        let cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
        let mut opt = AdamW::new(cfg).unwrap();
        opt.skip_decay(std::slice::from_ref(&skipped));
        let mut no_decay = AdamW::new(AdamWConfig { weight_decay: 0.0, ..cfg }).unwrap();
        for _ in 0..3 {
            let mut both = grads_of(&decayed);
            both.insert(&skipped, (skipped.tensor() * 0.5).unwrap());
            opt.step(&[decayed.clone(), skipped.clone()], &both, 1e-2).unwrap();
            no_decay.step(std::slice::from_ref(&reference), &grads_of(&reference), 1e-2).unwrap();
        }
        assert!(opt.skips_decay(&skipped) && !opt.skips_decay(&decayed));
        assert_eq!(f64s(&skipped.tensor()), f64s(&reference.tensor()), "skipped: as with weight_decay 0");
        assert_ne!(f64s(&decayed.tensor()), f64s(&reference.tensor()), "the others decay");
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
