//! [`GenerateStats`]: what a generation measured on one rank, for a benchmark to read: tokens per second of
//! the prefill and of the decode, and the memory and traffic of the sharded KV cache.

/// Figures of one [`Compiled::generate`](crate::Compiled::generate) call, on this rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerateStats {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub new_tokens: usize,
    /// Ranks of the sequence-parallel group that held the cache.
    pub ranks: usize,
    /// Seconds of the prefill, up to the first token's logits.
    pub prefill_seconds: f64,
    /// Seconds of the decode forwards (every new token after the first).
    pub decode_seconds: f64,
    /// `prompt_tokens / prefill_seconds`.
    pub prefill_tokens_per_s: f64,
    /// Decoded tokens (after the first) per second of decode.
    pub decode_tokens_per_s: f64,
    /// Query rows this rank computed in the prefill, read from the first layer's query tensor.
    pub query_rows: usize,
    /// Rows of the KV cache this rank holds, per layer, read from its tensors (prompt tokens of its shard,
    /// padding excluded, and the decoded tokens given to it).
    pub kv_rows: Vec<usize>,
    /// Bytes this rank allocated for its part of the KV cache (keys and values of every layer, whole blocks).
    pub kv_cache_bytes: usize,
    /// Bytes of weights gathered once for generation (a model sharded at `Parameters`; 0 otherwise).
    pub gathered_weight_bytes: usize,
    /// Bytes this rank receives per decoded token for decode attention: one all-gather per layer of every
    /// rank's partial `(o, lse)` and its failure flag, `layers · P · (heads · (head_dim + 1) + 1) · 4` (f32; 0 at
    /// P = 1).
    pub decode_comm_bytes_per_token: usize,
}

impl GenerateStats {
    /// The figures as a JSON object (the field names above), for a closing JSON line or a benchmark.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "ranks": self.ranks,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "query_rows": self.query_rows,
            "kv_rows": self.kv_rows,
            "kv_cache_bytes": self.kv_cache_bytes,
            "gathered_weight_bytes": self.gathered_weight_bytes,
            "decode_comm_bytes_per_token": self.decode_comm_bytes_per_token,
        })
    }
}

/// `count / seconds`, 0 when nothing was timed.
pub(crate) fn per_second(count: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}
