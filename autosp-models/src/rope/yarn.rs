//! `yarn` RoPE scaling (YaRN, <https://arxiv.org/abs/2309.00071>), transformers' `_compute_yarn_parameters`:
//! high frequencies (many rotations inside the original window) kept, low ones divided by `factor`, a linear
//! ramp over the pairs between, and an attention factor on cos and sin (`0.1 ln(factor) + 1` unless given,
//! or DeepSeek's `mscale` / `mscale_all_dim` ratio).

use serde_json::{json, Map, Value};

use super::{default_inv_freq, Params, ScalingContext};
use crate::error::Result;

/// YaRN's fields, as config.json gives them (the optional ones kept as given, so that they are written back
/// the same).
#[derive(Debug, Clone, PartialEq)]
pub struct Yarn {
    /// New window over original window.
    pub factor: f64,
    /// The window the model was pretrained with (default: `max_position_embeddings`).
    pub original_max_position_embeddings: usize,
    /// The factor on cos and sin; `None`: from `factor` (and `mscale`, `mscale_all_dim`).
    pub attention_factor: Option<f64>,
    /// DeepSeek's numerator scale of the attention factor (used with `mscale_all_dim`).
    pub mscale: Option<f64>,
    /// DeepSeek's denominator scale of the attention factor (used with `mscale`).
    pub mscale_all_dim: Option<f64>,
    /// Rotations in the window above which a pair is kept (extrapolated); default 32.
    pub beta_fast: Option<f64>,
    /// Rotations in the window below which a pair is fully interpolated; default 1.
    pub beta_slow: Option<f64>,
    /// Whether the ramp's ends are rounded to whole pairs (floor, ceil); default true.
    pub truncate: Option<bool>,
}

/// YaRN's `mscale`: `0.1 * m * ln(scale) + 1` (1 for a scale of 1 or less), transformers' `yarn_get_mscale`.
fn get_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// Python's truthiness of an optional number: given and not zero.
fn truthy(x: Option<f64>) -> Option<f64> {
    x.filter(|v| *v != 0.0)
}

impl Yarn {
    /// YaRN by `factor` from a window of `original_max_position_embeddings`, every other field at its default.
    pub fn new(factor: f64, original_max_position_embeddings: usize) -> Self {
        Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            beta_fast: None,
            beta_slow: None,
            truncate: None,
        }
    }

    /// Reads the fields (`factor` required, as transformers' validation requires it).
    pub(super) fn parse(p: &Params, ctx: &ScalingContext) -> Result<Self> {
        let attention_factor = p.num("attention_factor")?;
        if let Some(a) = attention_factor.filter(|a| *a < 0.0) {
            return Err(p.invalid("attention_factor", &json!(a), "the attention factor must be positive"));
        }
        Ok(Yarn {
            factor: p.factor("factor")?,
            original_max_position_embeddings: p
                .tokens("original_max_position_embeddings")?
                .unwrap_or(ctx.max_position_embeddings),
            attention_factor,
            mscale: p.num("mscale")?,
            mscale_all_dim: p.num("mscale_all_dim")?,
            beta_fast: p.num("beta_fast")?,
            beta_slow: p.num("beta_slow")?,
            truncate: p.flag("truncate")?,
        })
    }

    /// Writes every field given into a `rope_scaling` object.
    pub(super) fn write(&self, m: &mut Map<String, Value>) {
        m.insert("factor".into(), json!(self.factor));
        m.insert("original_max_position_embeddings".into(), json!(self.original_max_position_embeddings));
        let optional = [
            ("attention_factor", self.attention_factor),
            ("mscale", self.mscale),
            ("mscale_all_dim", self.mscale_all_dim),
            ("beta_fast", self.beta_fast),
            ("beta_slow", self.beta_slow),
        ];
        for (name, v) in optional {
            if let Some(v) = v {
                m.insert(name.into(), json!(v));
            }
        }
        if let Some(t) = self.truncate {
            m.insert("truncate".into(), json!(t));
        }
    }

    /// The factor on cos and sin: `attention_factor` if given; else, with both `mscale` and `mscale_all_dim`
    /// (non-zero), `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`; else
    /// `0.1 ln(factor) + 1`.
    pub fn attention_factor(&self) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        match (truthy(self.mscale), truthy(self.mscale_all_dim)) {
            (Some(m), Some(all)) => get_mscale(self.factor, m) / get_mscale(self.factor, all),
            _ => get_mscale(self.factor, 1.0),
        }
    }

    /// The YaRN inverse frequencies `[head_dim / 2]`: pair `i` blends `f_i / factor` (interpolated) and `f_i`
    /// (extrapolated) by a ramp that is 0 below pair `low` and 1 above pair `high`, where `low` and `high`
    /// are the pairs that turn `beta_fast` and `beta_slow` times in the original window.
    pub fn inv_freq(&self, head_dim: usize, theta: f64) -> Vec<f64> {
        let dim = head_dim as f64;
        let original = self.original_max_position_embeddings as f64;
        // `or 32` / `or 1` in transformers: a zero counts as absent.
        let beta_fast = truthy(self.beta_fast).unwrap_or(32.0);
        let beta_slow = truthy(self.beta_slow).unwrap_or(1.0);
        // The pair index whose wavelength fits `rotations` times in the original window.
        let correction_dim =
            |rotations: f64| dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
        let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
        if self.truncate.unwrap_or(true) {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min(dim - 1.0);
        if low == high {
            high += 0.001; // transformers' guard against a zero-width ramp
        }
        default_inv_freq(head_dim, theta)
            .into_iter()
            .enumerate()
            .map(|(i, f)| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                f / self.factor * (1.0 - extrapolation) + f * extrapolation
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_factor_by_hand() {
        // 0.1 ln 4 + 1 = 1.138629436.
        assert!((Yarn::new(4.0, 32).attention_factor() - 1.138_629_436_111_989).abs() < 1e-12);
        // DeepSeek: mscale 1, mscale_all_dim 1 -> ratio 1.
        let y = Yarn { mscale: Some(1.0), mscale_all_dim: Some(1.0), ..Yarn::new(40.0, 4096) };
        assert_eq!(y.attention_factor(), 1.0);
        // Only one of the two: the plain formula.
        let y = Yarn { mscale: Some(0.707), ..Yarn::new(4.0, 32) };
        assert!((y.attention_factor() - 1.138_629_436_111_989).abs() < 1e-12);
        let y = Yarn { attention_factor: Some(0.5), ..Yarn::new(4.0, 32) };
        assert_eq!(y.attention_factor(), 0.5);
    }

    #[test]
    fn ramp_keeps_fast_pairs_and_scales_slow_ones() {
        // head_dim 16, theta 1e4, original 32, factor 4: low = floor(16 ln(32 / 64pi) / (2 ln 1e4)) = floor(-1.6)
        // -> 0, high = ceil(16 ln(32 / 2pi) / 18.42) = ceil(1.41) = 2: pair 0 kept, pair 1 half, pairs 2.. / 4.
        let y = Yarn::new(4.0, 32);
        let base = default_inv_freq(16, 1e4);
        let f = y.inv_freq(16, 1e4);
        assert!((f[0] - base[0]).abs() < 1e-15);
        assert!((f[1] - base[1] * (0.5 / 4.0 + 0.5)).abs() < 1e-15);
        for i in 2..8 {
            assert!((f[i] - base[i] / 4.0).abs() < 1e-15, "pair {i}");
        }
    }
}
