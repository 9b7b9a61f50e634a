//! Extending a loaded model's context window: [`RopeExtension`], the `--rope-scaling TYPE:FACTOR[,KEY=VALUE...]`
//! a run asks for (`linear`, `dynamic`, `yarn`; `none` to train without a scaling), and what it makes of a
//! checkpoint's own scaling and window ([`RopeExtension::extend`]): the scaling and `max_position_embeddings`
//! written into every config.json a run saves, so that transformers (4.51+, 5.x), vLLM and SGLang compute the
//! positions the model trained with.
//!
//! The original window `W` is the checkpoint's `original_max_position_embeddings` when it already has a
//! scaling (for `linear`, which names none, `max_position_embeddings / factor`, as written here; for
//! `dynamic`, `max_position_embeddings`), else its `max_position_embeddings`. The same type composes (the
//! factors multiply, `W` kept: LongLoRA-style merged checkpoints extended again); another type on top of a
//! scaling is refused. The result gives `max_position_embeddings = W × factor`, except for `dynamic`, where
//! transformers reads `max_position_embeddings` as the original window (`_compute_dynamic_ntk_parameters`:
//! the base grows with `factor * len / max_position_embeddings`), so it stays `W`.

use std::fmt;
use std::str::FromStr;

use super::{RopeScaling, Yarn};
use crate::error::{Error, Result};

/// The types `--rope-scaling` extends a window with.
const TYPES: &str = "linear, dynamic, yarn (`none`: train without a scaling)";

/// YaRN's optional fields as `--rope-scaling yarn:F,KEY=VALUE` gives them (config.json's names; `None`:
/// transformers' default, or the checkpoint's own value when its yarn scaling is extended again).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct YarnKeys {
    /// The factor on cos and sin (default `0.1 ln(factor) + 1`).
    pub attention_factor: Option<f64>,
    /// Rotations in the original window above which a pair is kept (default 32).
    pub beta_fast: Option<f64>,
    /// Rotations in the original window below which a pair is fully interpolated (default 1).
    pub beta_slow: Option<f64>,
    /// DeepSeek's numerator scale of the attention factor.
    pub mscale: Option<f64>,
    /// DeepSeek's denominator scale of the attention factor.
    pub mscale_all_dim: Option<f64>,
    /// Whether the ramp's ends are rounded to whole pairs (default true).
    pub truncate: Option<bool>,
}

/// A context extension asked of a loaded model (`--rope-scaling`, `CompileConfig::rope_scaling`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeExtension {
    /// `none`: train without a scaling (a checkpoint's own is removed, its window back to the original).
    None,
    /// `linear:F`: position interpolation, every frequency divided by `F`.
    Linear { factor: f64 },
    /// `dynamic:F`: dynamic NTK, the base grown from the sequence length past the window.
    Dynamic { factor: f64 },
    /// `yarn:F[,KEY=VALUE...]`: YaRN, with its optional fields.
    Yarn { factor: f64, keys: YarnKeys },
}

/// What [`RopeExtension::extend`] made of a config's scaling and window: the new ones, and the line a run
/// prints about them.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeExtended {
    /// The extension as asked (`--rope-scaling` spelling).
    pub spec: String,
    /// The scaling the model now has (`None`: no scaling).
    pub scaling: Option<RopeScaling>,
    /// `max_position_embeddings` the config now has.
    pub max_position_embeddings: usize,
    /// The original window `W` (the pretrained one).
    pub window: usize,
    /// The scaling the checkpoint had before, if any, with its factor.
    pub previous: Option<(RopeScaling, f64)>,
}

impl RopeExtended {
    /// One line for the run's description, e.g. `RoPE: yarn x2 from a window of 8192 -> 16384 tokens
    /// (--rope-scaling yarn:2)`.
    pub fn describe(&self) -> String {
        let option = format!("--rope-scaling {}", self.spec);
        let Some(s) = &self.scaling else {
            return match &self.previous {
                Some((p, factor)) => format!(
                    "RoPE: the checkpoint's {} x{factor} scaling removed, window back to {} tokens ({option})",
                    p.rope_type(),
                    self.window
                ),
                None => format!("RoPE: no scaling, window {} tokens ({option})", self.window),
            };
        };
        let factor = s.factor(self.max_position_embeddings);
        let new_window = scaled_window(self.window, factor);
        let mut note = option;
        if let Some((p, factor)) = &self.previous {
            note = format!("the checkpoint's {} x{factor} times the {note}", p.rope_type());
        }
        if matches!(s, RopeScaling::Dynamic { .. }) {
            note.push_str(&format!(
                "; max_position_embeddings stays {}, which transformers' dynamic scaling reads as the original window",
                self.max_position_embeddings
            ));
        }
        format!("RoPE: {} x{factor} from a window of {} -> {new_window} tokens ({note})", s.rope_type(), self.window)
    }
}

