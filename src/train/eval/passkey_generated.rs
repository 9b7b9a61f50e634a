//! The passkey grid scored by generation (`--eval-passkey-generate`): each sample's prompt (its ids before the
//! first answer token) is given to [`Compiled::generate`], which greedily writes the answer's tokens plus
//! [`EXTRA_TOKENS`]; a hit when the generated text's first run of digits is the key's digits (through the
//! model's tokenizer), or, with fixed ids, when the generated ids start with the answer's ids.
//!
//! This can differ from the one-forward score ([`PasskeyGrid::evaluate`]): that one is teacher-forced (each
//! answer token is judged with the true earlier answer tokens given), while generation must write the
//! lead-in and format itself (a space, a tokenization of the digits other than the prompt's, digits spread
//! over tokens the model chooses) and goes on from its own earlier tokens. With fixed ids and an exact
//! prefix the two agree: greedy generation writes the `k` answer ids iff each is the argmax given the true
//! ones before it.

use autosp_models::tokenizer::decode;
use autosp_models::{GenerateConfig, LlamaConfig, LlamaModel, Sampling};

use super::passkey::{PasskeyGrid, PasskeyScores};
use crate::train::error::{Result, TrainError};
use crate::train::stream::Sample;
use crate::train::synthetic::PasskeyVocab;
use crate::Compiled;

/// New tokens generated beyond the answer's own, room for a lead-in (a space, a quote) before the digits.
pub const EXTRA_TOKENS: usize = 4;

/// The first run of ASCII digits in `text` (empty when it has none).
fn first_digits(text: &str) -> &str {
    let Some(start) = text.find(|ch: char| ch.is_ascii_digit()) else { return "" };
    let rest = &text[start..];
    let end = rest.find(|ch: char| !ch.is_ascii_digit()).unwrap_or(rest.len());
    &rest[..end]
}

/// The new tokens to generate after a prompt of `prompt` tokens whose answer takes `answer`: `answer` +
/// [`EXTRA_TOKENS`], fewer where a model without a RoPE scaling has fewer positions left (never fewer than
/// `answer`; [`PasskeyGrid::check_generation`] refuses lengths where that does not fit).
fn new_tokens(config: &LlamaConfig, prompt: usize, answer: usize) -> usize {
    let wanted = answer + EXTRA_TOKENS;
    match config.rope_scaling {
        None => wanted.min(config.max_position_embeddings.saturating_sub(prompt)).max(answer),
        Some(_) => wanted,
    }
}

/// Whether greedy generation after `sample`'s prompt writes its key (see the module doc). Collective: every
/// rank calls it with the same sample.
pub fn generated_hit(c: &Compiled<LlamaModel>, vocab: &PasskeyVocab, sample: &Sample) -> Result<bool> {
    let first = *sample.answers.first().ok_or_else(|| {
        TrainError::Config("--eval-passkey-generate: a passkey sample has no answer tokens to generate".into())
    })?;
    let answer: Vec<u32> = sample.answers.iter().map(|&a| sample.ids[a]).collect();
    let prompt = &sample.ids[..first];
    let cfg = GenerateConfig {
        max_new_tokens: new_tokens(&c.model().config, prompt.len(), answer.len()),
        sampling: Sampling::Greedy,
        seed: 0,
        stop_tokens: None,
    };
    let got = c
        .generate(prompt, &cfg)
        .map_err(|e| TrainError::Config(format!("--eval-passkey-generate: a {}-token prompt: {e}", prompt.len())))?
        .tokens;
    Ok(match vocab {
        PasskeyVocab::Ids { .. } => got.starts_with(&answer),
        PasskeyVocab::Text(tok) => {
            let key = decode(tok, &answer)?;
            let key = first_digits(&key);
            !key.is_empty() && first_digits(&decode(tok, &got)?) == key
        }
    })
}

impl PasskeyGrid {
    /// Scores every cell by generation ([`generated_hit`] per sample; collective: every rank calls it). The
    /// scores' `generated` is set, so their lines read `{"eval":"passkey_generated",..}`.
    pub fn evaluate_generated(&self, c: &Compiled<LlamaModel>) -> Result<PasskeyScores> {
        self.score_cells(true, |samples| {
            let mut hits = 0;
            for s in samples {
                hits += usize::from(generated_hit(c, &self.vocab, s)?);
            }
            Ok(hits)
        })
    }

    /// Refuses, naming `--eval-passkey-generate`, lengths that generation cannot run on a model of `config`:
    /// without a RoPE scaling, generation stops at `max_position_embeddings` (the one-forward grid scores
    /// longer prompts anyway).
    pub fn check_generation(&self, config: &LlamaConfig) -> Result<()> {
        let max = config.max_position_embeddings;
        match self.lengths.iter().find(|&&l| l > max) {
            Some(l) if config.rope_scaling.is_none() => Err(TrainError::Config(format!(
                "--eval-passkey-generate cannot generate after a {l}-token prompt (--eval-passkey {l}): the model \
                 has no rope_scaling and serves {max} positions; give --eval-passkey lengths up to {max}, or score \
                 {l} with the one-forward grid alone (without --eval-passkey-generate)"
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_run_of_digits_is_read_whatever_surrounds_it() {
        assert_eq!(first_digits(" 12345."), "12345");
        assert_eq!(first_digits("is 123 45"), "123");
        assert_eq!(first_digits("no key"), "");
        assert_eq!(first_digits("9"), "9");
    }
}
