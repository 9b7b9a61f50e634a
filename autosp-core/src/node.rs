//! Nodes of the tape: one recorded op application, its input and output values, its region, and the
//! [`NodeKind`] that checkpoint policies decide by.

use std::sync::Arc;

use crate::Op;

/// What kind of work a node does; checkpoint policies keep or recompute values by the kind of their producer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeKind {
    /// Matrix products: linear layers, matmul.
    Linear,
    /// Attention (naive, flash, Ulysses, Ring): O(N^2) work, never recomputed under `SequenceAware`.
    Attention,
    /// Communication between ranks: never replayed under `SequenceAware`.
    Collective,
    /// Normalisation (RMSNorm).
    Norm,
    /// Pointwise work: activations, arithmetic, rotary embedding.
    Elementwise,
    /// Reshapes, transposes, slices, concatenation.
    View,
    /// Embedding lookup.
    Embedding,
    /// Loss computation.
    Loss,
    /// A sharded parameter made whole for its use (gathered from every rank's slice, or the replicated
    /// weight whose gradient is reduce-scattered). Dropped when its region closes under every policy, and
    /// replayed where backward needs it: a block's weights are whole only while the block runs.
    Gather,
}

/// One recorded op application.
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) op: Arc<dyn Op>,
    pub(crate) inputs: Vec<usize>,
    pub(crate) outputs: Vec<usize>,
    pub(crate) region: Option<usize>,
}
