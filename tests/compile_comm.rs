//! The collectives a compiled training step runs, counted on the attention's groups: under `Full` each
//! attention and its communication run once in forward and exactly once more in backward (one replay), and
//! the plan's communication bytes equal what the counters show after a step under every policy (Ulysses and
//! Ring at P = 2, Hybrid at P = 4 with u = 2; thread ranks).

mod common;

use std::sync::Arc;

use autosp::compile::{compile, Checkpointing, CompileConfig, Plan, Strategy};
use autosp_core::comm::{run_ranks, Collective, ProcessGroup};
use autosp_core::CheckpointPolicy;
use autosp_models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device};

const POLICIES: [CheckpointPolicy; 3] =
    [CheckpointPolicy::None, CheckpointPolicy::SequenceAware, CheckpointPolicy::Full];

fn tiny() -> LlamaModel {
    // 2 layers, 4 heads, 2 kv heads, head_dim 8, vocab 128.
    let spec = TinySpec { hidden: 32, intermediate: 64, ..TinySpec::default() };
    let cfg = spec.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, 7, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

/// What one rank's training step sent.
#[derive(Debug)]
struct Measured {
    /// `all_to_all` and `send_recv` calls on the attention's groups.
    all_to_all: u64,
    send_recv: u64,
    /// Bytes of those calls.
    attention_bytes: u64,
    /// Bytes of every call on every group this rank uses.
    total_bytes: u64,
    /// The plan at the step's length, made before the step.
    plan: Plan,
}

/// The plan at `n` tokens, then one training step of `n` tokens, on each of `p` thread ranks.
fn step(p: usize, strategy: Strategy, policy: CheckpointPolicy, n: usize) -> Vec<Measured> {
    let out = run_ranks(p, std::time::Duration::from_secs(60), move |pg| {
        let cfg = CompileConfig::new(pg.clone(), strategy, Checkpointing::Policy(policy));
        let mut c = compile(tiny(), cfg).map_err(|e| e.to_string())?;
        let plan = c.plan(n).map_err(|e| e.to_string())?;
        // Every group once (Ulysses and Ring communicate over the world group itself).
        let mut groups: Vec<Arc<dyn ProcessGroup>> = vec![pg.clone()];
        for g in c.attention_groups() {
            if !groups.iter().any(|x| Arc::ptr_eq(x, g)) {
                groups.push(g.clone());
            }
        }
        groups.iter().for_each(|g| g.reset_stats());
        let (ids, labels) = common::batch(n, 128);
        c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
        let attn: Vec<_> = c.attention_groups().iter().map(|g| g.stats()).collect();
        let calls = |k: Collective| attn.iter().map(|s| s.calls(k)).sum::<u64>();
        let bytes = |k: Collective| attn.iter().map(|s| s.bytes_sent(k)).sum::<u64>();
        Ok::<_, String>(Measured {
            all_to_all: calls(Collective::AllToAll),
            send_recv: calls(Collective::SendRecv),
            attention_bytes: bytes(Collective::AllToAll) + bytes(Collective::SendRecv),
            total_bytes: groups.iter().map(|g| g.stats().total_bytes_sent()).sum(),
            plan,
        })
    });
    out.into_iter().map(|r| r.unwrap().unwrap()).collect()
}

/// The plan's bytes against the counters, on every rank: exact (the plan sums integers in f64; 1e-9 of
/// relative slack covers its rounding).
fn assert_plan_matches(what: &str, ranks: &[Measured]) {
    for (r, m) in ranks.iter().enumerate() {
        let close = |a: f64, b: u64| (a - b as f64).abs() <= 1e-9 * b as f64;
        assert!(m.attention_bytes > 0, "{what} rank {r}: no attention traffic");
        assert!(
            close(m.plan.attention_comm_bytes, m.attention_bytes),
            "{what} rank {r}: plan predicts {} attention bytes, the step sent {}",
            m.plan.attention_comm_bytes,
            m.attention_bytes
        );
        assert!(
            close(m.plan.comm_bytes, m.total_bytes),
            "{what} rank {r}: plan predicts {} bytes in all, the step sent {}",
            m.plan.comm_bytes,
            m.total_bytes
        );
    }
}

#[test]
fn under_full_each_attention_communicates_in_forward_and_one_replay() {
    // 62 tokens: Ulysses runs 62 (31 per rank), Ring's zigzag pads to 64. Two layers.
    let (n, layers) = (62, 2);
    // Ulysses at P = 2 per layer: 5 all-to-alls forward (q, k, v, o, lse). Backward recorded exchange by
    // exchange (None): the inverses of q, k, v, o (lse takes no gradient) = 4. Backward of the fused op
    // (recomputing policies): 2 query heads and 1 kv head per rank, so 2 head chunks sharing the kv head:
    // k and v out once, per chunk q, o, lse, dO out and dq back (5), dk and dv back once = 14.
    let ulysses: Vec<Vec<Measured>> = POLICIES.iter().map(|&pol| step(2, Strategy::Ulysses, pol, n)).collect();
    // Ring at P = 2 per layer: 1 k/v pass forward; backward 1 k/v pass and 2 accumulator passes = 3.
    let ring: Vec<Vec<Measured>> = POLICIES.iter().map(|&pol| step(2, Strategy::Ring, pol, n)).collect();
    for r in 0..2 {
        let a2a: Vec<u64> = ulysses.iter().map(|m| m[r].all_to_all).collect();
        assert_eq!(a2a, vec![layers * (5 + 4), layers * (5 + 14), layers * (5 + 5 + 14)], "Ulysses rank {r}");
        let sr: Vec<u64> = ring.iter().map(|m| m[r].send_recv).collect();
        assert_eq!(sr, vec![layers * (1 + 3), layers * (1 + 3), layers * (1 + 1 + 3)], "Ring rank {r}");
        // Full = SequenceAware (the same backward) + one forward per layer.
        assert_eq!(a2a[2] - a2a[1], layers * 5, "Ulysses rank {r}: Full replays each attention once");
        assert_eq!(sr[2] - sr[1], layers, "Ring rank {r}: Full replays each attention once");
        assert_eq!(ulysses.iter().map(|m| m[r].send_recv).sum::<u64>(), 0);
        assert_eq!(ring.iter().map(|m| m[r].all_to_all).sum::<u64>(), 0);
    }
    for (i, pol) in POLICIES.iter().enumerate() {
        assert_plan_matches(&format!("Ulysses P=2 {pol:?}"), &ulysses[i]);
        assert_plan_matches(&format!("Ring P=2 {pol:?}"), &ring[i]);
    }
}

#[test]
fn the_plan_counts_hybrid_traffic_as_measured_under_every_policy() {
    // P = 4, u = 2: Ulysses over pairs of ranks around Ring over 2 groups. The ring passes blocks of the
    // group's u·n/P tokens (after the exchange), not a rank's n/P: the plan once counted them u times too few.
    let n = 62; // padded to 64 (the hybrid zigzag needs a multiple of 2P = 8)
    let s = Strategy::Hybrid { ulysses: 2 };
    let mut all = Vec::new();
    for pol in POLICIES {
        let ranks = step(4, s, pol, n);
        assert_plan_matches(&format!("Hybrid P=4 u=2 {pol:?}"), &ranks);
        for m in &ranks {
            assert!(m.all_to_all > 0 && m.send_recv > 0);
        }
        all.push(ranks);
    }
    // Ring per layer: 1 pass forward, 1 + 2 backward; Full adds one forward. Two layers.
    let sr: Vec<u64> = all.iter().map(|m| m[0].send_recv).collect();
    assert_eq!(sr, vec![8, 8, 10]);
}
