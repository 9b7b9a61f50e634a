//! The error type of the sequence-parallel strategies: layouts that do not divide, head counts Ulysses cannot
//! split, group shapes that do not fit. Each message names the values and says what to do. Converts into
//! `autosp_core::Error::External`, so it passes through the tape; tests find it with `downcast_ref::<SpError>()`.

/// Errors raised by the sequence-parallel attention strategies and their sharding helpers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpError {
    /// A length that must split into equal shards does not.
    #[error(
        "{what}: length {len} does not split into {parts} equal parts; pad the sequence to a multiple of {parts} \
         (the compile step pads to a multiple of P, or 2P for zigzag layouts) before sharding"
    )]
    UnevenShards { what: &'static str, len: usize, parts: usize },

    /// The ranks of an all-to-all hold pieces of different sizes.
    #[error(
        "{what}: rank {rank} sent a piece of shape {got:?} but rank 0 sent {want:?}; every rank must hold an \
         equal shard: pad the sequence to a multiple of P (2P for zigzag) before sharding"
    )]
    UnequalPieces { what: &'static str, rank: usize, got: Vec<usize>, want: Vec<usize> },

    /// Ulysses cannot split these heads over P ranks.
    #[error(
        "Ulysses over {p} ranks cannot split {heads} query heads and {kv_heads} kv heads: query heads must be a \
         multiple of {p}, and kv heads a multiple of {p} or a divisor of it; use Ring attention or hybrid \
         (Ulysses over a group whose size divides the heads, Ring across groups) instead"
    )]
    UlyssesHeads { p: usize, heads: usize, kv_heads: usize },

    /// An argument of a strategy or layout outside what it supports.
    #[error("{what}: {msg}")]
    Config { what: &'static str, msg: String },
}

impl From<SpError> for autosp_core::Error {
    fn from(e: SpError) -> Self {
        autosp_core::Error::External(Box::new(e))
    }
}
