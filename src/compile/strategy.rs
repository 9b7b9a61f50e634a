//! Choosing and checking the sequence-parallel strategy: which strategies can split a model over P ranks,
//! what `Auto` picks and why, and the sequence layout each one needs.

use autosp_core::{CheckpointPolicy, LmDims};

use super::config::Strategy;
use super::CompileError;
use autosp_kernels::SeqLayout;

/// A concrete strategy with its layout and the reason it was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// Ulysses, Ring or Hybrid (never Auto).
    pub strategy: Strategy,
    /// Which positions each rank holds.
    pub layout: SeqLayout,
    /// Why (for `explain()`).
    pub reason: String,
}

/// Whether Ulysses can split `heads` query heads and `kv` kv heads over `p` ranks.
pub fn ulysses_fits(heads: usize, kv: usize, p: usize) -> bool {
    heads.is_multiple_of(p) && (kv.is_multiple_of(p) || p.is_multiple_of(kv))
}

/// Elements each rank sends per layer per forward pass, for `n` tokens in all (ALGORITHMS.md): the Ulysses
/// exchanges of q, k, v, o and the LSE, and the Ring passes of the k/v blocks.
pub fn comm_elems_per_layer(strategy: Strategy, d: &LmDims, n: usize, p: usize) -> f64 {
    let t = comm_parts_per_layer(strategy, d, n, p);
    t.a2a + t.lse + t.ring
}

/// Bytes each rank sends per layer per training step under `policy` (forward, backward and any replay), for
/// `n` tokens in all (the padded length the step runs), with `elem` bytes per activation element (the compute
/// dtype's: q/k/v/o and their gradients travel in it) and `acc_elem` bytes per element of the LSE and of
/// Ring's travelling dK/dV accumulators (f32 for f32/bf16/f16, f64 for f64). The model reads the attention's
/// output only (its LSE takes no gradient). What runs:
/// - forward: Ulysses's exchanges of q, k, v, o and LSE, and Ring's `r-1` k/v block passes (`r`: the ring's
///   ranks, P for Ring, P/u for Hybrid);
/// - `Full` replays the forward once more in backward (the attention and its collectives, once);
/// - backward, `None` (Ulysses recorded exchange by exchange): the inverse exchanges of q, k, v and o;
///   a recomputing policy (Ulysses as one fused op, `autosp-kernels/src/sp/ulysses_op.rs`): q, k, v, o and
///   LSE to the head layout again, dO there and dq, dk, dv back, twice the forward's q, k, v, o bytes and one
///   LSE exchange;
/// - Ring's backward, every policy: the `r-1` k/v block passes again and `r` passes of the dK/dV
///   accumulators (as many elements as the blocks, the last pass brings each back to its owner).
pub fn comm_bytes_per_layer_step(
    strategy: Strategy,
    d: &LmDims,
    n: usize,
    p: usize,
    policy: CheckpointPolicy,
    elem: usize,
    acc_elem: usize,
) -> f64 {
    let t = comm_parts_per_layer(strategy, d, n, p);
    let (elem, acc_elem) = (elem as f64, acc_elem as f64);
    let forward = t.a2a * elem + t.lse * acc_elem + t.ring * elem;
    let forwards = if policy == CheckpointPolicy::Full { 2.0 } else { 1.0 };
    let a2a_backward = match policy {
        CheckpointPolicy::None => t.a2a * elem,
        CheckpointPolicy::Full | CheckpointPolicy::SequenceAware => 2.0 * t.a2a * elem + t.lse * acc_elem,
    };
    let ring_backward = t.ring * elem + t.ring_acc * acc_elem;
    forwards * forward + a2a_backward + ring_backward
}

/// Elements each rank sends per layer per forward pass, by what travels.
struct Traffic {
    /// Ulysses's all-to-alls of q, k, v and o (compute dtype).
    a2a: f64,
    /// Ulysses's all-to-all of the LSE (f32, f64 for f64).
    lse: f64,
    /// Ring's k/v block passes (compute dtype).
    ring: f64,
    /// Ring's dK/dV accumulator passes in backward (f32, f64 for f64).
    ring_acc: f64,
}

