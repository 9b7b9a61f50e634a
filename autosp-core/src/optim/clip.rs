//! Clipping gradients by their global L2 norm (as `torch.nn.utils.clip_grad_norm_`).

use candle_core::{DType, Tensor};

use crate::host_read::read_f64s;
use crate::{Error, Gradients, Result};

/// The sum of the squares of every element of `grads`, with one host read whatever the number of
/// parameters: each gradient's squares summed on its device in f32 (f64 for f64 gradients; candle's sums
/// reduce pairwise on a GPU), the per-parameter sums stacked and read back together, and added in f64 on the
/// host in parameter order (deterministic). No f64 on the device (Metal has none).
pub fn sum_of_squares(grads: &Gradients) -> Result<f64> {
    let sorted = grads.sorted();
    // f64 only where the gradients already are (a device with f64 tensors has f64).
    let dtype = if sorted.iter().any(|(_, g)| g.dtype() == DType::F64) { DType::F64 } else { DType::F32 };
    let mut sums = Vec::with_capacity(sorted.len());
    for (_, g) in sorted {
        sums.push(g.to_dtype(dtype)?.sqr()?.sum_all()?.reshape(1)?);
    }
    if sums.is_empty() {
        return Ok(0.0);
    }
    Ok(read_f64s(&Tensor::cat(&sums, 0)?)?.iter().sum())
}

/// The L2 norm of all gradients together ([`sum_of_squares`]: one host read).
pub fn global_norm(grads: &Gradients) -> Result<f64> {
    Ok(sum_of_squares(grads)?.sqrt())
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
