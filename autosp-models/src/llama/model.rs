//! [`LlamaModel`]: a Llama-family causal LM (llama, mistral, qwen2, qwen3, phi3, gemma3_text, SmolLM) on the
//! autosp tape, built from autosp-core modules: embedding, decoder layers, final norm, LM head (tied or not).
//! Parameters carry their HF tensor names, so a model goes to and from an HF weights map unchanged (Phi-3's
//! fused projections are split on the way in and fused on the way out: `crate::fused`).
//!
//! Every forward takes an explicit position per token, so a shard of a sequence can start anywhere.

use std::collections::HashMap;

use autosp_core::module::{all_params, Module};
use autosp_core::nn::{Embedding, Linear, RmsNorm};
use autosp_core::ops::{self, rope_tables_scaled, AttentionSpec};
use autosp_core::{Param, RegionSlot, ShardLevel, Tape, Value};
use candle_core::{DType, Device, Tensor};

use super::attention::{LlamaAttention, RotaryTables};
use super::block::LlamaDecoderLayer;
use super::error::{ModelError, ModelResult};
use super::kv_cache::KvCache;
use super::mlp::LlamaMlp;
use crate::config::LlamaConfig;
use crate::gguf::import_gguf;
use crate::hub::{resolve_model, HubOptions};
use crate::rope::{RopeExtended, RopeExtension, RopeFrequencies};
use crate::save::{save_model, SaveOptions};
use crate::weights::load_weights;

/// The decoder layers, as a module whose children are named `0, 1, ..` (paths `layers.{i}`).
#[derive(Clone, Debug)]
pub struct LlamaLayers(pub Vec<LlamaDecoderLayer>);

impl Module for LlamaLayers {
    fn kind(&self) -> &'static str {
        "LlamaLayers"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.0.iter().enumerate().map(|(i, l)| (i.to_string(), l as &dyn Module)).collect()
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        self.0.iter_mut().enumerate().map(|(i, l)| (i.to_string(), l as &mut dyn Module)).collect()
    }
}

/// A Llama-family causal language model. `embed_tokens: [vocab, hidden]`; `lm_head: [vocab, hidden]` or
/// `None` when the config ties it to the embedding.
#[derive(Clone, Debug)]
pub struct LlamaModel {
    pub config: LlamaConfig,
    pub embed_tokens: Embedding,
    pub layers: LlamaLayers,
    pub norm: RmsNorm,
    pub lm_head: Option<Linear>,
    /// RoPE inverse frequencies `[head_dim / 2]`, scaling applied, and the factor on cos and sin, for a
    /// sequence inside the original window (a `dynamic` or `longrope` scaling recomputes them per forward).
    rope: RopeFrequencies,
    /// Those of the sliding-window layers when they have their own (Gemma 3's local RoPE base).
    inv_freq_local: Option<Vec<f64>>,
}

/// Takes `name` out of `weights`, checking its shape.
fn take(weights: &mut HashMap<String, Tensor>, name: &str, shape: &[usize]) -> ModelResult<Param> {
    let t = weights
        .remove(name)
        .ok_or_else(|| ModelError::MissingWeight { name: name.into(), expected: shape.to_vec() })?;
    if t.dims() != shape {
        return Err(ModelError::WeightShape { name: name.into(), expected: shape.to_vec(), found: t.dims().to_vec() });
    }
    Ok(Param::new(name, t))
}

/// The linear layer `{prefix}.weight: [out, inp]` and, with `bias`, `{prefix}.bias: [out]`.
fn linear(
    weights: &mut HashMap<String, Tensor>,
    prefix: &str,
    out: usize,
    inp: usize,
    bias: bool,
) -> ModelResult<Linear> {
    let weight = take(weights, &format!("{prefix}.weight"), &[out, inp])?;
    let bias = if bias { Some(take(weights, &format!("{prefix}.bias"), &[out])?) } else { None };
    Ok(Linear::new(weight, bias))
}

