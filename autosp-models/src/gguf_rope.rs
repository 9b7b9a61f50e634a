//! RoPE scalings that llama.cpp's converter stores as tensors instead of metadata, read back into the
//! [`RopeScaling`] the HF config had:
//! - llama's `rope_freqs.weight` (Llama 3.1+ `llama3` scaling): one divisor per rotated pair, computed by
//!   `LlamaModel.generate_extra_tensors` from `factor`, `low_freq_factor`, `high_freq_factor` and
//!   `original_max_position_embeddings`, none of which the file keeps. [`llama3_from_factors`] recovers them;
//! - phi3's `rope_factors_long.weight` / `rope_factors_short.weight` (Phi-3 128K `longrope`), with
//!   `phi3.rope.scaling.attn_factor` and `phi3.rope.scaling.original_context_length` ([`longrope_from_factors`]).

use crate::config::RopeScaling;
use crate::rope::LongRope;

/// The converter's llama3 divisors for pair `i` of `head_dim` at base `theta` (its f32 frequencies).
fn llama3_factors(theta: f64, head_dim: usize, factor: f64, low: f64, high: f64, original: usize) -> Vec<f64> {
    let old = original as f64;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// The llama3 scaling whose divisors (the converter's `rope_freqs`, `[head_dim / 2]`) are `factors`, at RoPE
/// base `theta`; `Ok(None)` when every divisor is 1 (no scaling). The divisors fix `factor` (the largest one)
/// and, on the blended pairs, `original / (high - low)` and `low / (high - low)` only: the three are
/// recovered with `low_freq_factor = 1` (every Llama 3.x config's), which gives the same frequencies whatever
/// the original `low` was (scaling all three alike changes nothing); with fewer than two blended pairs,
/// Llama 3.1's `high = 4`, `original = 8192` are tried. The result is checked by recomputing the divisors;
/// `Err` (a message) when they differ by more than 1e-4 relative.
pub fn llama3_from_factors(factors: &[f64], theta: f64, head_dim: usize) -> Result<Option<RopeScaling>, String> {
    if factors.len() != head_dim / 2 {
        return Err(format!("rope_freqs has {} entries, head_dim {head_dim} needs {}", factors.len(), head_dim / 2));
    }
    let factor = factors.iter().cloned().fold(f64::MIN, f64::max);
    if factors.iter().all(|f| (f - 1.0).abs() <= 1e-6) {
        return Ok(None);
    }
    // Blended pairs: s = (1/f - 1/factor) / (1 - 1/factor) = (original * x - low) / (high - low), x = 1 / wavelen.
    let points: Vec<(f64, f64)> = factors
        .iter()
        .enumerate()
        .filter(|(_, &f)| f > 1.0 + 1e-6 && f < factor * (1.0 - 1e-6))
        .map(|(i, &f)| {
            let freq = 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32);
            let x = freq as f64 / (2.0 * std::f64::consts::PI);
            (x, (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor))
        })
        .collect();
    let (low, high, original) = if points.len() >= 2 {
        // Least squares s = a x + b: a = original / (high - low), b = -low / (high - low); low = 1.
        let n = points.len() as f64;
        let (sx, sy) = points.iter().fold((0.0, 0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
        let (mx, my) = (sx / n, sy / n);
        let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
        let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
        let a = sxy / sxx;
        let b = my - a * mx;
        if !(b < 0.0 && a > 0.0) {
            return Err("rope_freqs is not a llama3 scaling (its blended divisors do not fit one)".into());
        }
        // The fit's rounding noise off a whole high_freq_factor (4 in every Llama 3.x config) is dropped.
        let high = 1.0 - 1.0 / b;
        let high = if (high - high.round()).abs() < 1e-4 { high.round() } else { high };
        (1.0, high, (-a / b).round() as usize)
    } else {
        (1.0, 4.0, 8192)
    };
    let want = llama3_factors(theta, head_dim, factor, low, high, original);
    if let Some((i, (got, w))) =
        factors.iter().zip(&want).enumerate().find(|(_, (g, w))| (*g - *w).abs() > 1e-4 * w.abs())
    {
        return Err(format!(
            "rope_freqs[{i}] = {got} is not a llama3 scaling's divisor (factor {factor}, low_freq_factor {low}, \
             high_freq_factor {high}, original_max_position_embeddings {original} give {w})"
        ));
    }
    Ok(Some(RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: original,
    }))
}

/// Phi-3's longrope from the converter's `rope_factors_short` / `rope_factors_long` (`[head_dim / 2]` each),
/// its `rope.scaling.original_context_length` (default 4096, Phi3Config's) and `rope.scaling.attn_factor`
/// (the factor on cos and sin it computed; `None`: from the factor, as transformers does). The factor is
/// `max_position_embeddings / original`, transformers' default for Phi-3.
pub fn longrope_from_factors(
    short: Vec<f64>,
    long: Vec<f64>,
    original: Option<usize>,
    attention_factor: Option<f64>,
    head_dim: usize,
) -> Result<RopeScaling, String> {
    if short.len() != head_dim / 2 || long.len() != head_dim / 2 {
        return Err(format!(
            "rope_factors_short / rope_factors_long have {} / {} entries; head_dim {head_dim} needs {}",
            short.len(),
            long.len(),
            head_dim / 2
        ));
    }
    Ok(RopeScaling::LongRope(LongRope {
        short_factor: short,
        long_factor: long,
        factor: None,
        original_max_position_embeddings: original.unwrap_or(4096),
        attention_factor,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.1 8B's and 3.2 1B's scalings (the blended pairs: 7 of 64, 3 of 32) come back exactly.
    #[test]
    fn llama3_parameters_come_back() {
        for (head_dim, factor) in [(128, 8.0), (64, 32.0)] {
            let f = llama3_factors(500000.0, head_dim, factor, 1.0, 4.0, 8192);
            let got = llama3_from_factors(&f, 500000.0, head_dim).unwrap().unwrap();
            let RopeScaling::Llama3 { factor: fa, low_freq_factor, high_freq_factor, original_max_position_embeddings } =
                got
            else {
                panic!("{got:?}")
            };
            assert_eq!((fa, original_max_position_embeddings), (factor, 8192));
            assert_eq!((low_freq_factor, high_freq_factor), (1.0, 4.0));
        }
        assert_eq!(llama3_from_factors(&[1.0; 64], 500000.0, 128).unwrap(), None);
        // Divisors no llama3 scaling gives are refused.
        let mut f = llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192);
        f[3] = 2.0;
        assert!(llama3_from_factors(&f, 500000.0, 128).is_err());
    }
}