/// `window × factor` tokens, rounded.
fn scaled_window(window: usize, factor: f64) -> usize {
    (window as f64 * factor).round() as usize
}

/// The warning for a run that trains on sequences of `seq_len` tokens past a model's `window` with no RoPE
/// scaling (`None` when they fit): the positions past the window are ones the model never saw.
pub fn unscaled_window_warning(window: usize, seq_len: usize) -> Option<String> {
    (seq_len > window).then(|| {
        format!(
            "warning: --seq-len {seq_len} is past the model's window of {window} tokens (max_position_embeddings) \
             and the model has no RoPE scaling: positions past {window} are angles it never saw in pretraining; \
             extend the window with --rope-scaling yarn:{} (or linear:F, dynamic:F)",
            seq_len.div_ceil(window.max(1))
        )
    })
}

impl RopeExtension {
    /// The `rope_type` the extension sets (`None` for `none`).
    pub fn rope_type(&self) -> Option<&'static str> {
        match self {
            RopeExtension::None => None,
            RopeExtension::Linear { .. } => Some("linear"),
            RopeExtension::Dynamic { .. } => Some("dynamic"),
            RopeExtension::Yarn { .. } => Some("yarn"),
        }
    }

    /// The factor (`None` for `none`).
    pub fn factor(&self) -> Option<f64> {
        match self {
            RopeExtension::None => None,
            RopeExtension::Linear { factor }
            | RopeExtension::Dynamic { factor }
            | RopeExtension::Yarn { factor, .. } => Some(*factor),
        }
    }

    /// The scaling and window a config gets from this extension, given its own `scaling` and
    /// `max_position_embeddings` (see the module's doc). Refuses a type other than the checkpoint's own,
    /// saying what composes.
    pub fn extend(&self, scaling: Option<&RopeScaling>, max_position_embeddings: usize) -> Result<RopeExtended> {
        let window = match scaling {
            None | Some(RopeScaling::Dynamic { .. }) => max_position_embeddings,
            Some(RopeScaling::Linear { factor }) => (max_position_embeddings as f64 / factor).round().max(1.0) as usize,
            Some(s) => s.original_max_position_embeddings().unwrap_or(max_position_embeddings),
        };
        let new = match (self, scaling) {
            (RopeExtension::None, _) => None,
            (RopeExtension::Linear { factor }, None) => Some(RopeScaling::Linear { factor: *factor }),
            (RopeExtension::Linear { factor }, Some(RopeScaling::Linear { factor: old })) => {
                Some(RopeScaling::Linear { factor: old * factor })
            }
            (RopeExtension::Dynamic { factor }, None) => Some(RopeScaling::Dynamic { factor: *factor }),
            (RopeExtension::Dynamic { factor }, Some(RopeScaling::Dynamic { factor: old })) => {
                Some(RopeScaling::Dynamic { factor: old * factor })
            }
            (RopeExtension::Yarn { factor, keys }, None) => Some(RopeScaling::Yarn(keys.yarn(*factor, window, None))),
            (RopeExtension::Yarn { factor, keys }, Some(RopeScaling::Yarn(old))) => {
                Some(RopeScaling::Yarn(keys.yarn(old.factor * factor, window, Some(old))))
            }
            (_, Some(old)) => {
                return Err(Error::RopeExtensionRefused {
                    spec: self.to_string(),
                    reason: format!(
                        "the checkpoint already has a {} scaling (factor {} from a window of {window} tokens), and \
                         only the same type composes (linear on linear, dynamic on dynamic, yarn on yarn: the \
                         factors multiply, the original window kept); give --rope-scaling {}:F to extend it, leave \
                         --rope-scaling out to keep it as it is, or give `none` to remove it",
                        old.rope_type(),
                        old.factor(max_position_embeddings),
                        old.rope_type()
                    ),
                })
            }
        };
        let new_max = match &new {
            None | Some(RopeScaling::Dynamic { .. }) => window,
            Some(s) => scaled_window(window, s.factor(max_position_embeddings)),
        };
        Ok(RopeExtended {
            spec: self.to_string(),
            scaling: new,
            max_position_embeddings: new_max,
            window,
            previous: scaling.map(|s| (s.clone(), s.factor(max_position_embeddings))),
        })
    }
}

