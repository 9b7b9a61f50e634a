//! Two toy transformer blocks (RMSNorm, q/k/v/o projections, rope, naive attention, SwiGLU MLP, residuals)
//! under each checkpoint policy: gradients bit-identical to `None`, memory ordered Full < SequenceAware < None
//! at the end of forward, peaks below None's, and SequenceAware holding attention outputs and LSE but no
//! linear output. Attention runs once in forward and at most once more in backward (under `Full`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use autosp_core::gradcheck::probe;
use autosp_core::ops::attention::{apply_attention, NaiveAttention};
use autosp_core::ops::{self, AttentionSpec};
use autosp_core::{CheckpointPolicy, MemoryStats, NodeKind, Op, Param, Result, SavedTensors, Saves, Tape, Value};
use candle_core::{DType, Device, Tensor};

const DM: usize = 32;
const HEADS: usize = 4;
const KV: usize = 2;
const HD: usize = 8;
const FF: usize = 64;
const N: usize = 48;
const VOCAB: usize = 16;

/// Naive attention that counts how often it runs forward (in the forward pass and in replays): an attention
/// with Ring or Ulysses communication inside does its collectives once per run.
#[derive(Debug)]
struct CountingAttention {
    inner: NaiveAttention,
    runs: Arc<AtomicUsize>,
}

impl Op for CountingAttention {
    fn name(&self) -> &'static str {
        "counting_attention"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Attention
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.runs.fetch_add(1, Ordering::Relaxed);
        self.inner.forward(i)
    }
    fn saves(&self) -> Saves {
        self.inner.saves()
    }
    fn backward(&self, saved: &SavedTensors<'_>, grads: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        self.inner.backward(saved, grads)
    }
}

/// Records causal attention through a [`CountingAttention`] counting into `runs`.
fn attend(t: &Tape, q: &Value, k: &Value, v: &Value, runs: &Arc<AtomicUsize>) -> Result<(Value, Value)> {
    let op = CountingAttention { inner: NaiveAttention { spec: AttentionSpec::causal() }, runs: runs.clone() };
    apply_attention(t, Arc::new(op), q, k, v)
}

struct Block {
    n1: Param,
    q: Param,
    k: Param,
    v: Param,
    o: Param,
    n2: Param,
    gate: Param,
    up: Param,
    down: Param,
    /// Forward runs of this block's attention.
    attention_runs: Arc<AtomicUsize>,
}

fn param(name: &str, shape: &[usize], seed: u64) -> Param {
    let t = (probe(shape, seed, &Device::Cpu).unwrap() * 0.3).unwrap().to_dtype(DType::F32).unwrap();
    Param::new(name, t)
}

fn norm_weight(name: &str, seed: u64) -> Param {
    let t = probe(&[DM], seed, &Device::Cpu).unwrap().affine(0.1, 1.0).unwrap().to_dtype(DType::F32).unwrap();
    Param::new(name, t)
}

impl Block {
    fn new(seed: u64) -> Self {
        Self {
            n1: norm_weight("n1", seed),
            q: param("q", &[HEADS * HD, DM], seed + 1),
            k: param("k", &[KV * HD, DM], seed + 2),
            v: param("v", &[KV * HD, DM], seed + 3),
            o: param("o", &[DM, HEADS * HD], seed + 4),
            n2: norm_weight("n2", seed + 5),
            gate: param("gate", &[FF, DM], seed + 6),
            up: param("up", &[FF, DM], seed + 7),
            down: param("down", &[DM, FF], seed + 8),
            attention_runs: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.n1, &self.q, &self.k, &self.v, &self.o, &self.n2, &self.gate, &self.up, &self.down]
    }

    fn forward(&self, t: &Tape, x: &Value, cos: &Value, sin: &Value) -> Result<Value> {
        let h = ops::rms_norm(t, x, &t.param(&self.n1)?, 1e-5)?;
        let q = ops::reshape(t, &ops::linear(t, &h, &t.param(&self.q)?, None)?, (1, N, HEADS, HD))?;
        let k = ops::reshape(t, &ops::linear(t, &h, &t.param(&self.k)?, None)?, (1, N, KV, HD))?;
        let v = ops::reshape(t, &ops::linear(t, &h, &t.param(&self.v)?, None)?, (1, N, KV, HD))?;
        let (q, k) = (ops::rope(t, &q, cos, sin)?, ops::rope(t, &k, cos, sin)?);
        let (a, _lse) = attend(t, &q, &k, &v, &self.attention_runs)?;
        let a = ops::linear(t, &ops::reshape(t, &a, (1, N, HEADS * HD))?, &t.param(&self.o)?, None)?;
        let x = ops::add(t, x, &a)?;
        let h = ops::rms_norm(t, &x, &t.param(&self.n2)?, 1e-5)?;
        let g = ops::silu(t, &ops::linear(t, &h, &t.param(&self.gate)?, None)?)?;
        let u = ops::linear(t, &h, &t.param(&self.up)?, None)?;
        let m = ops::linear(t, &ops::mul(t, &g, &u)?, &t.param(&self.down)?, None)?;
        ops::add(t, &x, &m)
    }
}

