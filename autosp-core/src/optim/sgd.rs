//! SGD with optional momentum and (coupled, L2) weight decay, as `torch.optim.SGD`. Like AdamW, the
//! update and the momentum buffers are in f32 (f64 for f64 parameters), and a bf16/f16 parameter gets an
//! f32 master copy of its weights that the steps update; the parameter holds the master rounded to its dtype.

use std::collections::HashMap;

use candle_core::Tensor;

use super::Optimizer;
use crate::precision::Precision;
use crate::{Error, Gradients, Param, ParamId, Result};

/// SGD state: momentum buffers, and the f32 master weights of bf16/f16 parameters.
#[derive(Debug)]
pub struct Sgd {
    momentum: f64,
    weight_decay: f64,
    buffers: HashMap<ParamId, Tensor>,
    masters: HashMap<ParamId, Tensor>,
}

impl Sgd {
    /// SGD with `momentum` in [0, 1) and `weight_decay` >= 0.
    pub fn new(momentum: f64, weight_decay: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&momentum) || weight_decay < 0.0 {
            return Err(Error::Optimizer {
                msg: format!("SGD needs 0 <= momentum < 1 and weight_decay >= 0, got {momentum} and {weight_decay}"),
            });
        }
        Ok(Self { momentum, weight_decay, buffers: HashMap::new(), masters: HashMap::new() })
    }

    /// The f32 master weights of a bf16/f16 parameter after its first step (`None` for f32/f64 ones).
    pub fn master(&self, p: &Param) -> Option<&Tensor> {
        self.masters.get(&p.id())
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[Param], grads: &Gradients, lr: f64) -> Result<()> {
        for p in super::distinct(params) {
            let Some(g) = grads.get(p) else { continue };
            // The whole parameter, or this rank's slice of a sharded one (the gradients are slices then).
            let w = p.update_view()?;
            let precision = Precision::float(w.dtype());
            let half = precision.needs_master();
            let wf = match self.masters.remove(&p.id()) {
                Some(master) => master,
                None => w.to_dtype(precision.master())?,
            };
            let mut d = g.to_dtype(wf.dtype())?;
            if self.weight_decay > 0.0 {
                d = (d + (&wf * self.weight_decay)?)?;
            }
            if self.momentum > 0.0 {
                d = match self.buffers.remove(&p.id()) {
                    Some(b) => ((b * self.momentum)? + d)?,
                    None => d,
                };
                self.buffers.insert(p.id(), d.clone());
            }
            let new = (wf - (d * lr)?)?;
            if half {
                p.set_update(new.to_dtype(w.dtype())?)?;
                self.masters.insert(p.id(), new);
            } else {
                p.set_update(new)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::probe;
    use candle_core::{DType, Device};

    fn p32(shape: &[usize], seed: u64) -> Tensor {
        probe(shape, seed, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
    }

    fn f64s(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
    }

    #[test]
    fn sgd_keeps_an_f32_master_for_half_parameters() {
        let w0 = p32(&[4, 6], 31);
        let p = Param::new("w", w0.to_dtype(DType::BF16).unwrap());
        let mut sgd = Sgd::new(0.9, 0.0).unwrap();
        let g = p32(&[4, 6], 32);
        for _ in 0..20 {
            let mut grads = Gradients::new();
            grads.insert(&p, g.clone());
            sgd.step(std::slice::from_ref(&p), &grads, 1e-6).unwrap();
        }
        let master = sgd.master(&p).unwrap();
        assert_eq!(master.dtype(), DType::F32);
        assert_eq!(f64s(&p.tensor()), f64s(&master.to_dtype(DType::BF16).unwrap()));
        // 20 steps of 1e-6 * g with momentum 0.9 moved the master by more than 1e-5 per unit of |g|, which
        // bf16 alone would have rounded away entirely.
        let start = w0.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let moved = f64s(&(master - &start).unwrap());
        let gs = f64s(&g);
        for (d, g) in moved.iter().zip(&gs) {
            if g.abs() > 0.1 {
                assert!(d * g < 0.0 && d.abs() > 1e-5 * g.abs(), "moved {d} for gradient {g}");
            }
        }
    }
}