impl YarnKeys {
    /// YaRN by `factor` from `window`: each key given here, else the one of `old` (the checkpoint's yarn
    /// scaling extended again), else transformers' default.
    fn yarn(&self, factor: f64, window: usize, old: Option<&Yarn>) -> Yarn {
        let base = old.cloned().unwrap_or_else(|| Yarn::new(factor, window));
        Yarn {
            factor,
            original_max_position_embeddings: window,
            attention_factor: self.attention_factor.or(base.attention_factor),
            mscale: self.mscale.or(base.mscale),
            mscale_all_dim: self.mscale_all_dim.or(base.mscale_all_dim),
            beta_fast: self.beta_fast.or(base.beta_fast),
            beta_slow: self.beta_slow.or(base.beta_slow),
            truncate: self.truncate.or(base.truncate),
        }
    }

    /// The keys given, as `KEY=VALUE` in config.json's order.
    fn given(&self) -> Vec<String> {
        let numbers = [
            ("attention_factor", self.attention_factor),
            ("beta_fast", self.beta_fast),
            ("beta_slow", self.beta_slow),
            ("mscale", self.mscale),
            ("mscale_all_dim", self.mscale_all_dim),
        ];
        let mut out: Vec<String> = numbers.iter().filter_map(|(k, v)| v.map(|v| format!("{k}={v}"))).collect();
        out.extend(self.truncate.map(|t| format!("truncate={t}")));
        out
    }

    /// Sets `key` from `value` (`spec` is the whole option, for errors).
    fn set(&mut self, spec: &str, key: &str, value: &str) -> Result<()> {
        let bad = |reason: &str| Error::RopeExtensionKey {
            spec: spec.into(),
            key: key.into(),
            value: value.into(),
            reason: reason.into(),
        };
        let number = || -> Result<f64> {
            value.trim().parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(|| bad("expected a finite number"))
        };
        let positive =
            || -> Result<f64> { number().and_then(|x| if x > 0.0 { Ok(x) } else { Err(bad("must be > 0")) }) };
        match key {
            "attention_factor" => self.attention_factor = Some(positive()?),
            "beta_fast" => self.beta_fast = Some(positive()?),
            "beta_slow" => self.beta_slow = Some(positive()?),
            "mscale" => self.mscale = Some(number()?),
            "mscale_all_dim" => self.mscale_all_dim = Some(number()?),
            "truncate" => {
                self.truncate = Some(match value.trim() {
                    "true" => true,
                    "false" => false,
                    _ => return Err(bad("expected true or false")),
                })
            }
            _ => {
                return Err(bad(
                    "not a yarn key; the keys are attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, \
                     truncate",
                ))
            }
        }
        Ok(())
    }
}

impl fmt::Display for RopeExtension {
    /// The `--rope-scaling` spelling (`none`, `linear:4`, `yarn:2,beta_fast=16`), which parses back to the same.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RopeExtension::None => write!(f, "none"),
            RopeExtension::Linear { factor } => write!(f, "linear:{factor}"),
            RopeExtension::Dynamic { factor } => write!(f, "dynamic:{factor}"),
            RopeExtension::Yarn { factor, keys } => {
                write!(f, "yarn:{factor}")?;
                keys.given().iter().try_for_each(|k| write!(f, ",{k}"))
            }
        }
    }
}

impl FromStr for RopeExtension {
    type Err = Error;

