//! `longrope` RoPE scaling (LongRoPE, Phi-3/3.5 128K), transformers' `_compute_longrope_parameters` with
//! its `dynamic_rope_update`: each pair's default frequency divided by a factor of its own, the
//! `short_factor`s while the sequence fits the original window and the `long_factor`s past it (the length
//! the forward sees, `max(position_ids) + 1`), and cos and sin times an attention factor
//! (`sqrt(1 + ln(factor) / ln(original))` unless given).

use serde_json::{json, Map, Value};

use super::{default_inv_freq, Params, ScalingContext};
use crate::error::{Error, Result};

/// LongRoPE's fields, as config.json gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct LongRope {
    /// One divisor per rotated pair (`head_dim / 2`) for sequences inside the original window.
    pub short_factor: Vec<f64>,
    /// One divisor per rotated pair for sequences past it.
    pub long_factor: Vec<f64>,
    /// The scaling factor; `None`: `max_position_embeddings / original_max_position_embeddings` (Phi-3).
    pub factor: Option<f64>,
    /// The window the model was pretrained with: Phi-3's top-level `original_max_position_embeddings`
    /// (default 4096, which transformers' Phi3Config prefers to one inside the scaling); for the other
    /// families the scaling's own, default `max_position_embeddings`.
    pub original_max_position_embeddings: usize,
    /// The factor on cos and sin; `None`: from the factor.
    pub attention_factor: Option<f64>,
}

impl LongRope {
    /// Reads the fields; both factor lists must have `head_dim / 2` entries.
    pub(super) fn parse(p: &Params, ctx: &ScalingContext) -> Result<Self> {
        let half = ctx.head_dim / 2;
        let inside = p.tokens("original_max_position_embeddings")?;
        let original = if ctx.phi3 {
            // Phi3Config: the top-level field (class default 4096) overrides the one in the scaling.
            let top = ctx.top_level_original.unwrap_or(4096);
            if let Some(inner) = inside.filter(|&i| i != top) {
                return Err(Error::InvalidField {
                    path: p.path.into(),
                    field: p.name("original_max_position_embeddings"),
                    value: inner.to_string(),
                    reason: format!(
                        "differs from the top-level original_max_position_embeddings = {top}, which transformers' \
                         Phi3Config uses instead; make the two equal"
                    ),
                });
            }
            top
        } else {
            inside.unwrap_or(ctx.max_position_embeddings)
        };
        let factor = p.num("factor")?;
        if let Some(f) = factor.filter(|f| *f < 1.0) {
            return Err(p.invalid("factor", &json!(f), "a RoPE scaling factor must be 1 or more"));
        }
        let attention_factor = p.num("attention_factor")?;
        if let Some(a) = attention_factor.filter(|a| *a < 0.0) {
            return Err(p.invalid("attention_factor", &json!(a), "the attention factor must be positive"));
        }
        Ok(LongRope {
            short_factor: p.list("short_factor", half)?,
            long_factor: p.list("long_factor", half)?,
            factor,
            original_max_position_embeddings: original,
            attention_factor,
        })
    }

    /// Writes every field into a `rope_scaling` object (Phi-3's top-level window is written by the config).
    pub(super) fn write(&self, m: &mut Map<String, Value>) {
        m.insert("short_factor".into(), json!(self.short_factor));
        m.insert("long_factor".into(), json!(self.long_factor));
        m.insert("original_max_position_embeddings".into(), json!(self.original_max_position_embeddings));
        if let Some(f) = self.factor {
            m.insert("factor".into(), json!(f));
        }
        if let Some(a) = self.attention_factor {
            m.insert("attention_factor".into(), json!(a));
        }
    }

    /// The factor it uses: given, else `max_position_embeddings / original_max_position_embeddings`.
    pub fn factor(&self, max_position_embeddings: usize) -> f64 {
        self.factor.unwrap_or(max_position_embeddings as f64 / self.original_max_position_embeddings as f64)
    }

    /// The factor on cos and sin: `attention_factor` if given, else 1 for a factor of 1 or less, else
    /// `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`. The same inside and past the window.
    pub fn attention_factor(&self, max_position_embeddings: usize) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        let factor = self.factor(max_position_embeddings);
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (self.original_max_position_embeddings as f64).ln()).sqrt()
        }
    }

    /// The inverse frequencies `[head_dim / 2]` for a forward over `seq_len` tokens: the default ones divided
    /// by the long factors when `seq_len > original_max_position_embeddings`, else by the short ones.
    pub fn inv_freq(&self, head_dim: usize, theta: f64, seq_len: usize) -> Vec<f64> {
        let ext = if seq_len > self.original_max_position_embeddings { &self.long_factor } else { &self.short_factor };
        default_inv_freq(head_dim, theta).iter().zip(ext).map(|(f, e)| f / e).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LongRope {
        LongRope {
            short_factor: vec![1.0, 2.0],
            long_factor: vec![4.0, 8.0],
            factor: None,
            original_max_position_embeddings: 32,
            attention_factor: None,
        }
    }

    #[test]
    fn short_inside_the_window_long_past_it() {
        let l = sample();
        let base = default_inv_freq(4, 1e4);
        assert_eq!(l.inv_freq(4, 1e4, 32), vec![base[0], base[1] / 2.0]);
        assert_eq!(l.inv_freq(4, 1e4, 33), vec![base[0] / 4.0, base[1] / 8.0]);
    }

    #[test]
    fn attention_factor_from_the_windows_by_hand() {
        // max_pos 128, original 32: factor 4; sqrt(1 + ln 4 / ln 32) = sqrt(1.4) = 1.183215957.
        assert!((sample().attention_factor(128) - 1.4f64.sqrt()).abs() < 1e-15);
        assert_eq!(sample().attention_factor(32), 1.0);
        assert_eq!(LongRope { attention_factor: Some(0.9), ..sample() }.attention_factor(128), 0.9);
    }
}
