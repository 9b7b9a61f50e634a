//! Every attention kernel against the one definition of which keys a query sees (`AttentionSpec::key_range`),
//! on random specs: causal or not, sliding windows from 0 to past every key, position offsets that differ
//! between queries and keys (so some rows see no key at all), packed documents (half the specs: documents of
//! 1 to 5 tokens, ending before or after the last position, so that padding past them is a document of its
//! own; Ring's shards then hold pairs wholly in different documents, which it skips), GQA and MQA, batch 2; the single-rank kernels
//! (the CPU flash kernel, the device-generic kernel on small blocks, the naive reference) and the
//! sequence-parallel ones at P = 1..4 thread ranks (Ring contiguous and zigzag, Ulysses, hybrid).
//!
//! Two checks per kernel and spec, in f64:
//! - The mask itself, exactly: with q = 0 every score is 0, so a row's softmax is uniform over the keys it
//!   sees. With `v[j]` the one-hot vector of key j (times kv head + 1) and `dO[i]` the one-hot vector of row
//!   i, `o[i, h, j] = (kv head + 1) / count_i` where row i sees key j and 0 elsewhere, `lse[i] = ln count_i`
//!   (-inf with `o = 0` for a row that sees nothing), and `dV[j, kv, i] = group / count_i` where row i sees
//!   key j: the forward's and the backward's masks, read entry by entry. Tolerance 1e-12 (sums of a few
//!   exact terms in f64).
//! - The gradients through the mask: on random q, k, v, dO, dLSE every kernel's o, lse, dq, dk, dv against
//!   the naive attention (which masks with `AttentionSpec::visible`), max |a - b| / max |b| <= 1e-10 (the same
//!   sums in another order, f64).
//!
//! The candle-flash-attn plan (feature `flash-attn`) is held to the same definition by its own unit test,
//! exhaustively over small shapes, every window and offsets (`attention/flash_attn_plan.rs`).

use std::sync::Arc;
use std::time::Duration;

use autosp_core::comm::{run_ranks, ProcessGroup};
use autosp_core::ops::attention::Documents;
use autosp_core::ops::attention::{naive_attention_backward, naive_attention_forward, AttentionSpec};
use autosp_core::ops::{self};
use autosp_core::{Attention, CheckpointPolicy, Tape};
use autosp_kernels::attention::{generic_backward_with_block, generic_forward_with_block, poisoned};
use autosp_kernels::sp::{shard, unshard, SeqLayout};
use autosp_kernels::{
    attention_backward, attention_forward, HybridAttention, LocalAttention, RingAttention, RingLayout, UlyssesAttention,
};
use candle_core::{DType, Device, Tensor};

const TIMEOUT: Duration = Duration::from_secs(30);
const BATCH: usize = 2;

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn values(&mut self, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }
}

/// Random documents of 1 to 5 tokens over `m` positions, the first going on from a random position.
fn random_documents(rng: &mut Rng, m: usize) -> Arc<Documents> {
    let mut lengths = Vec::new();
    let mut left = m.max(1);
    while left > 0 {
        let l = (1 + rng.below(5)).min(left);
        lengths.push(l);
        left -= l;
    }
    Arc::new(Documents::from_lengths(&lengths, rng.below(3)).unwrap())
}

/// A random spec for sequences around `n` long: causal or not, no window or one from 0 to past `n`, offsets
/// that may differ, and half the time packed documents over 1 to 2n positions (past them: padding).
fn random_spec(rng: &mut Rng, n: usize) -> AttentionSpec {
    let window = match rng.below(3) {
        0 => None,
        _ => Some(rng.below(n + 2)),
    };
    let (q_offset, k_offset) = match rng.below(3) {
        0 => (0, 0),
        1 => (rng.below(n), 0),
        _ => (0, rng.below(n)),
    };
    let documents = match rng.below(2) {
        0 => None,
        _ => {
            let m = 1 + rng.below(2 * n);
            Some(random_documents(rng, m))
        }
    };
    AttentionSpec { causal: rng.below(2) == 0, scale: None, q_offset, k_offset, max_distance: window, documents }
}

/// The probe inputs of the exact mask check: `q = 0`, `v[b, j, kv, c] = (kv + 1)·[c = j]`,
/// `dO[b, i, h, c] = [c = i]`; k random (it meets only zeros).
struct Probe {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
}

