//! The generation loop over a compiled model: checks, the sequence-parallel prefill into the sharded cache,
//! the last position's logits, then one decode forward per new token, each token sampled (the same on every
//! rank: same logits, same seeded generator) and streamed to the caller.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use autosp_core::comm::broadcast;
use autosp_core::module::visit_mut;
use autosp_core::{Attention, Tape};
use autosp_models::config::ModelType;
use autosp_models::llama::{sample, SampleRng};
use autosp_models::{GenerateConfig, LlamaModel, RopeScaling};
use candle_core::{DType, Tensor};

use super::cache::ShardedKv;
use super::slots::{lock, DecodeAttention, PrefillAttention, SharedKv};
use super::stats::{per_second, GenerateStats};
use super::weights::inference_copy;
use super::{Finish, Generated, InferError, TokenEvent};
use crate::Compiled;
use autosp_core::comm::abort_on_error;

/// The stop tokens `cfg` asks for, or the config's end tokens.
fn stop_tokens(model: &LlamaModel, cfg: &GenerateConfig) -> Result<Vec<u32>, InferError> {
    let c = &model.config;
    let stop = match &cfg.stop_tokens {
        Some(s) => s.clone(),
        None if !c.eos_token_ids.is_empty() => c.eos_token_ids.clone(),
        None => c.eos_token_id.into_iter().collect(),
    };
    if let Some(&id) = stop.iter().find(|&&id| id as usize >= c.vocab_size) {
        return Err(InferError::UnknownStopToken { id, vocab: c.vocab_size });
    }
    Ok(stop)
}

/// The checks that need no forward: the prompt's ids and the positions.
fn check_request(model: &LlamaModel, prompt: &[u32], cfg: &GenerateConfig) -> Result<(), InferError> {
    let c = &model.config;
    if prompt.is_empty() {
        return Err(InferError::EmptyPrompt);
    }
    if let Some((index, &id)) = prompt.iter().enumerate().find(|(_, &id)| id as usize >= c.vocab_size) {
        return Err(InferError::TokenOutOfVocab { id, index, vocab: c.vocab_size });
    }
    let total = prompt.len() + cfg.max_new_tokens;
    if c.rope_scaling.is_none() && total > c.max_position_embeddings {
        return Err(InferError::TooLong {
            prompt: prompt.len(),
            new: cfg.max_new_tokens,
            max: c.max_position_embeddings,
        });
    }
    Ok(())
}

/// Puts `make(layer, slot's attention)` into every attention slot of `model`, in layer order.
fn fill_slots(model: &mut LlamaModel, make: &mut dyn FnMut(usize, Arc<dyn Attention>) -> Arc<dyn Attention>) {
    let mut layer = 0;
    visit_mut(model, "", &mut |_, m| {
        if let Some(s) = m.attention_slot() {
            let inner = s.get().clone();
            s.set(make(layer, inner));
            layer += 1;
        }
    });
}