impl LlamaModel {
    /// Builds the model from an HF weights map (`model.layers.0.self_attn.q_proj.weight` -> tensor), as
    /// [`load_weights`] or [`random_weights`](crate::random_weights) return it. Every tensor the config
    /// implies must be there with its shape; any other tensor is an error, except a tied model's
    /// `lm_head.weight` and `rotary_emb.inv_freq` buffers, which are ignored as transformers does.
    pub fn from_weights(config: &LlamaConfig, mut weights: HashMap<String, Tensor>) -> ModelResult<Self> {
        let c = config;
        // Phi-3's fused q/k/v and gate/up, as its files hold them, split (a map split already passes).
        crate::fused::split(c, &mut weights)?;
        let (hid, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_out, kv_out) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let (eps, offset) = (c.rms_norm_eps, c.model_type.norm_offset());
        let embed_tokens = Embedding {
            table: take(&mut weights, "model.embed_tokens.weight", &[c.vocab_size, hid])?,
            // transformers' every family: `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`.
            padding_idx: c.padding_idx(),
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let w = &mut weights;
            let bias = c.attention_bias;
            let self_attn = LlamaAttention::new(
                linear(w, &format!("{p}.self_attn.q_proj"), q_out, hid, bias)?,
                linear(w, &format!("{p}.self_attn.k_proj"), kv_out, hid, bias)?,
                linear(w, &format!("{p}.self_attn.v_proj"), kv_out, hid, bias)?,
                linear(w, &format!("{p}.self_attn.o_proj"), hid, q_out, c.o_proj_bias())?,
                c.num_attention_heads,
                c.num_key_value_heads,
                hd,
            )
            .with_window(c.attention_window(i))
            .with_scale(c.attention_scale());
            let self_attn = if c.model_type.qk_norm() {
                let norm = |w: &mut HashMap<String, Tensor>, which: &str| -> ModelResult<RmsNorm> {
                    Ok(RmsNorm { weight: take(w, &format!("{p}.self_attn.{which}.weight"), &[hd])?, eps, offset })
                };
                let (q_norm, k_norm) = (norm(w, "q_norm")?, norm(w, "k_norm")?);
                self_attn.with_qk_norm(q_norm, k_norm)
            } else {
                self_attn
            };
            let mlp = LlamaMlp {
                gate_proj: linear(w, &format!("{p}.mlp.gate_proj"), inter, hid, false)?,
                up_proj: linear(w, &format!("{p}.mlp.up_proj"), inter, hid, false)?,
                down_proj: linear(w, &format!("{p}.mlp.down_proj"), hid, inter, false)?,
                activation: c.model_type.activation(),
            };
            let mut norm = |name: &str| -> ModelResult<RmsNorm> {
                Ok(RmsNorm { weight: take(w, &format!("{p}.{name}.weight"), &[hid])?, eps, offset })
            };
            let input_layernorm = norm("input_layernorm")?;
            let post_attention_layernorm = norm("post_attention_layernorm")?;
            let feedforward_norms = if c.model_type.sandwich_norms() {
                Some((norm("pre_feedforward_layernorm")?, norm("post_feedforward_layernorm")?))
            } else {
                None
            };
            layers.push(LlamaDecoderLayer {
                index: i,
                input_layernorm,
                self_attn,
                post_attention_layernorm,
                mlp,
                feedforward_norms,
                local_rope: c.layer_types.get(i) == Some(&crate::config::LayerType::Sliding),
                region: RegionSlot::default(),
            });
        }
        let norm = RmsNorm { weight: take(&mut weights, "model.norm.weight", &[hid])?, eps, offset };
        let lm_head = if c.tie_word_embeddings {
            weights.remove("lm_head.weight");
            None
        } else {
            Some(linear(&mut weights, "lm_head", c.vocab_size, hid, false)?)
        };
        weights.retain(|name, _| !crate::weights::ignorable(name));
        let mut left: Vec<_> = weights.into_iter().collect();
        left.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some((name, t)) = left.into_iter().next() {
            return Err(ModelError::UnexpectedWeight { name, found: t.dims().to_vec() });
        }
        Ok(Self {
            config: config.clone(),
            embed_tokens,
            layers: LlamaLayers(layers),
            norm,
            lm_head,
            rope: config.rope_frequencies(0),
            inv_freq_local: config.rope_inv_freq_local(),
        })
    }

