//! Checkpoint policies and regions. A region (a transformer block) is a run of recorded nodes; when it
//! closes, the policy drops the values it does not keep, and backward regenerates a dropped value by
//! replaying the region's nodes from the values that were kept.

use crate::NodeKind;

/// What a closing region keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CheckpointPolicy {
    /// Keep everything backward reads: no recompute, most memory.
    #[default]
    None,
    /// Keep only each region's inputs: backward replays the region (attention and collectives too, once each).
    Full,
    /// Keep region inputs, attention outputs (and their LSE) and collective outputs; recompute linear, norm
    /// and elementwise work. Never replays an attention or a collective.
    SequenceAware,
}

impl CheckpointPolicy {
    /// Whether a closing region keeps the outputs of a node of `kind` that backward reads. Gathered
    /// parameters ([`NodeKind::Gather`]) are never kept: whole weights live only while their block runs.
    pub fn keeps(&self, kind: NodeKind) -> bool {
        if kind == NodeKind::Gather {
            return false;
        }
        match self {
            CheckpointPolicy::None => true,
            CheckpointPolicy::Full => false,
            CheckpointPolicy::SequenceAware => matches!(kind, NodeKind::Attention | NodeKind::Collective),
        }
    }

    /// Whether the policy allows replaying a node of `kind` in backward.
    pub fn may_replay(&self, kind: NodeKind) -> bool {
        !matches!(self, CheckpointPolicy::SequenceAware) || !matches!(kind, NodeKind::Attention | NodeKind::Collective)
    }
}

/// A checkpoint region as recorded: its name and its node range.
#[derive(Clone, Debug)]
pub(crate) struct Region {
    pub(crate) name: String,
    pub(crate) policy: CheckpointPolicy,
    pub(crate) start: usize,
    pub(crate) end: usize,
    pub(crate) closed: bool,
}
