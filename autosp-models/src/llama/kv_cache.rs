//! [`KvCache`]: the keys and values of the tokens a model has already seen, per layer, so that decoding a
//! new token runs attention against them without recomputing the prefix.

use candle_core::Tensor;

use super::error::{ModelError, ModelResult};

/// One layer's cached keys and values, each `[batch, len, kv_heads, head_dim]` (after RoPE).
#[derive(Clone, Debug, Default)]
pub struct LayerKv {
    kv: Option<(Tensor, Tensor)>,
}

impl LayerKv {
    /// The cached `(k, v)`, each `[batch, len, kv_heads, head_dim]`, if any.
    pub fn get(&self) -> Option<(&Tensor, &Tensor)> {
        self.kv.as_ref().map(|(k, v)| (k, v))
    }

    /// Stores the layer's full keys and values (the cached prefix with the new rows appended).
    pub fn set(&mut self, k: Tensor, v: Tensor) {
        self.kv = Some((k, v));
    }
}

/// A KV cache for every layer of a model; the cached tokens sit at positions `0..len()`.
///
/// A cached forward ([`LlamaModel::forward_cached`](super::LlamaModel::forward_cached)) appends its new
/// tokens' keys and values (by `Tensor::cat` along the sequence) and then advances `len`.
#[derive(Clone, Debug)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
    batch: Option<usize>,
}

impl KvCache {
    /// An empty cache for a model of `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self { layers: vec![LayerKv::default(); num_layers], len: 0, batch: None }
    }

    /// Tokens cached (the position the next token takes).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Layers the cache has room for.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The batch size the cache was started with (`None` while empty).
    pub fn batch(&self) -> Option<usize> {
        self.batch
    }

    /// Layer `i`'s cache.
    pub fn layer(&self, i: usize) -> Option<&LayerKv> {
        self.layers.get(i)
    }

    /// Checks that a forward of `batch` rows over `num_layers` layers may use this cache.
    pub fn check(&self, batch: usize, num_layers: usize) -> ModelResult<()> {
        if self.layers.len() != num_layers {
            return Err(ModelError::Cache(format!(
                "the cache has {} layers and the model {num_layers}; make the cache with KvCache::new({num_layers})",
                self.layers.len()
            )));
        }
        if let Some(b) = self.batch {
            if b != batch {
                return Err(ModelError::Cache(format!(
                    "the cache holds a batch of {b} and the input has {batch} rows; use one cache per batch"
                )));
            }
        }
        Ok(())
    }

    /// Every layer's cache, mutable, for a cached forward.
    pub(crate) fn layers_mut(&mut self) -> &mut [LayerKv] {
        &mut self.layers
    }

    /// Records that a forward of `batch` rows appended `n` tokens to every layer.
    pub(crate) fn advance(&mut self, batch: usize, n: usize) {
        self.batch = Some(batch);
        self.len += n;
    }

    /// Drops everything cached.
    pub fn clear(&mut self) {
        for l in &mut self.layers {
            l.kv = None;
        }
        self.len = 0;
        self.batch = None;
    }
}
