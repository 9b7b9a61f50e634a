//! Optimisers (AdamW, SGD), clipping by global norm, learning-rate schedules and f16 loss scaling.

pub mod adamw;
pub mod clip;
pub mod loss_scale;
pub mod schedule;
pub mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, clip_to_norm, global_norm, sum_of_squares};
pub use loss_scale::{LossScaler, ScaleStep};
pub use schedule::LrSchedule;
pub use sgd::Sgd;

use crate::{Gradients, Param, Result};

/// An optimiser updates parameters in place (it swaps in new tensors) from their gradients.
pub trait Optimizer {
    /// One update with learning rate `lr`; parameters without a gradient are left alone, and a parameter
    /// listed more than once (tied weights) is updated once.
    fn step(&mut self, params: &[Param], grads: &Gradients, lr: f64) -> Result<()>;
}

/// `params` without repeats (by [`Param::id`]), in first-seen order: what one optimiser step updates.
fn distinct(params: &[Param]) -> impl Iterator<Item = &Param> {
    let mut seen = std::collections::HashSet::new();
    params.iter().filter(move |p| seen.insert(p.id()))
}
