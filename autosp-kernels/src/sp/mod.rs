//! Sequence parallelism for attention: the sequence is split over P ranks and attention is made whole again
//! by Ulysses all-to-all ([`UlyssesAttention`]), a ring of key/value blocks ([`RingAttention`]), or both
//! ([`HybridAttention`]). Each is an `autosp_core::Attention` whose collectives are tape ops with hand-written
//! backward; [`layout`] says which tokens each rank holds and moves tensors between whole and sharded.
//! Each file's doc comment gives the strategy's collective calls and bytes per rank per layer.

pub mod all_to_all;
pub mod error;
pub mod hybrid;
pub mod layout;
pub mod ring;
pub mod ulysses;
pub mod ulysses_op;
pub mod ulysses_plan;

pub use all_to_all::{all_to_all, even_ranges, exchange, exchange_back, AllToAllOp, AllToAllPlan};
pub use error::SpError;
pub use hybrid::HybridAttention;
pub use layout::{gather_unshard, shard, unshard, SeqLayout};
pub use ring::{RingAttention, RingAttentionOp, RingLayout};
pub use ulysses::UlyssesAttention;
pub use ulysses_op::UlyssesAttentionOp;
pub use ulysses_plan::{head_ranges, HeadChunks, UlyssesPlans};
