//! `linear` RoPE scaling (position interpolation), transformers' `_compute_linear_scaling_rope_parameters`:
//! every inverse frequency divided by `factor`, which is the same as dividing the positions.

/// `base` (the default frequencies, `[head_dim / 2]`) divided by `factor`.
pub(super) fn inv_freq(base: &[f64], factor: f64) -> Vec<f64> {
    base.iter().map(|f| f / factor).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_divides_by_factor() {
        let f = inv_freq(&[1.0, 0.01], 4.0);
        assert!((f[0] - 0.25).abs() < 1e-15);
        assert!((f[1] - 0.0025).abs() < 1e-15);
    }
}