fn probe(rng: &mut Rng, nq: usize, nk: usize, h: usize, hkv: usize, d: usize) -> Probe {
    let one_hot = |n: usize, heads: usize, scale: &dyn Fn(usize) -> f64| {
        let mut x = vec![0f64; BATCH * n * heads * d];
        for b in 0..BATCH {
            for i in 0..n {
                for hh in 0..heads {
                    x[((b * n + i) * heads + hh) * d + i] = scale(hh);
                }
            }
        }
        Tensor::from_vec(x, (BATCH, n, heads, d), &Device::Cpu).unwrap()
    };
    Probe {
        q: Tensor::zeros((BATCH, nq, h, d), DType::F64, &Device::Cpu).unwrap(),
        k: rng.values(&[BATCH, nk, hkv, d]),
        v: one_hot(nk, hkv, &|kv| (kv + 1) as f64),
        d_o: one_hot(nq, h, &|_| 1.0),
    }
}

/// Checks `o, lse, dv` of the probe against the spec's intervals, entry by entry.
fn check_probe(what: &str, spec: &AttentionSpec, h: usize, hkv: usize, o: &Tensor, lse: &Tensor, dv: &Tensor) {
    let (_, nq, _, d) = o.dims4().unwrap();
    let nk = dv.dim(1).unwrap();
    let group = h / hkv;
    let o = o.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let lse = lse.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let dv = dv.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let count = |i: usize| spec.key_range(i, nk).len();
    for b in 0..BATCH {
        for i in 0..nq {
            let seen = spec.key_range(i, nk);
            for hh in 0..h {
                let l = lse[(b * h + hh) * nq + i];
                if seen.is_empty() {
                    assert_eq!(l, f64::NEG_INFINITY, "{what} {spec:?}: row {i} sees no key, lse {l}");
                } else {
                    let want = (count(i) as f64).ln();
                    assert!((l - want).abs() <= 1e-12, "{what} {spec:?}: row {i} head {hh}: lse {l}, want {want}");
                }
                for c in 0..d {
                    let got = o[((b * nq + i) * h + hh) * d + c];
                    let want = if seen.contains(&c) { (hh / group + 1) as f64 / count(i) as f64 } else { 0.0 };
                    assert!(
                        (got - want).abs() <= 1e-12,
                        "{what} {spec:?}: o[row {i}, head {hh}, key {c}] = {got}, want {want} (keys seen {seen:?})"
                    );
                }
            }
        }
        for j in 0..nk {
            for kv in 0..hkv {
                for c in 0..d {
                    let got = dv[((b * nk + j) * hkv + kv) * d + c];
                    let want = if c < nq && spec.visible(c, j) { group as f64 / count(c) as f64 } else { 0.0 };
                    assert!(
                        (got - want).abs() <= 1e-12,
                        "{what} {spec:?}: dv[key {j}, kv head {kv}, row {c}] = {got}, want {want}"
                    );
                }
            }
        }
    }
}

/// Max |a - b| / max |b| with -inf entries (rows that see no key) required to match exactly.
fn rel_err(what: &str, a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let scale = b.iter().filter(|x| x.is_finite()).fold(0f64, |m, x| m.max(x.abs())).max(f64::MIN_POSITIVE);
    let mut worst = 0f64;
    for (x, y) in a.iter().zip(&b) {
        if y.is_finite() {
            worst = worst.max((x - y).abs() / scale);
        } else {
            assert_eq!(x, y, "{what}: a row that sees no key");
        }
    }
    worst
}

/// The five results of one kernel: `(o, lse, dq, dk, dv)`.
type Results = [Tensor; 5];

/// Checks a kernel's results on random inputs against the naive attention's.
fn check_random(what: &str, spec: &AttentionSpec, got: &Results, want: &Results) {
    for (name, (a, b)) in ["o", "lse", "dq", "dk", "dv"].iter().zip(got.iter().zip(want)) {
        let e = rel_err(&format!("{what} {name}"), a, b);
        assert!(e <= 1e-10, "{what} {spec:?}: {name} max relative error {e:e}");
    }
}

/// The random inputs of the gradient check, and the naive attention's results on them.
struct Random {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    d_o: Tensor,
    d_lse: Tensor,
}

fn random_inputs(rng: &mut Rng, nq: usize, nk: usize, h: usize, hkv: usize, d: usize) -> Random {
    Random {
        q: rng.values(&[BATCH, nq, h, d]),
        k: rng.values(&[BATCH, nk, hkv, d]),
        v: rng.values(&[BATCH, nk, hkv, d]),
        d_o: rng.values(&[BATCH, nq, h, d]),
        d_lse: rng.values(&[BATCH, h, nq]),
    }
}

fn naive(x: &Random, spec: &AttentionSpec) -> Results {
    let (o, lse) = naive_attention_forward(&x.q, &x.k, &x.v, spec).unwrap();
    let (dq, dk, dv) =
        naive_attention_backward(&x.q, &x.k, &x.v, &o, &lse, Some(&x.d_o), Some(&x.d_lse), spec).unwrap();
    [o, lse, dq, dk, dv]
}

