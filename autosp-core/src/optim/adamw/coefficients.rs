//! One AdamW step's scalars, computed once per step by the optimiser and read by both update kernels.

/// One step's scalars.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Coefficients {
    pub beta1: f64,
    pub beta2: f64,
    /// Bias corrections `1 - beta^t`.
    pub bc1: f64,
    pub bc2: f64,
    pub eps: f64,
    pub lr: f64,
    /// `1 - lr * weight_decay`.
    pub decay: f64,
}
