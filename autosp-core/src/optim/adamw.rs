//! AdamW: Adam with decoupled weight decay and bias correction (PyTorch's `torch.optim.AdamW`). Moments
//! are kept in f32 (f64 for f64 parameters) whatever the parameter dtype.

use std::collections::HashMap;

use candle_core::Tensor;

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

/// AdamW state: step count and the two moments of every parameter.
#[derive(Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    step: u64,
    moments: HashMap<ParamId, (Tensor, Tensor)>,
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
        Ok(Self { cfg, step: 0, moments: HashMap::new() })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The first and second moments of `p` (after at least one step with a gradient for it).
    pub fn moments(&self, p: &Param) -> Option<(&Tensor, &Tensor)> {
        self.moments.get(&p.id()).map(|(m, v)| (m, v))
    }

    /// Restores a parameter's moments and the step count (resuming from a checkpoint).
    pub fn set_state(&mut self, step: u64, p: &Param, m: Tensor, v: Tensor) {
        self.step = step;
        self.moments.insert(p.id(), (m, v));
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &[Param], grads: &Gradients, lr: f64) -> Result<()> {
        self.step += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        for p in params {
            let Some(g) = grads.get(p) else { continue };
            let w = p.tensor();
            let acc = accum_dtype(w.dtype());
            let (wf, gf) = (w.to_dtype(acc)?, g.to_dtype(acc)?);
            let (m, v) = match self.moments.remove(&p.id()) {
                Some(mv) => mv,
                None => (wf.zeros_like()?, wf.zeros_like()?),
            };
            let m = ((m * c.beta1)? + (&gf * (1.0 - c.beta1))?)?;
            let v = ((v * c.beta2)? + (gf.sqr()? * (1.0 - c.beta2))?)?;
            let decayed = (&wf * (1.0 - lr * c.weight_decay))?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + c.eps)?)?;
            let new = (decayed - (update * lr)?)?;
            p.set(new.to_dtype(w.dtype())?)?;
            self.moments.insert(p.id(), (m, v));
        }
        Ok(())
    }
}