struct Model {
    embed: Param,
    blocks: Vec<Block>,
    norm: Param,
    head: Param,
}

struct Step {
    loss: f32,
    grads: Vec<Vec<u32>>,
    after_forward: MemoryStats,
    peak: MemoryStats,
    held_kinds: Vec<Option<NodeKind>>,
    replays: usize,
    /// Forward runs of each block's attention over the step (forward pass and replays).
    attention_runs: Vec<usize>,
}

impl Model {
    fn new() -> Self {
        Self {
            embed: param("embed", &[VOCAB, DM], 100),
            blocks: vec![Block::new(200), Block::new(300)],
            norm: norm_weight("norm", 400),
            head: param("head", &[VOCAB, DM], 500),
        }
    }

    fn params(&self) -> Vec<&Param> {
        let mut p = vec![&self.embed, &self.norm, &self.head];
        for b in &self.blocks {
            p.extend(b.params());
        }
        p
    }

    fn step(&self, policy: CheckpointPolicy) -> Step {
        self.step_mixed(policy, &[])
    }

    /// A step where block i may run under its own policy `per_block[i]`.
    fn step_mixed(&self, policy: CheckpointPolicy, per_block: &[CheckpointPolicy]) -> Step {
        for b in &self.blocks {
            b.attention_runs.store(0, Ordering::Relaxed);
        }
        let t = Tape::new(policy);
        let ids: Vec<u32> = (0..N as u32).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
        let mut targets: Vec<i64> = ids[1..].iter().map(|&x| x as i64).collect();
        targets.push(-100);
        let ids = t.constant(Tensor::from_vec(ids, (1, N), &Device::Cpu).unwrap());
        let targets = t.constant(Tensor::from_vec(targets, N, &Device::Cpu).unwrap());
        let positions: Vec<usize> = (0..N).collect();
        let inv = ops::rope::default_inv_freq(HD, 10000.0);
        let (cos, sin) = ops::rope_tables(&positions, &inv, DType::F32, &Device::Cpu).unwrap();
        let (cos, sin) = (t.constant(cos), t.constant(sin));

        let mut x = ops::embedding(&t, &ids, &t.param(&self.embed).unwrap()).unwrap();
        for (i, b) in self.blocks.iter().enumerate() {
            let p = per_block.get(i).copied().unwrap_or(policy);
            x = t.checkpoint_with(&format!("block{i}"), p, |t| b.forward(t, &x, &cos, &sin)).unwrap();
        }
        let h = ops::rms_norm(&t, &x, &t.param(&self.norm).unwrap(), 1e-5).unwrap();
        let logits = ops::linear(&t, &h, &t.param(&self.head).unwrap(), None).unwrap();
        let logits = ops::reshape(&t, &logits, (N, VOCAB)).unwrap();
        let (sum, count) = ops::cross_entropy(&t, &logits, &targets).unwrap();
        let loss = ops::scale(&t, &sum, 1.0 / count as f64).unwrap();
        drop((x, h, logits, sum));
        let after_forward = t.memory();
        let held_kinds = t.held().iter().map(|h| h.kind).collect();
        t.backward(&loss).unwrap();
        let g = t.param_grads();
        let grads = self
            .params()
            .iter()
            .map(|p| {
                g.get(p).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
            })
            .collect();
        Step {
            loss: loss.tensor().to_scalar::<f32>().unwrap(),
            grads,
            after_forward,
            peak: t.memory(),
            held_kinds,
            replays: t.replay_count(),
            attention_runs: self.blocks.iter().map(|b| b.attention_runs.load(Ordering::Relaxed)).collect(),
        }
    }
}

