//! Generation over the ranks of a compiled model (`Compiled::generate`): a prompt longer than one rank
//! holds, prefilled and decoded in parallel, with no rank ever holding the whole KV cache.
//!
//! - **Prefill** runs the compiled model's own sequence-parallel forward over the prompt (its strategy:
//!   Ulysses, Ring or hybrid), each rank computing the query rows of its shard only (`n / P`, padding
//!   included) and keeping, in every layer, the keys and values of its shard's real rows (after RoPE, all
//!   key/value heads): the cache is split along the sequence whatever the strategy, so decode sees one layout.
//!   Only the last position's hidden row is broadcast, and only its logits (`[vocab]`) are computed; no rank
//!   makes `[n, vocab]`. Which strategy suits prefill: Ulysses when the heads divide over P (two all-to-alls
//!   of `n/P` rows per layer, attention a local flash kernel over the whole sequence for `h/P` heads, the
//!   least traffic per rank at any P up to the head count); Ring (zigzag, so each rank does equal causal work)
//!   past the head count or when its key/value blocks' transfer hides behind attention's O(n²) work, which it
//!   does at long prompts; hybrid for P beyond the heads. `Strategy::Auto` picks as for training.
//! - **Decode** (Meta's "pass-Q"): every rank runs the new token's layers (weights replicated, or gathered
//!   once for a model sharded at `Parameters`: see `weights.rs`), the token's keys and values go to the least
//!   filled rank's part (`cache.rs`), and its query meets every rank's part
//!   (`autosp_kernels::attention::decode_attention`): partial `(o, lse)` per rank, one all-gather per layer per
//!   token of `P · (heads · (head_dim + 1) + 1) · 4` bytes received (the last value a rank's failure flag),
//!   merged exactly by LSE in rank order, so every rank gets the same bits, samples the same token and needs
//!   no further exchange. Each rank's part is held in blocks (`autosp_kernels::attention::KvBlocks`): a token
//!   is written in place, never concatenated.
//! - **Positions**: prefill declares the prompt's length on the tape (a `dynamic`/`longrope` scaling reads
//!   it, as transformers' `max(position_ids) + 1`); each decode forward runs at its own position, so these
//!   scalings switch when the length crosses the window exactly as transformers' generation does (the cached
//!   keys keep the rotation they were made with).
//!
//! Sampling is autosp-models' ([`Sampling`]: greedy, temperature, top-k, top-p), seeded; the loop is
//! `generate.rs`, the figures `stats.rs`.

mod cache;
pub mod cli;
mod error;
mod generate;
mod slots;
mod stats;
mod weights;

pub use autosp_models::{GenerateConfig, Sampling};
pub use cache::ShardedKv;
pub use error::InferError;
pub use stats::GenerateStats;

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was generated (it is the last token).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
    /// The token callback asked to stop (Ctrl-C in the CLI).
    Interrupted,
}

/// One new token, as [`Compiled::generate_streaming`](crate::Compiled::generate_streaming) hands it to its
/// callback.
#[derive(Debug)]
pub struct TokenEvent<'a> {
    /// Its index among the new tokens (0 for the first).
    pub index: usize,
    /// The token.
    pub token: u32,
    /// The logits it was sampled from, `[vocab]` in f32 (the same on every rank).
    pub logits: &'a [f32],
}

/// What a generation returns.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The new tokens (the prompt not included), the stop token last when one ended it.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: Finish,
    /// Its figures on this rank.
    pub stats: GenerateStats,
}
