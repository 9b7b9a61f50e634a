//! Dynamic loss scaling for f16 training (as `torch.amp.GradScaler`). The loss a step differentiates is
//! divided by its token count, so each token's share of a gradient is about `1 / tokens`: 1e-4 at 8K tokens and
//! below f16's smallest normal number (6.1e-5) at 32K, where f16 gradients lose their precision or vanish.
//! The step multiplies the loss by a power of two, `scale`, before backward (so f16 gradients sit in f16's
//! range), and the f32 gradients are divided by it after the all-reduce (exact: a power of two). A step whose
//! gradients overflowed (a non-finite norm with a finite loss) is skipped and the scale halved; after
//! `growth_interval` good steps in a row it is doubled again. bf16 has f32's exponent range and needs none.

use crate::{Error, Result};

/// The scale a run starts from: 2^16, PyTorch's.
pub const INIT_SCALE: f64 = 65536.0;
/// Good steps in a row before the scale doubles: 2000, PyTorch's.
pub const GROWTH_INTERVAL: u32 = 2000;
/// The largest scale (2^24): beyond it even a gradient of 1 would overflow f16 at its first multiplication.
const MAX_SCALE: f64 = 16_777_216.0;

/// The scaler's state: the current scale and the good steps since it last changed (all a resumed run needs
/// to go on exactly).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    scale: f64,
    growth_interval: u32,
    good: u32,
    skipped: u64,
}

/// What [`LossScaler::update`] decided about a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleStep {
    /// The gradients were finite: apply the step.
    Apply,
    /// The gradients overflowed at this scale: skip the step; the scale is halved.
    Overflow,
    /// The gradients are not finite although the scale is already below 1: they would overflow unscaled too
    /// (a diverged run, not an f16 overflow), so the caller's non-finite policy decides.
    Diverged,
}

impl LossScaler {
    /// A scaler starting at `scale` (a power of two in `1..=2^24`) that doubles after `growth_interval` (at
    /// least 1) good steps in a row.
    pub fn new(scale: f64, growth_interval: u32) -> Result<Self> {
        let power_of_two = scale.is_finite() && scale > 0.0 && scale.log2().fract() == 0.0;
        if !power_of_two || !(1.0..=MAX_SCALE).contains(&scale) || growth_interval == 0 {
            return Err(Error::Optimizer {
                msg: format!(
                    "a loss scale must be a power of two from 1 to 2^24 with a growth interval of at least 1 step, \
                     got {scale} and {growth_interval} (PyTorch's are {INIT_SCALE} and {GROWTH_INTERVAL})"
                ),
            });
        }
        Ok(Self { scale, growth_interval, good: 0, skipped: 0 })
    }

    /// A scaler restored from a checkpoint: `scale` and the good steps since it last changed.
    pub fn restored(scale: f64, growth_interval: u32, good: u32) -> Result<Self> {
        let mut s = Self::new(scale.clamp(1.0, MAX_SCALE), growth_interval)?;
        s.good = good % growth_interval;
        Ok(s)
    }

    /// The factor the loss is multiplied by before backward.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Good steps since the scale last changed.
    pub fn good_steps(&self) -> u32 {
        self.good
    }

    /// Steps skipped for overflow since this scaler was made.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// After a step's backward: `finite` is whether the (scaled) gradients were all finite. Halves the scale
    /// on an overflow, doubles it after `growth_interval` good steps in a row (up to 2^24).
    pub fn update(&mut self, finite: bool) -> ScaleStep {
        if finite {
            self.good += 1;
            if self.good >= self.growth_interval {
                self.good = 0;
                self.scale = (self.scale * 2.0).min(MAX_SCALE);
            }
            return ScaleStep::Apply;
        }
        self.good = 0;
        if self.scale < 1.0 {
            return ScaleStep::Diverged;
        }
        self.scale *= 0.5;
        self.skipped += 1;
        ScaleStep::Overflow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_halves_and_good_steps_double() {
        let mut s = LossScaler::new(8.0, 3).unwrap();
        assert_eq!(s.update(false), ScaleStep::Overflow);
        assert_eq!((s.scale(), s.skipped()), (4.0, 1));
        assert_eq!(s.update(true), ScaleStep::Apply);
        assert_eq!(s.update(true), ScaleStep::Apply);
        assert_eq!(s.scale(), 4.0);
        assert_eq!(s.update(true), ScaleStep::Apply);
        assert_eq!((s.scale(), s.good_steps()), (8.0, 0), "doubled after 3 good steps in a row");
        // An overflow resets the run of good steps.
        s.update(true);
        s.update(false);
        assert_eq!((s.scale(), s.good_steps()), (4.0, 0));
        // Below 1 a non-finite gradient is a divergence, not an overflow.
        let mut one = LossScaler::new(1.0, 5).unwrap();
        assert_eq!(one.update(false), ScaleStep::Overflow);
        assert_eq!(one.scale(), 0.5);
        assert_eq!(one.update(false), ScaleStep::Diverged);
        // Never above 2^24.
        let mut top = LossScaler::new(MAX_SCALE, 1).unwrap();
        top.update(true);
        assert_eq!(top.scale(), MAX_SCALE);
        let r = LossScaler::restored(1024.0, 2000, 7).unwrap();
        assert_eq!((r.scale(), r.good_steps()), (1024.0, 7));
    }

    #[test]
    fn bad_settings_are_refused() {
        for (scale, interval) in [(3.0, 10), (0.0, 10), (f64::NAN, 10), (2f64.powi(25), 10), (0.5, 10), (4.0, 0)] {
            let e = LossScaler::new(scale, interval).unwrap_err().to_string();
            assert!(e.contains("power of two"), "{e}");
        }
    }
}
