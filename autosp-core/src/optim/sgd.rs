//! SGD with optional momentum and (coupled, L2) weight decay, as `torch.optim.SGD`.

use std::collections::HashMap;

use candle_core::Tensor;

use super::Optimizer;
use crate::{Error, Gradients, Param, ParamId, Result};

/// SGD state.
#[derive(Debug)]
pub struct Sgd {
    momentum: f64,
    weight_decay: f64,
    buffers: HashMap<ParamId, Tensor>,
}

impl Sgd {
    /// SGD with `momentum` in [0, 1) and `weight_decay` >= 0.
    pub fn new(momentum: f64, weight_decay: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&momentum) || weight_decay < 0.0 {
            return Err(Error::Optimizer {
                msg: format!("SGD needs 0 <= momentum < 1 and weight_decay >= 0, got {momentum} and {weight_decay}"),
            });
        }
        Ok(Self { momentum, weight_decay, buffers: HashMap::new() })
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[Param], grads: &Gradients, lr: f64) -> Result<()> {
        for p in super::distinct(params) {
            let Some(g) = grads.get(p) else { continue };
            let w = p.tensor();
            let mut d = g.to_dtype(w.dtype())?;
            if self.weight_decay > 0.0 {
                d = (d + (&w * self.weight_decay)?)?;
            }
            if self.momentum > 0.0 {
                d = match self.buffers.remove(&p.id()) {
                    Some(b) => ((b * self.momentum)? + d)?,
                    None => d,
                };
                self.buffers.insert(p.id(), d.clone());
            }
            p.set((w - (d * lr)?)?)?;
        }
        Ok(())
    }
}
