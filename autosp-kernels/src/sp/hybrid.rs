//! Hybrid (2D) sequence parallelism: P = u · r ranks, Ulysses inside each contiguous group of u ranks
//! (`contiguous_groups`), Ring across the r groups (`strided_groups`): [`HybridAttention`] is a
//! [`UlyssesAttention`] over the inner group whose inner attention is a [`RingAttention`] over the outer
//! group. For P beyond the head count: Ulysses needs only H divisible by u.
//!
//! Layout (see [`SeqLayout`]): rank `(g, i) = g·u + i`. Non-causal (`RingLayout::Contiguous`): rank g·u+i
//! holds chunk g·u+i of P (`SeqLayout::Contiguous`); the group gathers chunk g of r. Causal
//! (`RingLayout::Zigzag`): rank (g, i) holds sub-chunk i of chunks g and 2r-1-g of 2r
//! (`SeqLayout::HybridZigzag { u }`), and the two-halves all-to-all gathers the group's `[c_g ; c_{2r-1-g}]`,
//! the zigzag shard of ring rank g.
//!
//! Communication per layer (each on its own subgroup handle, n = N/P local tokens, `kvp_u = H_kv/u` or 1):
//! - inner group: Ulysses's 5 `all_to_all` forward and 5 backward, bytes as in `ulysses.rs` with P -> u;
//! - outer group: Ring's `r-1` `send_recv` forward and `2r-1` backward, bytes as in `ring.rs` with P -> r and
//!   `E = b · (u·n) · kvp_u · d`.
//!
//! Building it calls `split` twice on the world group (collective: every rank builds it at the same time).

use std::sync::Arc;

use autosp_core::comm::{contiguous_groups, strided_groups, ProcessGroup};
use autosp_core::ops::attention::AttentionSpec;
use autosp_core::{Attention, Tape, Value};

use super::error::SpError;
use super::layout::SeqLayout;
use super::ring::{RingAttention, RingLayout};
use super::ulysses::UlyssesAttention;

/// Ulysses within groups of u ranks, Ring across them, as an [`Attention`]: `q: [b, n, h, d]`,
/// `k, v: [b, n, h_kv, d]`, this rank's n = N/P tokens in [`HybridAttention::seq_layout`] ->
/// `(o: [b, n, h, d], lse: [b, h, n])`.
#[derive(Debug, Clone)]
pub struct HybridAttention {
    /// The whole strategy: Ulysses over `inner_group` around Ring over `outer_group`.
    pub ulysses: UlyssesAttention,
    /// This rank's Ulysses group (u ranks).
    pub inner_group: Arc<dyn ProcessGroup>,
    /// This rank's Ring group (r = P/u ranks, ring rank = group index g).
    pub outer_group: Arc<dyn ProcessGroup>,
    /// The ring's layout.
    pub layout: RingLayout,
}

impl HybridAttention {
    /// Splits `world` (P ranks) into Ulysses groups of `u` and Ring groups across them (two `split` calls on
    /// `world`). Errors unless `u` divides P.
    pub fn new(world: &dyn ProcessGroup, u: usize, layout: RingLayout) -> autosp_core::Result<Self> {
        let p = world.size();
        if u == 0 || !p.is_multiple_of(u) {
            return Err(SpError::Config {
                what: "HybridAttention",
                msg: format!("the Ulysses group size u = {u} must divide the {p} ranks"),
            }
            .into());
        }
        let inner_group = world.split(&contiguous_groups(p, u)?)?;
        let outer_group = world.split(&strided_groups(p, u)?)?;
        let ring = RingAttention::new(outer_group.clone(), layout);
        let ulysses = UlyssesAttention {
            group: inner_group.clone(),
            inner: Arc::new(ring),
            two_halves: layout == RingLayout::Zigzag,
            chunk_heads: false,
        };
        Ok(Self { ulysses, inner_group, outer_group, layout })
    }

    /// How the input sequence must be sharded over the world ranks for this strategy.
    pub fn seq_layout(&self) -> SeqLayout {
        match self.layout {
            RingLayout::Contiguous => SeqLayout::Contiguous,
            RingLayout::Zigzag => SeqLayout::HybridZigzag { u: self.inner_group.size() },
        }
    }
}

impl Attention for HybridAttention {
    fn describe(&self) -> String {
        format!("hybrid(u={}, r={}): {}", self.inner_group.size(), self.outer_group.size(), self.ulysses.describe())
    }

    fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        self.ulysses.forward(tape, q, k, v, spec)
    }
}
