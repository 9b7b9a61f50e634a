//! Choosing and checking the sequence-parallel strategy: which strategies can split a model over P ranks,
//! what `Auto` picks and why, and the sequence layout each one needs.

use autosp_core::LmDims;

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

/// Elements each rank sends per layer per forward pass, for `n` tokens in all (ALGORITHMS.md).
pub fn comm_elems_per_layer(strategy: Strategy, d: &LmDims, n: usize, p: usize) -> f64 {
    let (a2a, ring) = comm_parts_per_layer(strategy, d, n, p);
    a2a + ring
}

/// Bytes each rank sends per layer per training step (forward and backward), with `elem` bytes per
/// activation element (the compute dtype's: q/k/v/o and their gradients travel in it) and `acc_elem` bytes
/// per element of Ring's travelling dK/dV accumulators (f32 for f32/bf16/f16, f64 for f64). Ulysses's
/// backward sends what its forward sent when it is recorded exchange by exchange (policy None), and twice
/// that as one fused op that redoes its exchanges (a recomputing policy; `autosp-kernels/src/sp/ulysses_op.rs`);
/// Ring's backward sends the k/v blocks again and the dK/dV accumulators (as many elements as the blocks).
pub fn comm_bytes_per_layer_step(
    strategy: Strategy,
    d: &LmDims,
    n: usize,
    p: usize,
    recomputes: bool,
    elem: usize,
    acc_elem: usize,
) -> f64 {
    let (a2a, ring) = comm_parts_per_layer(strategy, d, n, p);
    a2a * if recomputes { 3.0 } else { 2.0 } * elem as f64 + ring * (2 * elem + acc_elem) as f64
}

/// `(all-to-all, ring)` elements each rank sends per layer per forward pass.
fn comm_parts_per_layer(strategy: Strategy, d: &LmDims, n: usize, p: usize) -> (f64, f64) {
    let (dq, dkv) = ((d.heads * d.head_dim) as f64, (d.kv_heads * d.head_dim) as f64);
    let n = n as f64;
    let pf = p as f64;
    match strategy {
        Strategy::Ulysses => {
            // q, k, v there and o back; replicated kv heads send one head per rank.
            let kv_sent = if d.kv_heads.is_multiple_of(p) { dkv } else { pf * d.head_dim as f64 };
            ((2.0 * dq + 2.0 * kv_sent) * (n / pf) * (pf - 1.0) / pf, 0.0)
        }
        Strategy::Ring => (0.0, 2.0 * n * dkv * (pf - 1.0) / pf),
        Strategy::Hybrid { ulysses: u } => {
            let r = p / u;
            let uf = u as f64;
            let kv_sent = if d.kv_heads.is_multiple_of(u) { dkv } else { uf * d.head_dim as f64 };
            let inner = (2.0 * dq + 2.0 * kv_sent) * (n / pf) * (uf - 1.0) / uf;
            let outer = 2.0 * (n / uf) * (kv_sent / uf) * (r as f64 - 1.0) / r as f64;
            (inner, outer)
        }
        Strategy::Auto => (f64::NAN, f64::NAN),
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
