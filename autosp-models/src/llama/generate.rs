//! Text generation: prefill the prompt into a [`KvCache`], then decode one token at a time on an
//! inference tape, choosing each token with a [`Sampling`] rule, until an end token or the token limit.

use autosp_core::Tape;
use candle_core::{DType, Tensor};

use super::error::{ModelError, ModelResult};
use super::kv_cache::KvCache;
use super::model::LlamaModel;
use super::sampling::{sample, SampleRng, Sampling};

/// What to generate and how.
#[derive(Clone, Debug)]
pub struct GenerateConfig {
    /// At most this many new tokens.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Seed of the sampling generator.
    pub seed: u64,
    /// Tokens that end generation (included in the output). `None`: the config's `eos_token_id`.
    pub stop_tokens: Option<Vec<u32>>,
}

impl Default for GenerateConfig {
    /// 32 greedy tokens, seed 0, stopping at the config's end token.
    fn default() -> Self {
        Self { max_new_tokens: 32, sampling: Sampling::Greedy, seed: 0, stop_tokens: None }
    }
}

/// The result of [`LlamaModel::generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The new tokens (the prompt not included), ending with the stop token when one was produced.
    pub tokens: Vec<u32>,
    /// Whether a stop token ended generation (else the token limit did).
    pub stopped: bool,
}

impl LlamaModel {
    /// The last position's logits `[vocab]` (f32) of `logits: [1, n, vocab]`.
    fn last_logits(logits: &Tensor) -> ModelResult<Vec<f32>> {
        let n = logits.dim(1)?;
        Ok(logits.narrow(1, n - 1, 1)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }

    /// Generates up to `cfg.max_new_tokens` tokens after `prompt` (batch 1): one prefill forward over the
    /// prompt, then one cached forward per new token, all on an inference tape.
    pub fn generate(&self, prompt: &[u32], cfg: &GenerateConfig) -> ModelResult<Generation> {
        if prompt.is_empty() {
            return Err(ModelError::Generate("the prompt is empty; give at least one token (e.g. BOS)".into()));
        }
        let stop = cfg.stop_tokens.clone().unwrap_or_else(|| self.config.eos_token_id.into_iter().collect());
        let tape = Tape::inference();
        let device = self.device();
        let mut cache = KvCache::new(self.layers.0.len());
        let mut rng = SampleRng::new(cfg.seed);
        let mut out = Vec::new();
        let mut next = Tensor::from_slice(prompt, (1, prompt.len()), &device)?;
        while out.len() < cfg.max_new_tokens {
            let logits = self.forward_cached(&tape, &next, &mut cache)?;
            let token = sample(&Self::last_logits(logits.tensor())?, &cfg.sampling, &mut rng)?;
            out.push(token);
            if stop.contains(&token) {
                return Ok(Generation { tokens: out, stopped: true });
            }
            next = Tensor::from_slice(&[token], (1, 1), &device)?;
        }
        Ok(Generation { tokens: out, stopped: false })
    }
}
