//! RoPE and its scalings: the one place that turns a config's `rope_scaling` / `rope_parameters` (default,
//! linear, llama3, yarn, dynamic, longrope) into inverse frequencies and an attention factor, exactly as HF
//! transformers' `modeling_rope_utils.py` does (5.x; the functions named in each type's file).
//!
//! One file per type (`default`, `linear`, `llama3`, `yarn`, `dynamic`, `longrope`) holds its fields, how it is
//! read from and written to config.json, and its formula; this door holds the enum, the dispatch and the
//! config.json reading shared by all; [`extend`] extends a loaded model's window (`--rope-scaling`).
//!
//! Two scalings depend on the length of the sequence a forward pass sees (`dynamic`: the NTK base grows with
//! it; `longrope`: the long factors past the original window). Transformers reads that length as
//! `max(position_ids) + 1` of the forward; under sequence parallelism a rank sees only its shard, so the
//! compiled step hands the model the global, unpadded length through the tape
//! ([`autosp_core::Tape::set_sequence_length`]); see [`RopeScaling::depends_on_length`].

mod default;
mod dynamic;
pub mod extend;
mod linear;
mod llama3;
mod longrope;
mod yarn;

pub use default::default_inv_freq;
pub use extend::{unscaled_window_warning, RopeExtended, RopeExtension, YarnKeys};
pub use longrope::LongRope;
pub use yarn::Yarn;

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};

/// RoPE frequency scaling, as HF transformers' `rope_scaling` / `rope_parameters` (`rope_type`, or the older
/// `type`). `None` in a config is the `default` type.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (every inverse frequency divided by `factor`).
    Linear { factor: f64 },
    /// Llama 3.1 scaling: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
    /// YaRN: NTK-by-parts interpolation between the original and the scaled frequencies, and an attention
    /// factor on cos and sin (Qwen2.5/Qwen3 long-context configs, DeepSeek's `mscale`).
    Yarn(Yarn),
    /// Dynamic NTK: the base grows with the sequence length past `max_position_embeddings`
    /// (`base * (factor * len / max_pos - (factor - 1))^(d / (d - 2))`); inside the window, the default.
    Dynamic { factor: f64 },
    /// LongRoPE (Phi-3/3.5 128K): a divisor per frequency, short ones inside the original window and long
    /// ones past it, and an attention factor.
    LongRope(LongRope),
}

/// What RoPE applies for one forward pass: the angle of pair `i` at position `p` is `p * inv_freq[i]`, and
/// cos and sin are multiplied by `attention_factor` (transformers' `attention_scaling`; 1 but for yarn and
/// longrope).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFrequencies {
    /// `[head_dim / 2]` inverse frequencies, scaling applied (f64; transformers computes in f32, so the two
    /// agree to f32 rounding).
    pub inv_freq: Vec<f64>,
    /// The factor on cos and sin.
    pub attention_factor: f64,
}