#[test]
fn policies_give_bit_identical_gradients_and_order_memory() {
    let model = Model::new();
    let none = model.step(CheckpointPolicy::None);
    let full = model.step(CheckpointPolicy::Full);
    let sa = model.step(CheckpointPolicy::SequenceAware);

    assert!(none.loss.is_finite() && none.loss > 0.0);
    for (name, s) in [("Full", &full), ("SequenceAware", &sa)] {
        assert_eq!(s.loss.to_bits(), none.loss.to_bits(), "{name}: loss differs");
        assert_eq!(s.grads.len(), none.grads.len());
        for (i, (a, b)) in s.grads.iter().zip(&none.grads).enumerate() {
            assert_eq!(a, b, "{name}: gradient of parameter {i} is not bit-identical to None's");
        }
    }
    assert_eq!(none.replays, 0, "None never recomputes");
    assert!(full.replays > sa.replays && sa.replays > 0, "Full {} vs SA {}", full.replays, sa.replays);

    let (n, f, s) = (none.after_forward.held_bytes, full.after_forward.held_bytes, sa.after_forward.held_bytes);
    assert!(f < s && s < n, "held bytes after forward: Full {f}, SequenceAware {s}, None {n}");
    assert!(
        full.peak.peak_bytes < none.peak.peak_bytes,
        "Full peak {} vs None {}",
        full.peak.peak_bytes,
        none.peak.peak_bytes
    );
    assert!(
        sa.peak.peak_bytes < none.peak.peak_bytes,
        "SA peak {} vs None {}",
        sa.peak.peak_bytes,
        none.peak.peak_bytes
    );
    // Backward releases everything it held.
    assert_eq!(none.peak.held_bytes, 0);
    assert_eq!(sa.peak.held_bytes, 0);
}

#[test]
fn sequence_aware_holds_attention_outputs_not_linear_outputs() {
    let model = Model::new();
    let none = model.step(CheckpointPolicy::None);
    let sa = model.step(CheckpointPolicy::SequenceAware);
    let full = model.step(CheckpointPolicy::Full);
    let count = |kinds: &[Option<NodeKind>], k: NodeKind| kinds.iter().filter(|x| **x == Some(k)).count();

    // Two blocks, each attention with two outputs (o and lse).
    assert_eq!(count(&sa.held_kinds, NodeKind::Attention), 4);
    assert_eq!(count(&none.held_kinds, NodeKind::Attention), 4);
    assert_eq!(count(&full.held_kinds, NodeKind::Attention), 0);
    // Linear outputs inside blocks (gate/up feed silu and mul) are held without checkpointing, never under
    // SequenceAware (the loss reads the logits through a reshape, a view).
    assert!(count(&none.held_kinds, NodeKind::Linear) >= 4);
    assert_eq!(count(&sa.held_kinds, NodeKind::Linear), 0);
    assert_eq!(count(&full.held_kinds, NodeKind::Linear), 0);
    // Norm and elementwise outputs inside blocks (rope, silu) are recomputed under SequenceAware.
    assert!(count(&none.held_kinds, NodeKind::Elementwise) > count(&sa.held_kinds, NodeKind::Elementwise));
}

#[test]
fn regions_with_their_own_policies_mix_on_one_tape() {
    let model = Model::new();
    let none = model.step(CheckpointPolicy::None);
    let mixed = model.step_mixed(CheckpointPolicy::None, &[CheckpointPolicy::SequenceAware, CheckpointPolicy::Full]);
    assert_eq!(mixed.grads, none.grads, "mixed policies must give None's gradients bit for bit");
    assert!(mixed.replays > 0);
    // Block 0 keeps its attention outputs (SequenceAware), block 1 drops them (Full).
    let attn = mixed.held_kinds.iter().filter(|k| **k == Some(NodeKind::Attention)).count();
    assert_eq!(attn, 2);
    assert!(mixed.after_forward.held_bytes < none.after_forward.held_bytes);
}

