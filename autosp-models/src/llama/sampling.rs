//! Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling, with a tiny
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
    /// transformers' order of warpers: temperature, then the `top_k` most likely tokens (ties by lower id),
    /// then of those, renormalised, the nucleus of `top_p` (1: all of them), then a draw; `temperature > 0`,
    /// `top_k >= 1`, `0 < top_p <= 1`.
    TopK { temperature: f64, top_k: usize, top_p: f64 },
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
        Sampling::TopP { temperature, top_p } => nucleus(logits, temperature, logits.len(), top_p, rng),
        Sampling::TopK { temperature, top_k, top_p } => {
            if top_k == 0 {
                return Err(ModelError::Generate("top_k must be at least 1 (use Sampling::Greedy for 1)".into()));
            }
            nucleus(logits, temperature, top_k, top_p, rng)
        }
    }
}

/// A draw from the `top_k` most likely tokens after `temperature`, renormalised, cut to the nucleus of
/// `top_p`.
fn nucleus(logits: &[f32], temperature: f64, top_k: usize, top_p: f64, rng: &mut SampleRng) -> ModelResult<u32> {
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(ModelError::Generate(format!(
            "temperature must be finite and > 0 (use Sampling::Greedy for 0), got {temperature}"
        )));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ModelError::Generate(format!("top_p must be in (0, 1], got {top_p}")));
    }
    let mut p: Vec<(usize, f64)> = probabilities(logits, temperature).into_iter().enumerate().collect();
    p.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    p.truncate(top_k);
    let kept: f64 = p.iter().map(|c| c.1).sum();
    let mut total = 0.0;
    let mut keep = 0;
    for &(_, q) in &p {
        total += q;
        keep += 1;
        if total >= top_p * kept {
            break;
        }
    }
    p.truncate(keep);
    Ok(draw(&p, total, rng) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_draws_only_the_k_most_likely_and_top_p_cuts_inside_them() {
        let logits = [0.0f32, 3.0, 2.5, 1.0, 2.9];
        let mut rng = SampleRng::new(7);
        let mut seen = [0usize; 5];
        for _ in 0..2000 {
            let s = Sampling::TopK { temperature: 1.0, top_k: 2, top_p: 1.0 };
            seen[sample(&logits, &s, &mut rng).unwrap() as usize] += 1;
        }
        // Only ids 1 and 4 (the two largest), in the ratio e^3 : e^2.9 (about 0.525 : 0.475).
        assert_eq!(seen[0] + seen[2] + seen[3], 0);
        let share = seen[1] as f64 / 2000.0;
        assert!((share - 0.525).abs() < 0.05, "share of id 1: {share}");
        // top_p inside the top 3 (renormalised: 0.38, 0.35, 0.27): 0.5 keeps ids 1 and 4 only.
        for _ in 0..500 {
            let s = Sampling::TopK { temperature: 1.0, top_k: 3, top_p: 0.5 };
            assert!([1, 4].contains(&sample(&logits, &s, &mut rng).unwrap()));
        }
        // top_k 1 is greedy; 0 is refused.
        let one = Sampling::TopK { temperature: 5.0, top_k: 1, top_p: 1.0 };
        assert_eq!(sample(&logits, &one, &mut rng).unwrap(), 1);
        assert!(sample(&logits, &Sampling::TopK { temperature: 1.0, top_k: 0, top_p: 1.0 }, &mut rng).is_err());
    }
}