    /// Parses `TYPE:FACTOR[,KEY=VALUE...]` (types linear, dynamic, yarn; keys for yarn only) or `none`.
    fn from_str(spec: &str) -> Result<Self> {
        let spec = spec.trim();
        let (ty, rest) = spec.split_once(':').unwrap_or((spec, ""));
        let ty = ty.trim().to_ascii_lowercase();
        let unknown = || Error::RopeExtensionType { spec: spec.into(), given: ty.clone(), types: TYPES.into() };
        if !matches!(ty.as_str(), "none" | "linear" | "dynamic" | "yarn") {
            return Err(unknown());
        }
        if ty == "none" {
            if !rest.trim().is_empty() {
                return Err(Error::RopeExtensionKey {
                    spec: spec.into(),
                    key: "none".into(),
                    value: rest.into(),
                    reason: "`none` takes no factor or keys".into(),
                });
            }
            return Ok(RopeExtension::None);
        }
        let mut parts = rest.split(',');
        let factor_text = parts.next().unwrap_or("").trim();
        let factor = factor_text.parse::<f64>().ok().filter(|x| x.is_finite());
        let factor = match factor {
            Some(f) if f > 1.0 => f,
            Some(_) => return Err(Error::RopeExtensionFactor { spec: spec.into(), factor: factor_text.into() }),
            None => {
                return Err(Error::RopeExtensionKey {
                    spec: spec.into(),
                    key: "FACTOR".into(),
                    value: factor_text.into(),
                    reason: format!("expected TYPE:FACTOR with a number > 1, e.g. {ty}:2"),
                })
            }
        };
        let mut keys = YarnKeys::default();
        for part in parts {
            let (key, value) = part.split_once('=').unwrap_or((part, ""));
            let key = key.trim();
            if ty != "yarn" {
                return Err(Error::RopeExtensionKey {
                    spec: spec.into(),
                    key: key.into(),
                    value: value.into(),
                    reason: format!("{ty} takes only a factor ({ty}:F); KEY=VALUE settings are yarn's"),
                });
            }
            keys.set(spec, key, value)?;
        }
        Ok(match ty.as_str() {
            "linear" => RopeExtension::Linear { factor },
            "dynamic" => RopeExtension::Dynamic { factor },
            _ => RopeExtension::Yarn { factor, keys },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> RopeExtension {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn err(s: &str) -> String {
        s.parse::<RopeExtension>().expect_err(s).to_string()
    }

    #[test]
    fn parses_every_type_and_prints_back_the_same() {
        assert_eq!(parse("none"), RopeExtension::None);
        assert_eq!(parse("linear:4"), RopeExtension::Linear { factor: 4.0 });
        assert_eq!(parse(" Dynamic:1.5 "), RopeExtension::Dynamic { factor: 1.5 });
        let y =
            parse("yarn:2,beta_fast=16,beta_slow=2,attention_factor=1.2,mscale=1,mscale_all_dim=0.5,truncate=false");
        let keys = YarnKeys {
            attention_factor: Some(1.2),
            beta_fast: Some(16.0),
            beta_slow: Some(2.0),
            mscale: Some(1.0),
            mscale_all_dim: Some(0.5),
            truncate: Some(false),
        };
        assert_eq!(y, RopeExtension::Yarn { factor: 2.0, keys });
        for s in ["none", "linear:4", "dynamic:1.5", "yarn:2", &y.to_string()] {
            assert_eq!(parse(s).to_string(), s, "{s}");
            assert_eq!(parse(&parse(s).to_string()), parse(s));
        }
    }

    #[test]
    fn bad_input_names_the_option_and_what_to_give() {
        let e = err("ntk:2");
        assert!(
            e.contains("--rope-scaling ntk:2")
                && e.contains("unknown type `ntk`")
                && e.contains("linear, dynamic, yarn"),
            "{e}"
        );
        for s in ["yarn:1", "linear:0.5", "dynamic:-2"] {
            let e = err(s);
            assert!(
                e.contains(&format!("--rope-scaling {s}"))
                    && e.contains("a factor > 1 extends")
                    && e.contains("`none`"),
                "{e}"
            );
        }
        let e = err("yarn");
        assert!(e.contains("TYPE:FACTOR") && e.contains("yarn:2"), "{e}");
        let e = err("yarn:2,beta=3");
        assert!(e.contains("`beta`") && e.contains("beta_fast"), "{e}");
        let e = err("yarn:2,beta_fast=-1");
        assert!(e.contains("`beta_fast`") && e.contains("> 0"), "{e}");
        let e = err("yarn:2,truncate=maybe");
        assert!(e.contains("true or false"), "{e}");
        let e = err("linear:2,beta_fast=3");
        assert!(e.contains("linear takes only a factor"), "{e}");
        assert!(err("none:2").contains("takes no factor"));
    }

    #[test]
    fn a_model_without_a_scaling_gets_it_from_its_window() {
        let x = parse("yarn:4").extend(None, 64).unwrap();
        assert_eq!(x.scaling, Some(RopeScaling::Yarn(Yarn::new(4.0, 64))));
        assert_eq!((x.window, x.max_position_embeddings), (64, 256));
        assert_eq!(x.describe(), "RoPE: yarn x4 from a window of 64 -> 256 tokens (--rope-scaling yarn:4)");
        let x = parse("linear:2").extend(None, 8192).unwrap();
        assert_eq!((x.scaling, x.max_position_embeddings), (Some(RopeScaling::Linear { factor: 2.0 }), 16384));
        // Dynamic: transformers reads max_position_embeddings as the original window, so it stays.
        let x = parse("dynamic:2").extend(None, 8192).unwrap();
        assert_eq!((x.scaling.clone(), x.max_position_embeddings), (Some(RopeScaling::Dynamic { factor: 2.0 }), 8192));
        assert!(x.describe().starts_with("RoPE: dynamic x2 from a window of 8192 -> 16384 tokens"), "{}", x.describe());
        // Keys given are written; the others stay transformers' defaults.
        let x = parse("yarn:2,beta_fast=16").extend(None, 100).unwrap();
        assert_eq!(x.scaling, Some(RopeScaling::Yarn(Yarn { beta_fast: Some(16.0), ..Yarn::new(2.0, 100) })));
        assert_eq!(x.max_position_embeddings, 200);
    }

    #[test]
    fn the_same_type_composes_keeping_the_original_window() {
        // A yarn x4 checkpoint from 8192 (max 32768, keys of its own) extended by 2: x8 from 8192, its keys kept
        // unless given.
        let old = Yarn { beta_fast: Some(16.0), attention_factor: Some(1.1), ..Yarn::new(4.0, 8192) };
        let x = parse("yarn:2,attention_factor=1.3").extend(Some(&RopeScaling::Yarn(old.clone())), 32768).unwrap();
        let want = Yarn { factor: 8.0, attention_factor: Some(1.3), ..old.clone() };
        assert_eq!(x.scaling, Some(RopeScaling::Yarn(want)));
        assert_eq!((x.window, x.max_position_embeddings), (8192, 65536));
        assert_eq!(
            x.describe(),
            "RoPE: yarn x8 from a window of 8192 -> 65536 tokens (the checkpoint's yarn x4 times the --rope-scaling \
             yarn:2,attention_factor=1.3)"
        );
        // Linear names no original window: max / factor, as written.
        let x = parse("linear:2").extend(Some(&RopeScaling::Linear { factor: 4.0 }), 16384).unwrap();
        assert_eq!(
            (x.scaling, x.window, x.max_position_embeddings),
            (Some(RopeScaling::Linear { factor: 8.0 }), 4096, 32768)
        );
        let x = parse("dynamic:3").extend(Some(&RopeScaling::Dynamic { factor: 2.0 }), 4096).unwrap();
        assert_eq!(
            (x.scaling, x.window, x.max_position_embeddings),
            (Some(RopeScaling::Dynamic { factor: 6.0 }), 4096, 4096)
        );
    }

    #[test]
    fn another_type_on_a_scaling_is_refused_saying_what_composes() {
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let e = parse("yarn:2").extend(Some(&llama3), 131072).unwrap_err().to_string();
        assert!(
            e.contains("--rope-scaling yarn:2")
                && e.contains("already has a llama3 scaling")
                && e.contains("factor 8 from a window of 8192")
                && e.contains("yarn on yarn")
                && e.contains("`none` to remove it"),
            "{e}"
        );
        let e = parse("linear:2").extend(Some(&RopeScaling::Yarn(Yarn::new(4.0, 64))), 256).unwrap_err().to_string();
        assert!(e.contains("already has a yarn scaling") && e.contains("--rope-scaling yarn:F"), "{e}");
    }

    #[test]
    fn none_removes_a_scaling_and_puts_the_window_back() {
        let x = parse("none").extend(Some(&RopeScaling::Yarn(Yarn::new(4.0, 64))), 256).unwrap();
        assert_eq!((x.scaling.clone(), x.window, x.max_position_embeddings), (None, 64, 64));
        assert_eq!(
            x.describe(),
            "RoPE: the checkpoint's yarn x4 scaling removed, window back to 64 tokens (--rope-scaling none)"
        );
        let x = parse("none").extend(Some(&RopeScaling::Linear { factor: 2.0 }), 8192).unwrap();
        assert_eq!((x.scaling, x.max_position_embeddings), (None, 4096));
        // A longrope without a factor of its own: max / original, as read before the removal.
        let longrope = RopeScaling::LongRope(super::super::LongRope {
            short_factor: vec![1.0],
            long_factor: vec![2.0],
            factor: None,
            original_max_position_embeddings: 4096,
            attention_factor: None,
        });
        let x = parse("none").extend(Some(&longrope), 131072).unwrap();
        assert_eq!((x.scaling.clone(), x.max_position_embeddings), (None, 4096));
        assert!(x.describe().starts_with("RoPE: the checkpoint's longrope x32 scaling removed"), "{}", x.describe());
        let x = parse("none").extend(None, 512).unwrap();
        assert_eq!((x.scaling.clone(), x.max_position_embeddings), (None, 512));
        assert_eq!(x.describe(), "RoPE: no scaling, window 512 tokens (--rope-scaling none)");
    }

    #[test]
    fn the_warning_names_the_window_the_length_and_the_option() {
        assert_eq!(unscaled_window_warning(64, 64), None);
        let w = unscaled_window_warning(8192, 20000).unwrap();
        assert!(
            w.contains("--seq-len 20000") && w.contains("window of 8192") && w.contains("--rope-scaling yarn:3"),
            "{w}"
        );
    }
}
