//! Clipping gradients by their global L2 norm (as `torch.nn.utils.clip_grad_norm_`).

use candle_core::DType;

use crate::{Error, Gradients, Result};

/// The L2 norm of all gradients together, summed in f64 in parameter order (deterministic).
pub fn global_norm(grads: &Gradients) -> Result<f64> {
    let mut sq = 0.0f64;
    for (_, g) in grads.sorted() {
        sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    }
    Ok(sq.sqrt())
}

/// Scales all gradients by `max_norm / (norm + 1e-6)` when their global norm exceeds `max_norm`. Returns the
/// norm before clipping.
pub fn clip_grad_norm(grads: &mut Gradients, max_norm: f64) -> Result<f64> {
    let norm = global_norm(grads)?;
    clip_to_norm(grads, norm, max_norm)?;
    Ok(norm)
}

/// [`clip_grad_norm`] for a caller that already has the global norm (`norm`, from [`global_norm`]): scales
/// all gradients by `max_norm / (norm + 1e-6)` when `norm` exceeds `max_norm`, without computing it again.
pub fn clip_to_norm(grads: &mut Gradients, norm: f64, max_norm: f64) -> Result<()> {
    if max_norm.is_nan() || max_norm <= 0.0 {
        return Err(Error::Optimizer { msg: format!("max_norm must be > 0, got {max_norm}") });
    }
    if !norm.is_finite() {
        return Err(Error::Optimizer {
            msg: format!("the gradient norm is {norm}: the loss diverged or an input was not finite; lower the lr"),
        });
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        grads.scale(coef)?;
    }
    Ok(())
}