/// A single-rank kernel: forward and backward of `(q, k, v)` with `dO`, `dLSE`.
type Kernel = fn(&Tensor, &Tensor, &Tensor, &Tensor, Option<&Tensor>, &AttentionSpec) -> Results;

fn cpu(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, d_lse: Option<&Tensor>, s: &AttentionSpec) -> Results {
    let (o, lse) = attention_forward(q, k, v, s).unwrap();
    let (dq, dk, dv) = attention_backward(q, k, v, &o, &lse, d_o, d_lse, s).unwrap();
    [o, lse, dq, dk, dv]
}

fn cpu_poisoned(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    s: &AttentionSpec,
) -> Results {
    let (o, lse) = poisoned::cpu_forward(q, k, v, s).unwrap();
    let (dq, dk, dv) = poisoned::cpu_backward(q, k, v, &o, &lse, d_o, d_lse, s).unwrap();
    [o, lse, dq, dk, dv]
}

/// The generic kernel on blocks of 4 rows (chunks of 16 keys): many masked, unmasked and skipped chunks.
fn generic(q: &Tensor, k: &Tensor, v: &Tensor, d_o: &Tensor, d_lse: Option<&Tensor>, s: &AttentionSpec) -> Results {
    let (o, lse) = generic_forward_with_block(q, k, v, s, 4).unwrap();
    let (dq, dk, dv) = generic_backward_with_block(q, k, v, &o, &lse, d_o, d_lse, s, 4).unwrap();
    [o, lse, dq, dk, dv]
}

fn naive_kernel(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    d_o: &Tensor,
    d_lse: Option<&Tensor>,
    s: &AttentionSpec,
) -> Results {
    let (o, lse) = naive_attention_forward(q, k, v, s).unwrap();
    let (dq, dk, dv) = naive_attention_backward(q, k, v, &o, &lse, Some(d_o), d_lse, s).unwrap();
    [o, lse, dq, dk, dv]
}

/// Head counts `(heads, kv heads)`: MHA, GQA and MQA.
const HEADS: [(usize, usize); 4] = [(2, 2), (4, 2), (4, 1), (3, 1)];

#[test]
fn single_rank_kernels_see_exactly_the_keys_the_spec_gives() {
    let mut rng = Rng(11);
    let kernels: [(&str, Kernel); 4] =
        [("cpu", cpu), ("cpu (poisoned)", cpu_poisoned), ("generic", generic), ("naive", naive_kernel)];
    let (mut empty_rows, mut packed) = (0, 0);
    for _ in 0..40 {
        let (nq, nk) = (1 + rng.below(20), 1 + rng.below(20));
        let spec = random_spec(&mut rng, nq.max(nk));
        let (h, hkv) = HEADS[rng.below(HEADS.len())];
        let d = nq.max(nk);
        empty_rows += (0..nq).filter(|&i| spec.key_range(i, nk).is_empty()).count();
        packed += usize::from(spec.documents.as_ref().is_some_and(|d| d.count() > 1));
        let p = probe(&mut rng, nq, nk, h, hkv, d);
        let x = random_inputs(&mut rng, nq, nk, h, hkv, d);
        let want = naive(&x, &spec);
        for (name, kernel) in kernels {
            let [o, lse, _, _, dv] = kernel(&p.q, &p.k, &p.v, &p.d_o, None, &spec);
            check_probe(name, &spec, h, hkv, &o, &lse, &dv);
            let got = kernel(&x.q, &x.k, &x.v, &x.d_o, Some(&x.d_lse), &spec);
            check_random(name, &spec, &got, &want);
        }
    }
    assert!(empty_rows > 0, "the specs must include rows that see no key");
    assert!(packed > 5, "the specs must include packed documents: {packed} of 40");
}

/// A sequence-parallel strategy at P ranks.
#[derive(Clone, Copy, Debug)]
enum Strategy {
    Ring(RingLayout),
    Ulysses,
    Hybrid { u: usize, layout: RingLayout },
}

impl Strategy {
    fn layout(self) -> SeqLayout {
        match self {
            Strategy::Ulysses
            | Strategy::Ring(RingLayout::Contiguous)
            | Strategy::Hybrid { layout: RingLayout::Contiguous, .. } => SeqLayout::Contiguous,
            Strategy::Ring(RingLayout::Zigzag) => SeqLayout::Zigzag,
            Strategy::Hybrid { u, layout: RingLayout::Zigzag } => SeqLayout::HybridZigzag { u },
        }
    }

