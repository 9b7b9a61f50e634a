//! The attention a generation puts into a model's slots (on its own copy of the model; the compiled model
//! keeps its own): [`PrefillAttention`] runs the compiled sequence-parallel attention and keeps the keys and
//! values of this rank's shard in the cache; [`DecodeAttention`] stores the new token's keys and values on
//! the rank whose turn it is and attends the query to every rank's part, merged by LSE
//! ([`decode_attention`]), within the layer's sliding window when it has one (the spec's `max_distance`: the
//! layer's own and the slot's, as the training forward masks).

use std::sync::{Arc, Mutex};

use autosp_core::comm::ProcessGroup;
use autosp_core::ops::AttentionSpec;
use autosp_core::{Attention, Tape, Value};
use autosp_kernels::attention::decode_attention;
use candle_core::Tensor;

use super::cache::ShardedKv;

/// A cache shared by the slots of every layer of one generation.
pub(crate) type SharedKv = Arc<Mutex<ShardedKv>>;

pub(crate) fn lock(cache: &SharedKv) -> std::sync::MutexGuard<'_, ShardedKv> {
    // A slot that panicked mid-step leaves the cache as it was; the generation fails with that panic anyway.
    cache.lock().unwrap_or_else(|e| e.into_inner())
}

/// Layer `layer`'s prefill attention: the compiled attention `inner`, which first hands the keys and values
/// of this rank's real rows (the first `positions.len()` of the shard, at those positions: padding past the
/// prompt is left out) to the cache.
#[derive(Debug)]
pub(crate) struct PrefillAttention {
    pub inner: Arc<dyn Attention>,
    pub layer: usize,
    pub positions: Arc<[usize]>,
    pub cache: SharedKv,
}

impl PrefillAttention {
    /// Stores `k, v: [1, rows, kv_heads, head_dim]` (their first `positions.len()` rows) and the query rows
    /// of `q`.
    fn record(&self, q: &Value, k: &Value, v: &Value) -> autosp_core::Result<()> {
        let mut c = lock(&self.cache);
        c.query_rows[self.layer] = q.tensor().dim(1)?;
        let keep = self.positions.len();
        let (k, v) = (k.tensor().narrow(1, 0, keep)?, v.tensor().narrow(1, 0, keep)?);
        c.layers[self.layer].push_rows(&k, &v, &self.positions)?;
        Ok(())
    }
}

impl Attention for PrefillAttention {
    fn describe(&self) -> String {
        format!("prefill({}) > kv cache", self.inner.describe())
    }

    fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        self.record(q, k, v)?;
        self.inner.forward(tape, q, k, v, spec)
    }

    fn forward_output(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<Value> {
        self.record(q, k, v)?;
        self.inner.forward_output(tape, q, k, v, spec)
    }
}

/// Layer `layer`'s decode attention over the cache the ranks of `group` hold (see the module doc):
/// `q: [1, 1, heads, head_dim]`, `k, v: [1, 1, kv_heads, head_dim]`, the same on every rank, at the position
/// [`ShardedKv::begin_token`] set; a spec with `max_distance: Some(w)` sees the keys at positions
/// `position - w` to `position` (transformers' sliding mask, `sliding_window = w + 1`).
#[derive(Debug)]
pub(crate) struct DecodeAttention {
    pub layer: usize,
    pub cache: SharedKv,
    pub group: Arc<dyn ProcessGroup>,
}

impl Attention for DecodeAttention {
    fn describe(&self) -> String {
        format!("decode over {} ranks' kv cache", self.group.size())
    }

    fn forward(
        &self,
        _: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        let _span = autosp_core::profile::span("forward", "decode attention", String::new);
        let mut c = lock(&self.cache);
        let position = c.position();
        // A row this rank cannot store is its error in the collective, which the peers then fail on at once.
        let pushed =
            if c.owns_token() { c.layers[self.layer].push_token(k.tensor(), v.tensor(), position) } else { Ok(()) };
        let holds = c.holds();
        let first = spec.max_distance.map_or(0, |w| position.saturating_sub(w));
        let part = pushed.map(|()| &c.layers[self.layer]);
        let (o, lse): (Tensor, Tensor) =
            decode_attention(self.group.as_ref(), q.tensor(), part, spec.scale, &holds, first)?;
        Ok((Value::constant(o), Value::constant(lse)))
    }
}