/// What each rank sends per layer per forward pass, `n` tokens in all over `p` ranks (`n / p` each).
/// Ulysses over u ranks sends (u-1)/u of its local q, k, v, o and LSE (replicated kv heads: one head per
/// rank); Ring over r ranks passes its k/v block, `E = tokens · kv heads · head_dim` elements, r-1 times
/// forward and its accumulators r times backward. In Hybrid the ring runs after the Ulysses exchange: each
/// rank's block is the u·n/p tokens of its group with H_kv/u kv heads (`E = n/p · H_kv · d`, u times what a
/// rank holds of its own tokens per kv head).
fn comm_parts_per_layer(strategy: Strategy, d: &LmDims, n: usize, p: usize) -> Traffic {
    let dq = (d.heads * d.head_dim) as f64;
    let local = n as f64 / p as f64;
    // Ulysses over `u` ranks: (q+k+v+o elements, lse elements); and the kv elements per token sent to each.
    let ulysses = |u: usize| -> (f64, f64, f64) {
        let uf = u as f64;
        let kv_sent =
            if d.kv_heads.is_multiple_of(u) { (d.kv_heads * d.head_dim) as f64 } else { uf * d.head_dim as f64 };
        let share = local * (uf - 1.0) / uf;
        ((2.0 * dq + 2.0 * kv_sent) * share, d.heads as f64 * share, kv_sent)
    };
    // Ring over `r` ranks whose blocks hold `e` elements of k (and as many of v).
    let ring = |r: usize, e: f64| -> (f64, f64) {
        if r <= 1 {
            (0.0, 0.0)
        } else {
            (2.0 * e * (r as f64 - 1.0), 2.0 * e * r as f64)
        }
    };
    match strategy {
        Strategy::Ulysses => {
            let (a2a, lse, _) = ulysses(p);
            Traffic { a2a, lse, ring: 0.0, ring_acc: 0.0 }
        }
        Strategy::Ring => {
            let (ring, ring_acc) = ring(p, local * (d.kv_heads * d.head_dim) as f64);
            Traffic { a2a: 0.0, lse: 0.0, ring, ring_acc }
        }
        Strategy::Hybrid { ulysses: u } => {
            let (a2a, lse, kv_sent) = ulysses(u);
            // After the exchange a rank holds u·local tokens and kv_sent/u kv elements per token.
            let (ring, ring_acc) = ring(p / u, local * kv_sent);
            Traffic { a2a, lse, ring, ring_acc }
        }
        Strategy::Auto => Traffic { a2a: f64::NAN, lse: f64::NAN, ring: f64::NAN, ring_acc: f64::NAN },
    }
}

fn layout_for(strategy: Strategy, p: usize, causal: bool) -> SeqLayout {
    match strategy {
        _ if p == 1 => SeqLayout::Contiguous,
        Strategy::Ulysses | Strategy::Auto => SeqLayout::Contiguous,
        Strategy::Ring if causal => SeqLayout::Zigzag,
        Strategy::Hybrid { ulysses } if causal => SeqLayout::HybridZigzag { u: ulysses },
        Strategy::Ring | Strategy::Hybrid { .. } => SeqLayout::Contiguous,
    }
}

/// The largest Ulysses degree u > 1 with u | p, u < p, that Ulysses can split the heads over.
fn best_hybrid(d: &LmDims, p: usize) -> Option<usize> {
    (2..p).rev().find(|&u| p.is_multiple_of(u) && ulysses_fits(d.heads, d.kv_heads, u))
}