impl RopeScaling {
    /// The `rope_type` string of config.json.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn(_) => "yarn",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::LongRope(_) => "longrope",
        }
    }

    /// The scaling factor (for longrope the one it uses: given, else `max_position_embeddings` over the
    /// original window).
    pub fn factor(&self, max_position_embeddings: usize) -> f64 {
        match self {
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => *factor,
            RopeScaling::Llama3 { factor, .. } => *factor,
            RopeScaling::Yarn(y) => y.factor,
            RopeScaling::LongRope(l) => l.factor(max_position_embeddings),
        }
    }

    /// The window the model was pretrained with, when the scaling names one (llama3, yarn, longrope).
    pub fn original_max_position_embeddings(&self) -> Option<usize> {
        match self {
            RopeScaling::Llama3 { original_max_position_embeddings, .. } => Some(*original_max_position_embeddings),
            RopeScaling::Yarn(y) => Some(y.original_max_position_embeddings),
            RopeScaling::LongRope(l) => Some(l.original_max_position_embeddings),
            RopeScaling::Linear { .. } | RopeScaling::Dynamic { .. } => None,
        }
    }

    /// Whether the frequencies depend on the length of the sequence a forward pass sees (`dynamic`,
    /// `longrope`): such a model computes other positions for the same token at another length, so training
    /// at one length and serving at another is not the same model (the trainer says so).
    pub fn depends_on_length(&self) -> bool {
        matches!(self, RopeScaling::Dynamic { .. } | RopeScaling::LongRope(_))
    }

    /// The frequencies and attention factor for a forward pass over a sequence of `seq_len` tokens
    /// (transformers' `max(position_ids) + 1`; only `dynamic` and `longrope` read it), with the model's
    /// `head_dim`, `theta` (`rope_theta`) and `max_position_embeddings`.
    pub fn frequencies(
        &self,
        head_dim: usize,
        theta: f64,
        max_position_embeddings: usize,
        seq_len: usize,
    ) -> RopeFrequencies {
        let base = || default_inv_freq(head_dim, theta);
        let plain = |inv_freq| RopeFrequencies { inv_freq, attention_factor: 1.0 };
        match self {
            RopeScaling::Linear { factor } => plain(linear::inv_freq(&base(), *factor)),
            &RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                plain(llama3::inv_freq(
                    &base(),
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                ))
            }
            RopeScaling::Yarn(y) => {
                RopeFrequencies { inv_freq: y.inv_freq(head_dim, theta), attention_factor: y.attention_factor() }
            }
            RopeScaling::Dynamic { factor } => {
                plain(dynamic::inv_freq(head_dim, theta, *factor, max_position_embeddings, seq_len))
            }
            RopeScaling::LongRope(l) => RopeFrequencies {
                inv_freq: l.inv_freq(head_dim, theta, seq_len),
                attention_factor: l.attention_factor(max_position_embeddings),
            },
        }
    }

    /// One line for a run's description: the type, factor and window, for a model trained on sequences of
    /// `seq_len` tokens; a warning for `dynamic`, whose positions change with the length (training at one
    /// length teaches angles that other lengths do not reproduce), and which factors `longrope` uses.
    pub fn describe(&self, max_position_embeddings: usize, seq_len: usize) -> String {
        let window = self.original_max_position_embeddings().unwrap_or(max_position_embeddings);
        let head = format!(
            "RoPE scaling {} by {} from a window of {window} tokens",
            self.rope_type(),
            self.factor(max_position_embeddings)
        );
        match self {
            RopeScaling::Dynamic { .. } => format!(
                "{head}; warning: dynamic scaling recomputes the positions from each sequence's length, so \
                 training at {seq_len} tokens teaches angles that other lengths do not give (transformers serves \
                 it at whatever length it sees); prefer yarn or linear to fine-tune for a longer window"
            ),
            RopeScaling::LongRope(_) => format!(
                "{head}; the {} factors at {seq_len} tokens (long past the window), and other positions at \
                 other lengths",
                if seq_len > window { "long" } else { "short" }
            ),
            _ => head,
        }
    }

    /// The scaling as config.json's `rope_scaling` object: `rope_type` and every field given, so that
    /// transformers (and vLLM, SGLang) compute the same positions from it.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("rope_type".into(), json!(self.rope_type()));
        match self {
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor } => {
                m.insert("factor".into(), json!(factor));
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                m.insert("factor".into(), json!(factor));
                m.insert("low_freq_factor".into(), json!(low_freq_factor));
                m.insert("high_freq_factor".into(), json!(high_freq_factor));
                m.insert("original_max_position_embeddings".into(), json!(original_max_position_embeddings));
            }
            RopeScaling::Yarn(y) => y.write(&mut m),
            RopeScaling::LongRope(l) => l.write(&mut m),
        }
        Value::Object(m)
    }
}

/// The frequencies of a model with `head_dim`, `theta`, `max_position_embeddings` and `scaling` for a forward
/// pass over `seq_len` tokens (see [`RopeScaling::frequencies`]; no scaling: the default `theta^(-2i/d)`).
pub fn rope_frequencies(
    head_dim: usize,
    theta: f64,
    max_position_embeddings: usize,
    scaling: Option<&RopeScaling>,
    seq_len: usize,
) -> RopeFrequencies {
    match scaling {
        None => RopeFrequencies { inv_freq: default_inv_freq(head_dim, theta), attention_factor: 1.0 },
        Some(s) => s.frequencies(head_dim, theta, max_position_embeddings, seq_len),
    }
}

/// What reading a scaling needs from the rest of config.json.
pub(crate) struct ScalingContext {
    /// Whether transformers' `Phi3Config` reads it: its top-level window wins, and only `longrope` (spelled
    /// `su` or `yarn` too) is taken.
    pub phi3: bool,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    /// config.json's top-level `original_max_position_embeddings` (Phi-3's), if any.
    pub top_level_original: Option<usize>,
}

/// The fields of one `rope_scaling` / `rope_parameters` object, read with errors that name the field as
/// `{at}.{name}` in file `path`.
pub(crate) struct Params<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
    at: &'a str,
}

impl<'a> Params<'a> {
    /// The fields of `obj`, found at `at` (e.g. `rope_scaling`) in `path`.
    pub(crate) fn new(obj: &'a Map<String, Value>, path: &'a Path, at: &'a str) -> Self {
        Params { obj, path, at }
    }

    fn name(&self, field: &str) -> String {
        format!("{}.{field}", self.at)
    }

    fn get(&self, field: &str) -> Option<&Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn invalid(&self, field: &str, v: &Value, reason: &str) -> Error {
        Error::InvalidField {
            path: self.path.into(),
            field: self.name(field),
            value: v.to_string(),
            reason: reason.into(),
        }
    }

    fn missing(&self, field: &str) -> Error {
        Error::MissingField { path: self.path.into(), field: self.name(field) }
    }