    fn build(self, world: &Arc<dyn ProcessGroup>) -> Arc<dyn Attention> {
        match self {
            Strategy::Ring(layout) => Arc::new(RingAttention::new(world.clone(), layout)),
            Strategy::Ulysses => Arc::new(UlyssesAttention::new(world.clone(), Arc::new(LocalAttention))),
            Strategy::Hybrid { u, layout } => Arc::new(HybridAttention::new(world.as_ref(), u, layout).unwrap()),
        }
    }
}

/// Runs `strategy` on P thread ranks over the whole-sequence inputs (each rank takes its shard), backward from
/// `Σ o·dO + Σ lse·dLSE`, and returns the unsharded results.
fn run_sp(strategy: Strategy, p: usize, spec: &AttentionSpec, x: &Random) -> Results {
    let layout = strategy.layout();
    let per_rank = run_ranks(p, TIMEOUT, |world| -> autosp_core::Result<Vec<Tensor>> {
        let r = world.rank();
        let sh = |t: &Tensor, dim| shard(t, dim, layout, p, r);
        let attn = strategy.build(&world);
        let tape = Tape::new(CheckpointPolicy::None);
        let (q, k, v) = (tape.leaf(sh(&x.q, 1)?), tape.leaf(sh(&x.k, 1)?), tape.leaf(sh(&x.v, 1)?));
        let (o, lse) = attn.forward(&tape, &q, &k, &v, spec)?;
        let lo = ops::sum_all(&tape, &ops::mul(&tape, &o, &tape.constant(sh(&x.d_o, 1)?))?)?;
        let ll = ops::sum_all(&tape, &ops::mul(&tape, &lse, &tape.constant(sh(&x.d_lse, 2)?))?)?;
        tape.backward(&ops::add(&tape, &lo, &ll)?)?;
        let grad = |val| tape.grad(val).map(|g| g.expect("a leaf has a gradient"));
        Ok(vec![o.tensor().clone(), lse.tensor().clone(), grad(&q)?, grad(&k)?, grad(&v)?])
    });
    let per_rank: Vec<Vec<Tensor>> = per_rank
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap().unwrap_or_else(|e| panic!("{strategy:?} P = {p}: rank {r}: {e}")))
        .collect();
    let whole = |i: usize, dim: usize| {
        let parts: Vec<Tensor> = per_rank.iter().map(|v| v[i].clone()).collect();
        unshard(&parts, dim, layout).unwrap()
    };
    [whole(0, 1), whole(1, 2), whole(2, 1), whole(3, 1), whole(4, 1)]
}

#[test]
fn sequence_parallel_kernels_see_exactly_the_keys_the_spec_gives_at_every_p() {
    let mut rng = Rng(23);
    let mut packed = 0;
    for p in 1..=4usize {
        let mut strategies = vec![Strategy::Ring(RingLayout::Contiguous), Strategy::Ring(RingLayout::Zigzag)];
        strategies.push(Strategy::Ulysses);
        if p == 4 {
            strategies.push(Strategy::Hybrid { u: 2, layout: RingLayout::Zigzag });
            strategies.push(Strategy::Hybrid { u: 2, layout: RingLayout::Contiguous });
        }
        for _ in 0..6 {
            // 2P chunks of 1 to 3 tokens (the zigzag layouts need a multiple of 2P).
            let n = 2 * p * (1 + rng.below(3));
            let spec = random_spec(&mut rng, n);
            packed += usize::from(spec.documents.as_ref().is_some_and(|d| d.count() > 1));
            // Heads Ulysses can split over P (and over the hybrid's groups of 2): 2P query heads, kv heads
            // split (2P), or replicated (one kv head per rank's group, or a single one).
            let h = 2 * p;
            let hkv = [h, p.max(1), 1][rng.below(3)];
            let d = n;
            let pr = probe(&mut rng, n, n, h, hkv, d);
            let probe_in = Random {
                q: pr.q,
                k: pr.k,
                v: pr.v,
                d_o: pr.d_o,
                d_lse: Tensor::zeros((BATCH, h, n), DType::F64, &Device::Cpu).unwrap(),
            };
            let x = random_inputs(&mut rng, n, n, h, hkv, d);
            let want = naive(&x, &spec);
            for &s in &strategies {
                let what = format!("{s:?} P = {p}, heads {h}/{hkv}");
                let [o, lse, _, _, dv] = run_sp(s, p, &spec, &probe_in);
                check_probe(&what, &spec, h, hkv, &o, &lse, &dv);
                check_random(&what, &spec, &run_sp(s, p, &spec, &x), &want);
            }
        }
    }
    assert!(packed > 4, "the specs must include packed documents: {packed} of 24");
}
