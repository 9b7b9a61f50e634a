//! `llama3` RoPE scaling (Llama 3.1), transformers' `_compute_llama3_parameters`: wavelengths longer than
//! `original / low_freq_factor` divided by `factor`, shorter than `original / high_freq_factor` kept, a
//! smooth blend between.

use super::{Params, RopeScaling, ScalingContext};
use crate::error::Result;

/// Reads `factor`, `low_freq_factor`, `high_freq_factor` and `original_max_position_embeddings` (default:
/// `max_position_embeddings`, as transformers' `standardize_rope_params`).
pub(super) fn parse(p: &Params, ctx: &ScalingContext) -> Result<RopeScaling> {
    Ok(RopeScaling::Llama3 {
        factor: p.factor("factor")?,
        low_freq_factor: p.need("low_freq_factor")?,
        high_freq_factor: p.need("high_freq_factor")?,
        original_max_position_embeddings: p
            .tokens("original_max_position_embeddings")?
            .unwrap_or(ctx.max_position_embeddings),
    })
}

/// The llama3 frequencies from `base` (the default ones, `[head_dim / 2]`).
pub(super) fn inv_freq(
    base: &[f64],
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_max_position_embeddings: usize,
) -> Vec<f64> {
    let old_len = original_max_position_embeddings as f64;
    let low_freq_wavelen = old_len / low_freq_factor;
    let high_freq_wavelen = old_len / high_freq_factor;
    base.iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen > low_freq_wavelen {
                // Long wavelengths (low frequencies): fully scaled.
                f / factor
            } else if wavelen < high_freq_wavelen {
                // Short wavelengths (high frequencies): unchanged.
                f
            } else {
                // In between: blend the scaled and unscaled frequency.
                let smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::default_inv_freq;

    #[test]
    fn llama3_three_bands_by_hand() {
        // head_dim 8, theta 10000: base freqs 1, 0.1, 0.01, 0.001;
        // wavelengths 2pi/f = 6.283, 62.83, 628.3, 6283.
        // old_len 1024, low_freq_factor 1, high_freq_factor 4:
        //   low_freq_wavelen = 1024, high_freq_wavelen = 256.
        // pair 0 (6.28 < 256), pair 1 (62.8 < 256): unchanged.
        // pair 3 (6283 > 1024): 0.001 / 8 = 0.000125.
        // pair 2 (628.3, between): smooth = (1024/628.3185 - 1) / 3 = (1.629747 - 1) / 3 = 0.2099155;
        //   0.01 * ((1 - s)/8 + s) = 0.01 * (0.0987606 + 0.2099155) = 0.003086761
        let f = inv_freq(&default_inv_freq(8, 10000.0), 8.0, 1.0, 4.0, 1024);
        assert!((f[0] - 1.0).abs() < 1e-12);
        assert!((f[1] - 0.1).abs() < 1e-12);
        let smooth: f64 = (1024.0 / 628.318_530_717_958_6 - 1.0) / 3.0;
        assert!((smooth - 0.209_915_5).abs() < 1e-6);
        assert!((f[2] - 0.003_086_761).abs() < 1e-9, "{}", f[2]);
        assert!((f[3] - 0.000_125).abs() < 1e-15);
    }
}