#[test]
fn backward_regenerates_a_region_lazily_one_part_at_a_time() {
    // One Full region with two independent chains, silu(x W1^T) + silu(x W2^T), each [n, f]. Backward reaches
    // the second chain's silu first: it regenerates that chain's linear output alone; the first chain's is
    // regenerated only when its silu's backward runs, after the second's was released. Replaying the whole
    // region at once would hold both ([n, f] each) beside the two incoming gradients.
    let (n, f) = (64, 256);
    let x = probe(&[n, DM], 1, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let w1 = Param::new("w1", probe(&[f, DM], 2, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap());
    let w2 = Param::new("w2", probe(&[f, DM], 3, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap());
    let tape = Tape::new(CheckpointPolicy::Full);
    let xv = tape.leaf(x);
    let y = tape
        .checkpoint("block", |t| {
            let a = ops::silu(t, &ops::linear(t, &xv, &t.param(&w1)?, None)?)?;
            let b = ops::silu(t, &ops::linear(t, &xv, &t.param(&w2)?, None)?)?;
            ops::add(t, &a, &b)
        })
        .unwrap();
    let loss = ops::sum_all(&tape, &y).unwrap();
    tape.reset_peak();
    tape.backward(&loss).unwrap();
    let nf = n * f * 4;
    let peak = tape.memory().peak_bytes;
    // Lazily, at the second silu's backward: the incoming gradient (add passes one tensor to both chains),
    // the regenerated linear output and its gradient (3 nf) and the leaf x. Regenerating the whole region
    // there would add the first chain's linear output: 4 nf + x (measured with the eager replay: 270336
    // bytes against 204800).
    let bound = 3 * nf + n * DM * 4;
    assert!(peak <= bound, "backward peak {peak} bytes over {bound}: the region was not regenerated lazily");
    assert_eq!(tape.replay_count(), 2, "each linear replayed once");
}

#[test]
fn attention_runs_once_more_in_backward_under_full_and_never_again() {
    // Full drops the attention's o and lse. The first backward that reads o (the output projection's, through
    // a reshape) replays the attention; that replay must keep lse too, which the attention's own backward
    // reads, or that backward replays the attention (and, for Ring or Ulysses, its collectives) once more.
    let model = Model::new();
    let none = model.step(CheckpointPolicy::None);
    let sa = model.step(CheckpointPolicy::SequenceAware);
    let full = model.step(CheckpointPolicy::Full);
    assert_eq!(none.attention_runs, vec![1, 1], "None: forward only");
    assert_eq!(sa.attention_runs, vec![1, 1], "SequenceAware never replays attention");
    assert_eq!(full.attention_runs, vec![2, 2], "Full: forward and exactly one replay per block");
    assert_eq!(full.grads, none.grads);
    let mixed = model.step_mixed(CheckpointPolicy::None, &[CheckpointPolicy::SequenceAware, CheckpointPolicy::Full]);
    assert_eq!(mixed.attention_runs, vec![1, 2]);
}

#[test]
fn a_replayed_attention_whose_o_and_lse_both_feed_the_loss_runs_once_more() {
    // loss = sum(o W^T) + 0.1 sum(lse), all inside one region: backward regenerates lse first (its sum's
    // backward reads nothing, so the first replay comes from the projection's backward reading o) and the
    // attention's backward gets a gradient for both outputs. Gradients bit-identical to None's, the attention
    // run twice under Full (forward, one replay) and once otherwise.
    let n = 24;
    let x = probe(&[1, n, DM], 11, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let (wq, wk, wv) =
        (param("wq", &[HEADS * HD, DM], 12), param("wk", &[KV * HD, DM], 13), param("wv", &[KV * HD, DM], 14));
    let wo = param("wo", &[DM, HEADS * HD], 15);
    let run = |policy: CheckpointPolicy| {
        let runs = Arc::new(AtomicUsize::new(0));
        let tape = Tape::new(policy);
        let xv = tape.leaf(x.clone());
        let y = tape
            .checkpoint("block", |t| {
                let proj =
                    |w: &Param, h: usize| ops::reshape(t, &ops::linear(t, &xv, &t.param(w)?, None)?, (1, n, h, HD));
                let (q, k, v) = (proj(&wq, HEADS)?, proj(&wk, KV)?, proj(&wv, KV)?);
                let (o, lse) = attend(t, &q, &k, &v, &runs)?;
                let o = ops::linear(t, &ops::reshape(t, &o, (1, n, HEADS * HD))?, &t.param(&wo)?, None)?;
                ops::add(t, &ops::sum_all(t, &o)?, &ops::scale(t, &ops::sum_all(t, &lse)?, 0.1)?)
            })
            .unwrap();
        tape.backward(&y).unwrap();
        let g = tape.param_grads();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let mut grads: Vec<Vec<u32>> = [&wq, &wk, &wv, &wo].iter().map(|p| bits(g.get(p).unwrap())).collect();
        grads.push(bits(&tape.grad(&xv).unwrap().unwrap()));
        (grads, runs.load(Ordering::Relaxed))
    };
    let (none, none_runs) = run(CheckpointPolicy::None);
    for (policy, want) in
        [(CheckpointPolicy::None, 1), (CheckpointPolicy::SequenceAware, 1), (CheckpointPolicy::Full, 2)]
    {
        let (grads, runs) = run(policy);
        assert_eq!(runs, want, "{policy:?}: attention forward runs");
        assert_eq!(grads, none, "{policy:?}: gradients differ from None's");
    }
    assert_eq!(none_runs, 1);
}