/// Checks `strategy` against the model and P, resolving `Auto`; errors say what would work.
pub fn resolve(strategy: Strategy, d: &LmDims, p: usize, causal: bool) -> Result<Resolved, CompileError> {
    let make = |s: Strategy, reason: String| Resolved { strategy: s, layout: layout_for(s, p, causal), reason };
    match strategy {
        Strategy::Ulysses => {
            if !ulysses_fits(d.heads, d.kv_heads, p) {
                return Err(CompileError::Infeasible {
                    what: format!(
                        "Ulysses cannot split {} query heads and {} kv heads over P = {p}: query heads must divide \
                         by P, and kv heads must divide by P or divide P",
                        d.heads, d.kv_heads
                    ),
                    suggestion: suggestion(d, p),
                });
            }
            Ok(make(strategy, "asked for".into()))
        }
        Strategy::Ring => Ok(make(strategy, "asked for".into())),
        Strategy::Hybrid { ulysses: u } => {
            if u < 1 || !p.is_multiple_of(u) || !ulysses_fits(d.heads, d.kv_heads, u) {
                return Err(CompileError::Infeasible {
                    what: format!(
                        "Hybrid with Ulysses degree {u} does not fit P = {p}, {} heads, {} kv heads: u must divide P, \
                         the heads and (or be divisible by) the kv heads",
                        d.heads, d.kv_heads
                    ),
                    suggestion: suggestion(d, p),
                });
            }
            Ok(make(strategy, "asked for".into()))
        }
        Strategy::Auto => {
            if p == 1 {
                return Ok(make(Strategy::Ulysses, "P = 1: one rank, no communication".into()));
            }
            if ulysses_fits(d.heads, d.kv_heads, p) {
                let (u, r) = (
                    comm_elems_per_layer(Strategy::Ulysses, d, 1 << 20, p),
                    comm_elems_per_layer(Strategy::Ring, d, 1 << 20, p),
                );
                return Ok(if u <= r {
                    make(
                        Strategy::Ulysses,
                        format!(
                            "heads ({}) and kv heads ({}) split over P = {p}, and Ulysses sends {:.2}x the bytes of Ring \
                             per layer",
                            d.heads,
                            d.kv_heads,
                            u / r
                        ),
                    )
                } else {
                    make(Strategy::Ring, format!("Ring sends {:.2}x the bytes of Ulysses per layer at P = {p}", r / u))
                });
            }
            if let Some(u) = best_hybrid(d, p) {
                return Ok(make(
                    Strategy::Hybrid { ulysses: u },
                    format!(
                        "{} heads / {} kv heads do not split over P = {p}; Ulysses over groups of {u}, Ring across {} groups",
                        d.heads,
                        d.kv_heads,
                        p / u
                    ),
                ));
            }
            Ok(make(
                Strategy::Ring,
                format!("{} heads / {} kv heads do not split over any factor of P = {p}", d.heads, d.kv_heads),
            ))
        }
    }
}

fn suggestion(d: &LmDims, p: usize) -> String {
    match best_hybrid(d, p) {
        Some(u) => format!("use Strategy::Ring, or Strategy::Hybrid {{ ulysses: {u} }}"),
        None => "use Strategy::Ring (any head count)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(heads: usize, kv: usize) -> LmDims {
        LmDims { layers: 2, hidden: 64, intermediate: 128, heads, kv_heads: kv, head_dim: 16, vocab: 100 }
    }

    #[test]
    fn auto_and_errors() {
        assert_eq!(resolve(Strategy::Auto, &dims(8, 4), 1, true).unwrap().layout, SeqLayout::Contiguous);
        assert_eq!(resolve(Strategy::Auto, &dims(8, 4), 4, true).unwrap().strategy, Strategy::Ulysses);
        // 6 heads over 4: Ulysses no; u = 2 fits.
        assert_eq!(resolve(Strategy::Auto, &dims(6, 2), 4, true).unwrap().strategy, Strategy::Hybrid { ulysses: 2 });
        assert_eq!(resolve(Strategy::Auto, &dims(5, 5), 4, true).unwrap().strategy, Strategy::Ring);
        let e = resolve(Strategy::Ulysses, &dims(6, 2), 4, true).unwrap_err().to_string();
        assert!(e.contains("P = 4") && e.contains("Hybrid"), "{e}");
        assert_eq!(resolve(Strategy::Ring, &dims(6, 2), 4, true).unwrap().layout, SeqLayout::Zigzag);
        // kv heads fewer than P but dividing it: replicated.
        assert!(resolve(Strategy::Ulysses, &dims(8, 2), 4, true).is_ok());
    }
}