/// The logits `[vocab]` (f32) of `hidden: [1, 1, hidden]`.
fn logits_of(model: &LlamaModel, tape: &Tape, hidden: &Tensor) -> Result<Vec<f32>, InferError> {
    let logits = model.head(tape, &tape.constant(hidden.clone()))?;
    Ok(logits.tensor().flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// The position whose forward transformers' Phi-3 generation turns into a new prefill of the whole sequence
/// (`Phi3ForCausalLM.prepare_inputs_for_generation`: the first forward past the original window drops the
/// cache built with LongRoPE's short factors), for a Phi-3 model with a LongRoPE scaling; `None` otherwise.
fn relongrope_position(model: &LlamaModel) -> Option<usize> {
    match &model.config.rope_scaling {
        Some(RopeScaling::LongRope(l)) if model.config.model_type == ModelType::Phi3 => {
            Some(l.original_max_position_embeddings)
        }
        _ => None,
    }
}

impl Compiled<LlamaModel> {
    /// Prefills `seq` into a new sharded cache (see [`crate::infer`]) with `model`'s slots, then leaves its
    /// slots decoding over that cache. Returns the cache and the logits `[vocab]` of `seq`'s last position.
    ///
    /// `compiled`: the compiled attention of each layer (what the slots held before the first prefill).
    fn prefill(
        &self,
        model: &mut LlamaModel,
        compiled: &[Arc<dyn Attention>],
        seq: &[u32],
    ) -> Result<(SharedKv, Vec<f32>), InferError> {
        let sp = self.sp_group().clone();
        let (p, rank, n) = (sp.size(), sp.rank(), seq.len());
        let n_pad = self.padded_len(n);
        // Every rank's real (unpadded) rows: the first ones of its shard (positions ascend in every layout). The
        // rank holding the last position computes the first token's logits.
        let (mut fills, mut root) = (Vec::with_capacity(p), 0);
        for r in 0..p {
            let pos = self.positions(n_pad, r)?;
            debug_assert!(pos.windows(2).all(|w| w[0] < w[1]), "a rank's positions ascend");
            fills.push(pos.iter().filter(|&&x| x < n).count());
            if pos.contains(&(n - 1)) {
                root = r;
            }
        }
        let positions = self.positions(n_pad, rank)?;
        let keep: Arc<[usize]> = positions.iter().copied().filter(|&x| x < n).collect();
        let cache: SharedKv = Arc::new(Mutex::new(ShardedKv::new(model.layers.0.len(), rank, fills)));
        fill_slots(model, &mut |layer, _| {
            let inner = compiled[layer].clone();
            Arc::new(PrefillAttention { inner, layer, positions: keep.clone(), cache: cache.clone() })
        });
        let mut padded = seq.to_vec();
        padded.resize(n_pad, 0);
        let local: Vec<u32> = positions.iter().map(|&x| padded[x]).collect();
        let ids = Tensor::from_vec(local, (1, positions.len()), &self.device())?;
        let tape = Tape::inference();
        tape.set_inputs_checked();
        tape.set_sequence_length(n);
        let hidden = model.hidden_states(&tape, &ids, &positions)?.into_tensor();
        // The last position's hidden row, from the rank that holds it, to every rank: only its logits are made.
        let row = match positions.iter().position(|&x| x == n - 1) {
            Some(i) => hidden.narrow(1, i, 1)?,
            None => Tensor::zeros((1, 1, hidden.dim(2)?), hidden.dtype(), hidden.device())?,
        };
        drop(hidden);
        let row = if p > 1 { broadcast(sp.as_ref(), &row.contiguous()?, root)? } else { row };
        let logits = logits_of(model, &tape, &row)?;
        fill_slots(model, &mut |layer, _| Arc::new(DecodeAttention { layer, cache: cache.clone(), group: sp.clone() }));
        Ok((cache, logits))
    }

    /// Generates up to `cfg.max_new_tokens` tokens after `prompt` (see [`generate_streaming`]); collective
    /// over the world: every rank calls it with the same prompt and config, and every rank returns the same
    /// tokens.
    ///
    /// [`generate_streaming`]: Self::generate_streaming
    pub fn generate(&self, prompt: &[u32], cfg: &GenerateConfig) -> Result<Generated, InferError> {
        self.generate_streaming(prompt, cfg, |_| true)
    }

    /// Generates after `prompt` (ids of the model's vocabulary), calling `on_token` with each new token and
    /// its logits as soon as it is chosen; `on_token` returning `false` stops the generation there
    /// ([`Finish::Interrupted`], the token kept). The prompt is prefilled sequence-parallel with the compiled
    /// strategy, each rank keeping the keys and values of its shard ([`crate::infer`]); each new token is
    /// decoded against every rank's part, merged by LSE, one all-gather per layer. Ends at a stop token
    /// (`cfg.stop_tokens`, else the config's end tokens; included), after `cfg.max_new_tokens`, or when
    /// `on_token` says so. `max_new_tokens` 0 runs the prefill only (its figures in the stats).
    ///
    /// Collective over the world, as [`generate`](Self::generate): `on_token` must answer alike on every rank
    /// (the command line agrees on a stop with one all-reduce per token). A request that a rank refuses is
    /// refused by every rank at once (one all-gather; the group stays usable): that rank's error, on the others
    /// [`InferError::RefusedElsewhere`]. An error past that on one rank is told to the others
    /// ([`ProcessGroup::abort`](autosp_core::comm::ProcessGroup::abort)), whose calls fail at once naming it.
    pub fn generate_streaming(
        &self,
        prompt: &[u32],
        cfg: &GenerateConfig,
        on_token: impl FnMut(&TokenEvent<'_>) -> bool,
    ) -> Result<Generated, InferError> {
        let start = Instant::now();
        // The request's checks, agreed over the world (every rank refuses together, the group still usable);
        // past them a rank's error is told to the others (the ranks are then in the collectives of the prefill
        // and decode, which they would otherwise wait in until the group's timeout).
        let request = check_request(self.model(), prompt, cfg).and_then(|()| stop_tokens(self.model(), cfg));
        let stop = self.agree_request(request)?;
        let world = self.group().clone();
        abort_on_error(world.as_ref(), self.generate_checked(prompt, cfg, &stop, start, on_token))
    }

    /// `mine` (this rank's checks of a request) where every rank of the world accepted the request (collective
    /// over more than one rank: one all-gather of a flag); else this rank's error, or one naming the ranks that
    /// refused it. Every rank is to call `generate` with the same request, so they agree but for a caller's
    /// mistake.
    fn agree_request<T>(&self, mine: Result<T, InferError>) -> Result<T, InferError> {
        let world = self.group();
        if world.size() == 1 {
            return mine;
        }
        let flag = Tensor::new(&[f32::from(u8::from(mine.is_err()))], &candle_core::Device::Cpu)?;
        let flags = world.all_gather(&flag, 0).map_err(autosp_core::Error::from)?.to_vec1::<f32>()?;
        let ranks: Vec<usize> = flags.iter().enumerate().filter(|(_, &f)| f > 0.0).map(|(r, _)| r).collect();
        match (mine, ranks.is_empty()) {
            (Ok(v), true) => Ok(v),
            (Err(e), _) => Err(e),
            (Ok(_), false) => Err(InferError::RefusedElsewhere { ranks }),
        }
    }

    /// [`generate_streaming`](Self::generate_streaming) past the request's checks (`stop`: its stop tokens),
    /// an error not yet told to the other ranks.
    fn generate_checked(
        &self,
        prompt: &[u32],
        cfg: &GenerateConfig,
        stop: &[u32],
        start: Instant,
        mut on_token: impl FnMut(&TokenEvent<'_>) -> bool,
    ) -> Result<Generated, InferError> {
        let (mut model, gathered) = inference_copy(self.model())?;
        let sp = self.sp_group().clone();
        let (p, n) = (sp.size(), prompt.len());
        let layers = model.layers.0.len();
        let mut compiled = Vec::with_capacity(layers);
        fill_slots(&mut model, &mut |_, inner| {
            compiled.push(inner.clone());
            inner
        });
        let (mut cache, mut logits) = self.prefill(&mut model, &compiled, prompt)?;
        let query_rows = lock(&cache).query_rows.first().copied().unwrap_or(0);
        let prefill_seconds = start.elapsed().as_secs_f64();

        // Decode: one token at a time over the sharded cache.
        let device = self.device();
        let restart = relongrope_position(&model);
        let mut rng = SampleRng::new(cfg.seed);
        let mut tokens = Vec::with_capacity(cfg.max_new_tokens);
        let mut finish = Finish::Length;
        let decode_start = Instant::now();
        while tokens.len() < cfg.max_new_tokens {
            let token = sample(&logits, &cfg.sampling, &mut rng)?;
            tokens.push(token);
            let go_on = on_token(&TokenEvent { index: tokens.len() - 1, token, logits: &logits });
            if stop.contains(&token) {
                finish = Finish::Stop;
                break;
            }
            if !go_on {
                finish = Finish::Interrupted;
                break;
            }
            if tokens.len() == cfg.max_new_tokens {
                break;
            }
            let pos = n + tokens.len() - 1;
            if restart == Some(pos) {
                // transformers' Phi-3 drops its cache when the sequence first passes the original window and
                // prefills it again, every key with the long factors.
                let seq: Vec<u32> = prompt.iter().chain(&tokens).copied().collect();
                (cache, logits) = self.prefill(&mut model, &compiled, &seq)?;
                continue;
            }
            lock(&cache).begin_token(pos);
            let tape = Tape::inference();
            tape.set_inputs_checked();
            let ids = Tensor::from_vec(vec![token], (1, 1), &device)?;
            let hidden = model.hidden_states(&tape, &ids, &[pos])?.into_tensor();
            logits = logits_of(&model, &tape, &hidden)?;
        }
        let decode_seconds = if tokens.len() > 1 { decode_start.elapsed().as_secs_f64() } else { 0.0 };

        let c = lock(&cache);
        let d = self.model().config.head_dim;
        let heads = self.model().config.num_attention_heads;
        let stats = GenerateStats {
            prompt_tokens: n,
            new_tokens: tokens.len(),
            ranks: p,
            prefill_seconds,
            decode_seconds,
            prefill_tokens_per_s: per_second(n, prefill_seconds),
            decode_tokens_per_s: per_second(tokens.len().saturating_sub(1), decode_seconds),
            query_rows,
            kv_rows: c.rows()?,
            kv_cache_bytes: c.bytes(),
            gathered_weight_bytes: gathered,
            decode_comm_bytes_per_token: if p > 1 { layers * p * (heads * (d + 1) + 1) * 4 } else { 0 },
        };
        Ok(Generated { tokens, finish, stats })
    }
}