    /// A number, if given.
    fn num(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.invalid(field, v, "expected a finite number")),
            },
        }
    }

    /// A number that must be there.
    fn need(&self, field: &str) -> Result<f64> {
        self.num(field)?.ok_or_else(|| self.missing(field))
    }

    /// A scaling factor: 1 or more (a factor below 1 shrinks the window; transformers calls it invalid).
    fn factor(&self, field: &str) -> Result<f64> {
        let f = self.need(field)?;
        if f < 1.0 {
            return Err(self.invalid(
                field,
                &json!(f),
                "a RoPE scaling factor must be 1 or more (new window / original window)",
            ));
        }
        Ok(f)
    }

    /// A positive whole number of tokens, if given.
    fn tokens(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x >= 1.0 && x.fract() == 0.0 => Ok(Some(x as usize)),
                _ => Err(self.invalid(field, v, "expected a positive whole number of tokens")),
            },
        }
    }

    /// A true/false flag, if given.
    fn flag(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.invalid(field, v, "expected true or false")),
        }
    }

    /// A list of `len` positive numbers that must be there.
    fn list(&self, field: &str, len: usize) -> Result<Vec<f64>> {
        let v = self.get(field).ok_or_else(|| self.missing(field))?;
        let reason = format!("expected a list of head_dim / 2 = {len} positive numbers (one per rotated pair)");
        let Value::Array(a) = v else { return Err(self.invalid(field, v, &reason)) };
        let xs: Option<Vec<f64>> = a.iter().map(|x| x.as_f64().filter(|x| x.is_finite() && *x > 0.0)).collect();
        match xs {
            Some(xs) if xs.len() == len => Ok(xs),
            Some(xs) => Err(self.invalid(field, &json!(format!("[{} numbers]", xs.len())), &reason)),
            None => Err(self.invalid(field, v, &reason)),
        }
    }
}

/// Reads the scaling of one `rope_scaling` / `rope_parameters` object (`None` for `default`), as transformers'
/// config classes standardise it (`standardize_rope_params`; Phi-3's `su` and `yarn` are its `longrope`, and
/// Phi-3 takes no other scaling). Unknown types, missing or malformed fields are errors naming the field.
pub(crate) fn parse_scaling(p: &Params, ctx: &ScalingContext) -> Result<Option<RopeScaling>> {
    let ty = match p.get("rope_type").or_else(|| p.get("type")) {
        None => "default".to_string(),
        Some(v) => v.as_str().ok_or_else(|| p.invalid("rope_type", v, "expected a string"))?.to_string(),
    };
    let phi3 = ctx.phi3;
    let ty = if phi3 && matches!(ty.as_str(), "su" | "yarn") { "longrope".to_string() } else { ty };
    if phi3 && !matches!(ty.as_str(), "default" | "longrope") {
        return Err(Error::Unsupported {
            path: p.path.into(),
            field: p.name("rope_type"),
            value: json!(ty).to_string(),
            reason: "Phi-3 takes only longrope (su, yarn) scaling, as transformers' Phi3Config".into(),
        });
    }
    Ok(match ty.as_str() {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: p.factor("factor")? }),
        "dynamic" => Some(RopeScaling::Dynamic { factor: p.factor("factor")? }),
        "llama3" => Some(llama3::parse(p, ctx)?),
        "yarn" => Some(RopeScaling::Yarn(Yarn::parse(p, ctx)?)),
        "longrope" => Some(RopeScaling::LongRope(LongRope::parse(p, ctx)?)),
        other => {
            return Err(Error::UnknownRopeType { path: p.path.into(), field: p.at.into(), rope_type: other.into() })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_scaling_is_the_default_with_factor_one() {
        let f = rope_frequencies(4, 10000.0, 64, None, 1000);
        assert_eq!(f.inv_freq, default_inv_freq(4, 10000.0));
        assert_eq!(f.attention_factor, 1.0);
    }

    #[test]
    fn the_description_warns_about_dynamic_and_names_longrope_factors() {
        let d = RopeScaling::Dynamic { factor: 2.0 }.describe(4096, 8192);
        assert!(d.contains("dynamic by 2 from a window of 4096") && d.contains("warning") && d.contains("8192"), "{d}");
        let y = RopeScaling::Yarn(Yarn::new(4.0, 8192)).describe(32768, 16384);
        assert_eq!(y, "RoPE scaling yarn by 4 from a window of 8192 tokens");
        let l = LongRope {
            short_factor: vec![1.0],
            long_factor: vec![2.0],
            factor: None,
            original_max_position_embeddings: 4096,
            attention_factor: None,
        };
        let scaling = RopeScaling::LongRope(l);
        assert!(scaling.describe(131072, 8192).contains("the long factors"), "{}", scaling.describe(131072, 8192));
        assert!(scaling.describe(131072, 4096).contains("the short factors"));
        assert!(scaling.describe(131072, 4096).contains("longrope by 32"));
    }

    #[test]
    fn length_dependence_is_dynamic_and_longrope_only() {
        assert!(RopeScaling::Dynamic { factor: 2.0 }.depends_on_length());
        assert!(!RopeScaling::Linear { factor: 2.0 }.depends_on_length());
        assert!(!RopeScaling::Yarn(Yarn::new(2.0, 32)).depends_on_length());
    }
}
