//! `dynamic` RoPE scaling (dynamic NTK), transformers' `_compute_dynamic_ntk_parameters` with its
//! `dynamic_rope_update` for one forward pass: inside `max_position_embeddings` the default frequencies;
//! past it, the base grows to `theta * (factor * len / max_pos - (factor - 1))^(d / (d - 2))`, where `len`
//! is the length of the sequence the forward sees (`max(position_ids) + 1`).
//!
//! So the same token gets other angles at another length: a model trained with it computes other positions
//! at serving time unless served at the training length. (Transformers' module also keeps the largest
//! length it has seen until a sequence shorter than the window comes; here each forward is computed on its
//! own, as a fresh transformers model computes it.)

use super::default_inv_freq;

/// The dynamic-NTK inverse frequencies `[head_dim / 2]` for a forward over `seq_len` tokens.
pub(super) fn inv_freq(
    head_dim: usize,
    theta: f64,
    factor: f64,
    max_position_embeddings: usize,
    seq_len: usize,
) -> Vec<f64> {
    let (len, window) = (seq_len.max(max_position_embeddings) as f64, max_position_embeddings as f64);
    let dim = head_dim as f64;
    let base = theta * (factor * len / window - (factor - 1.0)).powf(dim / (dim - 2.0));
    default_inv_freq(head_dim, base)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inside_the_window_it_is_the_default() {
        for len in [0, 1, 32] {
            assert_eq!(inv_freq(8, 1e4, 4.0, 32, len), default_inv_freq(8, 1e4));
        }
    }

    #[test]
    fn past_the_window_the_base_grows_by_hand() {
        // len 96, window 32, factor 2: 2 * 3 - 1 = 5; d = 8: base = 1e4 * 5^(8/6).
        let base = 1e4 * 5f64.powf(8.0 / 6.0);
        let f = inv_freq(8, 1e4, 2.0, 32, 96);
        for (i, x) in f.iter().enumerate() {
            assert!((x - base.powf(-(2.0 * i as f64) / 8.0)).abs() < 1e-15);
        }
    }
}
