//! Learning-rate schedules: constant, and linear warm-up followed by cosine decay.

use crate::{Error, Result};

/// The learning rate as a function of the (0-based) step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    /// The same rate every step.
    Constant(f64),
    /// Rises linearly from `peak / warmup` to `peak` over `warmup` steps, then follows a half cosine down to
    /// `min_lr` at `total` steps, and stays there.
    WarmupCosine { peak: f64, min_lr: f64, warmup: usize, total: usize },
}

impl LrSchedule {
    /// Checks the schedule's numbers.
    pub fn validate(&self) -> Result<()> {
        let ok = match *self {
            LrSchedule::Constant(lr) => lr >= 0.0 && lr.is_finite(),
            LrSchedule::WarmupCosine { peak, min_lr, warmup, total } => {
                peak >= min_lr && min_lr >= 0.0 && peak.is_finite() && warmup <= total
            }
        };
        if ok {
            Ok(())
        } else {
            Err(Error::Optimizer {
                msg: format!("invalid schedule {self:?}: need 0 <= min_lr <= peak and warmup <= total"),
            })
        }
    }

    /// The rate at `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        match *self {
            LrSchedule::Constant(lr) => lr,
            LrSchedule::WarmupCosine { peak, min_lr, warmup, total } => {
                if step < warmup {
                    return peak * (step + 1) as f64 / warmup as f64;
                }
                let span = total.saturating_sub(warmup).max(1);
                let progress = ((step - warmup) as f64 / span as f64).min(1.0);
                min_lr + 0.5 * (peak - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}
