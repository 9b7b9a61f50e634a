//! The `default` RoPE frequencies, transformers' `compute_default_rope_parameters`: `theta^(-2i / d)`.

/// Inverse frequency of each rotated pair: `theta^(-2i / head_dim)` for `i in 0..head_dim / 2`
/// (`[head_dim / 2]`, f64); the core's function, which every scaling starts from.
pub use autosp_core::ops::rope::default_inv_freq;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_by_hand() {
        // head_dim 4, theta 10000: pairs i=0,1 -> 1, 10000^(-1/2) = 0.01.
        let f = default_inv_freq(4, 10000.0);
        assert_eq!(f.len(), 2);
        assert!((f[0] - 1.0).abs() < 1e-15);
        assert!((f[1] - 0.01).abs() < 1e-15);
    }
}