    /// Loads a model from a local directory, a hub repo id (`owner/name[@revision]`, cache first) or a
    /// Llama GGUF file (`*.gguf`, dequantised) in `dtype` on the CPU.
    pub fn load(model: &str, dtype: DType) -> ModelResult<Self> {
        Self::load_on(model, dtype, &Device::Cpu)
    }

    /// [`load`](Self::load) onto `device`.
    pub fn load_on(model: &str, dtype: DType, device: &Device) -> ModelResult<Self> {
        let path = std::path::Path::new(model);
        if path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            let g = import_gguf(path, dtype, device)?;
            return Self::from_weights(&g.config, g.weights);
        }
        let resolved = resolve_model(model, &HubOptions::default())?;
        let config = LlamaConfig::from_file(&resolved.config)?;
        let weights = load_weights(&resolved.weights, &config, dtype, device)?;
        Self::from_weights(&config, weights)
    }

    /// The weights as an HF map (HF names -> current tensors), for saving; a tied model has no `lm_head.weight`.
    pub fn to_weights(&self) -> HashMap<String, Tensor> {
        self.params().into_iter().map(|p| (p.name().to_string(), p.tensor())).collect()
    }

    /// Saves `config.json` and the weights (HF names) into `dir` so that transformers loads it unchanged
    /// (see [`save_model`]: written aside, then renamed into place).
    pub fn save(&self, dir: &std::path::Path, opts: &SaveOptions) -> ModelResult<()> {
        Ok(save_model(dir, &self.config, &self.to_weights(), opts)?)
    }

    /// Every parameter, depth first (embedding, layers, norm, head).
    pub fn params(&self) -> Vec<Param> {
        all_params(self)
    }

    /// The dtype of the weights.
    pub fn dtype(&self) -> DType {
        self.embed_tokens.table.tensor().dtype()
    }

    /// The device of the weights.
    pub fn device(&self) -> Device {
        self.embed_tokens.table.tensor().device().clone()
    }

    /// The RoPE inverse frequencies `[head_dim / 2]` (scaling applied) for a sequence inside the original
    /// window.
    pub fn inv_freq(&self) -> &[f64] {
        &self.rope.inv_freq
    }

    /// Extends the model's context window (or removes its scaling, with `none`): its config's `rope_scaling`
    /// and `max_position_embeddings` ([`LlamaConfig::extend_rope`]) and the RoPE frequencies it caches, so
    /// that a model loaded as it was trained can train or run past its window, and saves the scaling into
    /// its config.json. Returns what it did (the line a run prints: [`RopeExtended::describe`]).
    pub fn extend_rope(&mut self, extension: &RopeExtension) -> ModelResult<RopeExtended> {
        let extended = self.config.extend_rope(extension)?;
        self.rope = self.config.rope_frequencies(0);
        Ok(extended)
    }

    /// Takes the positions of `config` (`rope_theta`, `rope_scaling`, `max_position_embeddings`; the rest of
    /// the model stays): an adapter's base loaded from its own files gets the scaling the adapter was trained
    /// with ([`crate::peft::base_config`]).
    pub fn set_positions_from(&mut self, config: &LlamaConfig) {
        self.config.rope_theta = config.rope_theta;
        self.config.rope_scaling = config.rope_scaling.clone();
        self.config.max_position_embeddings = config.max_position_embeddings;
        self.rope = self.config.rope_frequencies(0);
    }

    /// The RoPE frequencies a forward over `positions` on `tape` uses. A scaling that depends on the
    /// length (`dynamic`, `longrope`) reads the whole sequence's real length from the tape
    /// ([`Tape::sequence_length`], which the compiled step sets from the global, unpadded length, or for
    /// packed documents from the longest document's positions, [`position_extent`]), else from `positions`
    /// (largest + 1, transformers' `max(position_ids) + 1`; with documents these are the RoPE positions): a
    /// caller that runs one shard of a sequence itself must set it.
    ///
    /// [`position_extent`]: autosp_core::ops::Documents::position_extent
    pub fn rope_frequencies(&self, tape: &Tape, positions: &[usize]) -> RopeFrequencies {
        match &self.config.rope_scaling {
            Some(s) if s.depends_on_length() => {
                let len = tape.sequence_length().unwrap_or_else(|| positions.iter().max().map_or(0, |p| p + 1));
                self.config.rope_frequencies(len)
            }
            _ => self.rope.clone(),
        }
    }

    /// The RoPE tables of `positions` in the model's dtype, as constants on `tape` (cos and sin times the
    /// scaling's attention factor; see [`rope_frequencies`](Self::rope_frequencies)).
    pub fn rotary_tables(&self, tape: &Tape, positions: &[usize]) -> ModelResult<RotaryTables> {
        let rope = self.rope_frequencies(tape, positions);
        self.tables_of(tape, positions, &rope.inv_freq, rope.attention_factor)
    }

    fn tables_of(
        &self,
        tape: &Tape,
        positions: &[usize],
        inv_freq: &[f64],
        attention_factor: f64,
    ) -> ModelResult<RotaryTables> {
        let (cos, sin) = rope_tables_scaled(positions, inv_freq, attention_factor, self.dtype(), &self.device())?;
        Ok(RotaryTables { cos: tape.constant(cos), sin: tape.constant(sin) })
    }

    /// Checks `ids: [b, n]` u32 with every id in the vocabulary (read back to the host, unless the caller
    /// checked them there already: [`Tape::inputs_checked`]); returns `(b, n)`.
    fn check_ids(&self, tape: &Tape, ids: &Tensor) -> ModelResult<(usize, usize)> {
        let bad = || ModelError::BadIds { dims: ids.dims().to_vec(), dtype: ids.dtype() };
        if ids.rank() != 2 || ids.dtype() != DType::U32 || ids.elem_count() == 0 {
            return Err(bad());
        }
        let (b, n) = ids.dims2()?;
        if tape.inputs_checked() {
            return Ok((b, n));
        }
        let vocab = self.config.vocab_size;
        let flat = autosp_core::host_read::read_vec::<u32>(ids)?;
        if let Some((index, &id)) = flat.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(ModelError::TokenOutOfVocab { id, index, vocab });
        }
        Ok((b, n))
    }

    /// The final hidden states (after the last norm): `ids: [b, n]` u32, `positions: [n]` (the absolute
    /// position of each token, shared by the batch) -> `[b, n, hidden]`. Attention is causal over the `n`
    /// tokens given, with offsets `q_offset = k_offset = positions[0]`.
    ///
    /// Packed documents ([`Tape::set_documents`], one set for every row of `ids`): `positions` are then
    /// positions in the documents' window (the whole window `0..n` in order on one rank, or a rank's shard of
    /// it under sequence-parallel attention; positions past the window are padding), each token's RoPE
    /// position is [`Documents::position`](autosp_core::ops::Documents::position) (restarting at every
    /// document, as transformers' packed `position_ids`), and attention sees only the token's own document,
    /// with offsets 0 (the window's start: sequence-parallel attention places each shard itself).
    pub fn hidden_states(&self, tape: &Tape, ids: &Tensor, positions: &[usize]) -> ModelResult<Value> {
        let (_, n) = self.check_ids(tape, ids)?;
        if positions.len() != n {
            return Err(ModelError::PositionsMismatch { positions: positions.len(), seq: n });
        }
        match tape.documents() {
            None => {
                let spec = AttentionSpec::causal().shifted(positions[0], positions[0]);
                self.run_layers(tape, ids, positions, &spec, None)
            }
            Some(docs) => {
                let rope_positions: Vec<usize> = positions.iter().map(|&p| docs.position(p)).collect();
                let spec = AttentionSpec::causal().with_documents(Some(docs));
                self.run_layers(tape, ids, &rope_positions, &spec, None)
            }
        }
    }

    /// Embedding, layers and the final norm; with `cache`, each layer appends to its part of it.
    fn run_layers(
        &self,
        tape: &Tape,
        ids: &Tensor,
        positions: &[usize],
        spec: &AttentionSpec,
        mut cache: Option<&mut KvCache>,
    ) -> ModelResult<Value> {
        let rot = self.rotary_tables(tape, positions)?;
        let local = self.inv_freq_local.as_ref().map(|f| self.tables_of(tape, positions, f, 1.0)).transpose()?;
        let mut h = self.embed_tokens.forward(tape, &tape.constant(ids.clone()))?;
        if let Some(s) = self.config.embed_scale() {
            // Gemma: sqrt(hidden), rounded to the weights' dtype as transformers does (host data).
            let s = Tensor::new(&[s], &Device::Cpu)?.to_dtype(self.dtype())?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
            h = ops::scale(tape, &h, s)?;
        }
        for (i, layer) in self.layers.0.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers_mut()[i]);
            let rot = match &local {
                Some(l) if layer.local_rope => l,
                _ => &rot,
            };
            h = layer.forward(tape, &h, rot, spec, layer_cache)?;
        }
        Ok(super::norm::fused_norm(tape, &self.norm, &h)?)
    }

    /// The LM head: `hidden: [.., hidden]` -> `[.., vocab]` (the embedding matrix when tied).
    pub fn head(&self, tape: &Tape, hidden: &Value) -> ModelResult<Value> {
        let (weight, plain) = match &self.lm_head {
            Some(l) => (&l.weight, l.bias.is_none() && l.lora.is_none()),
            None => (&self.embed_tokens.table, true),
        };
        // Forward only, a head sharded at `parameters` is taken a vocabulary tile at a time, never whole (an
        // adapted or biased head is gathered whole). Checked first: this runs for every decoded token.
        let sliced = weight.shard().is_some_and(|s| s.level == ShardLevel::Parameters);
        if plain && sliced && !tape.is_recording() {
            let h = hidden.tensor();
            let flat = h.reshape(((), self.config.hidden_size))?;
            if let Some(logits) = autosp_kernels::sharded_head_logits(&flat, weight, self.block_elems())? {
                let mut dims = h.dims().to_vec();
                *dims.last_mut().expect("hidden has a feature dimension") = self.config.vocab_size;
                return Ok(tape.constant(logits.reshape(dims)?));
            }
        }
        Ok(match &self.lm_head {
            Some(l) => l.forward(tape, hidden)?,
            None => ops::linear(tape, hidden, &tape.param(&self.embed_tokens.table)?, None)?,
        })
    }

    /// Next-token logits for every position: `ids: [b, n]` u32, `positions: [n]` -> `[b, n, vocab]`.
    pub fn logits(&self, tape: &Tape, ids: &Tensor, positions: &[usize]) -> ModelResult<Value> {
        let h = self.hidden_states(tape, ids, positions)?;
        self.head(tape, &h)
    }

    /// Next-token logits of the positions `rows` (indices into `0..n`) only: `ids: [b, n]` u32, `positions:
    /// [n]` -> `[b, rows.len(), vocab]`. The head sees only those rows (at `parameters` it is taken a tile at a
    /// time). Forward only: on an inference tape; collective where the model is sharded.
    pub fn logits_at(&self, tape: &Tape, ids: &Tensor, positions: &[usize], rows: &[usize]) -> ModelResult<Value> {
        autosp_core::module::check_logits_at_tape(tape)?;
        let h = self.hidden_states(tape, ids, positions)?.into_tensor();
        let index = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect(), rows.len(), h.device())?;
        let picked = h.index_select(&index, 1)?;
        drop(h);
        self.head(tape, &tape.constant(picked))
    }

    /// The summed cross-entropy of the next-token predictions and the number of valid targets:
    /// `ids: [b, n]` u32, `positions: [n]`, `targets: [b * n]` i64 (already shifted; `-100` ignored) ->
    /// `(sum of token losses: []` in f32, f64 for an f64 model`, valid count)`. Divide by the (globally reduced)
    /// count for the mean.
    pub fn loss(
        &self,
        tape: &Tape,
        ids: &Tensor,
        positions: &[usize],
        targets: &Tensor,
    ) -> ModelResult<(Value, usize)> {
        let (b, n) = self.check_ids(tape, ids)?;
        if targets.rank() != 1 || targets.elem_count() != b * n {
            return Err(ModelError::TargetsMismatch { dims: targets.dims().to_vec(), expected: b * n });
        }
        let h = self.hidden_states(tape, ids, positions)?;
        let h = ops::reshape(tape, &h, (b * n, self.config.hidden_size))?;
        let head = match &self.lm_head {
            Some(l) => &l.weight,
            None => &self.embed_tokens.table,
        };
        let targets = tape.constant(targets.to_dtype(DType::I64)?);
        // The loss in row chunks: no [b * n, vocab] logits tensor is ever held (about 32 MiB of logits at a time).
        let chunk = ((8usize << 20) / self.config.vocab_size.max(1)).clamp(16, 4096);
        // A sharded head is taken in vocabulary tiles of at most one block's weights (none is ever whole).
        Ok(autosp_kernels::chunked_cross_entropy_param(tape, &h, head, &targets, chunk, self.block_elems())?)
    }

    /// The elements of the largest decoder block's weights: the most one gathered tile of a sharded head holds.
    fn block_elems(&self) -> usize {
        let elems = |l: &LlamaDecoderLayer| all_params(l).iter().map(|p| p.shape().elem_count()).sum::<usize>();
        self.layers.0.iter().map(elems).max().unwrap_or(0)
    }

    /// Logits of new tokens against a KV cache: `ids: [b, n]` u32 take positions `cache.len()..+n`;
    /// their keys and values are appended to `cache`. Returns `[b, n, vocab]`. After an error the cache may
    /// hold some layers' new rows and not others: [`clear`](KvCache::clear) it before reuse.
    pub fn forward_cached(&self, tape: &Tape, ids: &Tensor, cache: &mut KvCache) -> ModelResult<Value> {
        let (b, n) = self.check_ids(tape, ids)?;
        cache.check(b, self.layers.0.len())?;
        let start = cache.len();
        let positions: Vec<usize> = (start..start + n).collect();
        let spec = AttentionSpec::causal().shifted(start, 0);
        let h = self.run_layers(tape, ids, &positions, &spec, Some(cache))?;
        cache.advance(b, n);
        self.head(tape, &h)
    }

    /// An empty KV cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.0.len())
    }

    /// Limits every layer's attention to a sliding window: the token at position `p` sees only the tokens
    /// at positions `p - distance ..= p` (`Some(0)`: itself only; `None`: every earlier token, the default).
    /// Training ([`loss`](Self::loss)), [`logits`](Self::logits) and cached decoding
    /// ([`forward_cached`](Self::forward_cached)) all honour it; `autosp::compile` sets the same window from
    /// `CompileConfig::max_attention_distance` when one is given. A window the checkpoint sets on a layer
    /// (Mistral's or Qwen's `sliding_window`, [`LlamaAttention::window`](super::attention::LlamaAttention))
    /// stays: this one can narrow it, never widen it. (The KV cache still keeps every key.)
    pub fn set_max_attention_distance(&mut self, distance: Option<usize>) {
        autosp_core::module::set_max_attention_distance(self, distance);
    }
}

impl Module for LlamaModel {
    fn kind(&self) -> &'static str {
        "LlamaForCausalLM"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![
            ("embed_tokens".into(), &self.embed_tokens),
            ("layers".into(), &self.layers),
            ("norm".into(), &self.norm),
        ];
        if let Some(h) = &self.lm_head {
            c.push(("lm_head".into(), h));
        }
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> = vec![
            ("embed_tokens".into(), &mut self.embed_tokens),
            ("layers".into(), &mut self.layers),
            ("norm".into(), &mut self.norm),
        ];
        if let Some(h) = &mut self.lm_head {
            c.push(("lm_head".into(), h));
        }
        c
    }
}
