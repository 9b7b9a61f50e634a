//! RoPE inverse frequencies per dimension pair, with linear and llama3 scaling applied exactly as HF
//! transformers does (`_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
//! `_compute_llama3_parameters` in `modeling_rope_utils.py`).

use crate::config::{LlamaConfig, RopeScaling};

/// Inverse frequency of each rotated pair: `inv_freq[i] = theta^(-2i / head_dim)` for `i in 0..head_dim/2`,
/// then scaled. Returns `[head_dim / 2]` values; the angle of pair `i` at position `p` is `p * inv_freq[i]`.
///
/// Computed in f64 and returned in f64; transformers computes in f32, so the two agree to f32 rounding.
pub fn rope_inv_freq(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f64> {
    let base: Vec<f64> = (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect();
    match scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
        Some(&RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
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
    }
}

impl LlamaConfig {
    /// This config's RoPE inverse frequencies, `[head_dim / 2]` (see [`rope_inv_freq`]).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling.as_ref())
    }

    /// The RoPE inverse frequencies of the sliding-window layers when they have a base of their own (Gemma 3's
    /// `rope_local_base_freq`, unscaled), else `None`: they use [`rope_inv_freq`](Self::rope_inv_freq).
    pub fn rope_inv_freq_local(&self) -> Option<Vec<f64>> {
        self.rope_local_theta.map(|theta| rope_inv_freq(self.head_dim, theta, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_by_hand() {
        // head_dim 4, theta 10000: pairs i=0,1 -> 1, 10000^(-1/2) = 0.01.
        let f = rope_inv_freq(4, 10000.0, None);
        assert_eq!(f.len(), 2);
        assert!((f[0] - 1.0).abs() < 1e-15);
        assert!((f[1] - 0.01).abs() < 1e-15);
    }

    #[test]
    fn linear_divides_by_factor() {
        let f = rope_inv_freq(4, 10000.0, Some(&RopeScaling::Linear { factor: 4.0 }));
        assert!((f[0] - 0.25).abs() < 1e-15);
        assert!((f[1] - 0.0025).abs() < 1e-15);
    }

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
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 1024,
        };
        let f = rope_inv_freq(8, 10000.0, Some(&s));
        assert!((f[0] - 1.0).abs() < 1e-12);
        assert!((f[1] - 0.1).abs() < 1e-12);
        let smooth: f64 = (1024.0 / 628.318_530_717_958_6 - 1.0) / 3.0;
        assert!((smooth - 0.209_915_5).abs() < 1e-6);
        assert!((f[2] - 0.003_086_761).abs() < 1e-9, "{}", f[2]);
        assert!((f[3] - 0.000_125).abs() < 1e-15);
    }
}
