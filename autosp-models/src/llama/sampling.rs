//! Choosing the next token from logits: greedy, temperature and top-p (nucleus) sampling, with a tiny
//! seeded generator ([`SampleRng`], splitmix64) so that a seed gives the same text on every machine.

use super::error::{ModelError, ModelResult};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the first one on ties).
    Greedy,
    /// A draw from `softmax(logits / temperature)`; `temperature > 0`.
    Temperature(f64),
    /// A draw from the smallest set of most likely tokens whose probability (after temperature) reaches
    /// `top_p`, renormalised; `temperature > 0`, `0 < top_p <= 1`.
    TopP { temperature: f64, top_p: f64 },
}

/// The seeded generator sampling draws from.
pub type SampleRng = crate::rng::SplitMix64;

/// The index of the largest logit (the first on ties); NaN logits never win.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best
}

/// `softmax(logits / temperature)` in f64.
fn probabilities(logits: &[f32], temperature: f64) -> Vec<f64> {
    let m = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let e: Vec<f64> = logits.iter().map(|&x| ((x as f64 - m) / temperature).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// Draws an index from `(index, probability)` pairs whose probabilities sum to `total`.
fn draw(candidates: &[(usize, f64)], total: f64, rng: &mut SampleRng) -> usize {
    let mut u = rng.uniform() * total;
    for &(i, p) in candidates {
        if u < p {
            return i;
        }
        u -= p;
    }
    candidates.last().map(|c| c.0).unwrap_or(0)
}

/// The next token from `logits: [vocab]`.
pub fn sample(logits: &[f32], sampling: &Sampling, rng: &mut SampleRng) -> ModelResult<u32> {
    if logits.is_empty() {
        return Err(ModelError::Generate("no logits to sample from (vocabulary of size 0)".into()));
    }
    let check_t = |t: f64| {
        if t.is_finite() && t > 0.0 {
            Ok(())
        } else {
            Err(ModelError::Generate(format!(
                "temperature must be finite and > 0 (use Sampling::Greedy for 0), got {t}"
            )))
        }
    };
    match *sampling {
        Sampling::Greedy => Ok(argmax(logits) as u32),
        Sampling::Temperature(t) => {
            check_t(t)?;
            let p: Vec<(usize, f64)> = probabilities(logits, t).into_iter().enumerate().collect();
            Ok(draw(&p, 1.0, rng) as u32)
        }
        Sampling::TopP { temperature, top_p } => {
            check_t(temperature)?;
            if !(top_p > 0.0 && top_p <= 1.0) {
                return Err(ModelError::Generate(format!("top_p must be in (0, 1], got {top_p}")));
            }
            let mut p: Vec<(usize, f64)> = probabilities(logits, temperature).into_iter().enumerate().collect();
            p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let mut total = 0.0;
            let mut keep = 0;
            for &(_, q) in &p {
                total += q;
                keep += 1;
                if total >= top_p {
                    break;
                }
            }
            p.truncate(keep);
            Ok(draw(&p, total, rng) as u32)
        }
    }
}
