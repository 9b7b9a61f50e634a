//! Ring attention: each rank keeps its queries and passes key/value blocks around the ring r -> r+1; partial
//! outputs merge by their LSE in f32 ([`RunningAttention`]). One tape op of kind `Attention`
//! ([`RingAttentionOp`]), so `SequenceAware` checkpointing never replays it.
//!
//! Layouts ([`RingLayout`]): `Contiguous` (rank r holds chunk r of P; for non-causal attention) and `Zigzag`
//! (the sequence in 2P chunks, rank r holds `[c_r ; c_{2P-1-r}]`; for causal attention, equal work on every
//! rank). The positions given to the attention kernel are the true global ones (plus the caller's `q_offset` /
//! `k_offset`, which describe the start of the whole sequence); a (query chunk, key chunk) pair that the mask
//! hides entirely ([`AttentionSpec::block`] says [`Visibility::Hidden`]: a causal cut, a sliding window
//! `max_distance`, a packed sequence's documents when the two chunks hold none in common) is skipped, a pair it does not touch runs unmasked, and a pair it cuts runs with the spec
//! at the pair's true positions.
//!
//! Forward: step s = 0 … P-1 computes against the block of rank `t = r - s (mod P)`; for s < P-1 the block
//! (k and v packed in one tensor) goes on with one `send_recv(r+1, r-1)`, which runs on a helper thread while
//! this step computes (`overlap`, the default; any back end whose group may be called from another thread).
//!
//! Backward (FlashAttention-2 per block, exact): every block's attention backward uses the FINAL o and lse of each
//! row (and the incoming d_lse, which adds `P ∘ d_lse` to dS), so the block contributions sum to the gradient
//! of the whole row. dQ stays local, summed over the blocks in step order. The dK/dV accumulator of a block
//! travels with it: step s computes on block t and adds to its accumulator, then one `send_recv` (after the
//! compute) hands the accumulator to r+1; after P such hops the accumulator is back at its owner. The k/v block
//! itself travels as in the forward, overlapped with compute (P-1 `send_recv`). Deterministic: every sum runs
//! in a fixed order.
//!
//! Communication per layer, rank r, `E = b · n · h_kv · d` elements of the local k (n = N/P local tokens),
//! `s` bytes per input element, `s_acc` per accumulator element (4 for f32/bf16/f16, 8 for f64):
//!
//! | pass | calls | bytes sent |
//! |---|---|---|
//! | forward | `P-1` send_recv | `(P-1) · 2E · s` |
//! | backward | `2P-1` send_recv (`P-1` k/v blocks, `P` dK/dV accumulators) | `(P-1) · 2E · s + P · 2E · s_acc` |

use std::sync::Arc;

use autosp_core::comm::ProcessGroup;
use autosp_core::ops::attention::{apply_attention, AttentionSpec, Visibility};
use autosp_core::{Attention, NodeKind, Op, Precision, SavedTensors, Saves, Tape, Value};
use candle_core::Tensor;

use super::error::SpError;
use crate::attention::{attention_backward, attention_forward};
use crate::merge::RunningAttention;
use crate::running_sum::add_to;

/// Which chunks of the sequence each rank of the ring holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingLayout {
    /// Rank r holds chunk r of P (non-causal attention; causal works but rank P-1 does P times rank 0's work).
    Contiguous,
    /// Rank r holds chunks r and 2P-1-r of 2P, concatenated (causal attention, balanced).
    Zigzag,
}

/// Ring attention over `group`, as an [`Attention`]: `q: [b, n, h, d]`, `k, v: [b, n, h_kv, d]`, the local
/// shard of the sequence in `layout` (n = N/P tokens) -> `(o: [b, n, h, d], lse: [b, h, n])`, the local shard.
#[derive(Debug, Clone)]
pub struct RingAttention {
    /// The ranks of the ring, in ring order.
    pub group: Arc<dyn ProcessGroup>,
    /// Which chunks each rank holds.
    pub layout: RingLayout,
    /// Run each k/v `send_recv` on a helper thread while the step computes (default true). Turn off for a back
    /// end whose group must only be called from the thread that created it.
    pub overlap: bool,
}

impl RingAttention {
    /// The tape op for one call with `spec`.
    fn op(&self, spec: &AttentionSpec) -> Arc<dyn Op> {
        Arc::new(RingAttentionOp {
            group: self.group.clone(),
            layout: self.layout,
            spec: spec.clone(),
            overlap: self.overlap,
        })
    }

    /// Ring attention over `group` in `layout`, with communication overlapped.
    pub fn new(group: Arc<dyn ProcessGroup>, layout: RingLayout) -> Self {
        Self { group, layout, overlap: true }
    }
}

impl Attention for RingAttention {
    fn describe(&self) -> String {
        let layout = match self.layout {
            RingLayout::Contiguous => "contiguous",
            RingLayout::Zigzag => "zigzag",
        };
        format!("ring(p={}, {layout}) > local", self.group.size())
    }

    fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> autosp_core::Result<(Value, Value)> {
        apply_attention(tape, self.op(spec), q, k, v)
    }

    fn as_op(&self, spec: &AttentionSpec) -> Option<Arc<dyn Op>> {
        Some(self.op(spec))
    }
}

/// The ring attention tape op: inputs `q, k, v` (local shards), outputs `o, lse` (local shards); saves all five.
#[derive(Debug)]
pub struct RingAttentionOp {
    /// The ring.
    pub group: Arc<dyn ProcessGroup>,
    /// Which chunks each rank holds.
    pub layout: RingLayout,
    /// Mask and scale; offsets are those of the whole (unsharded) sequence.
    pub spec: AttentionSpec,
    /// Overlap k/v transfers with compute.
    pub overlap: bool,
}

/// A run of consecutive local rows and the global position of its first row.
#[derive(Clone, Copy, Debug)]
struct Segment {
    start: usize,
    len: usize,
    pos: usize,
}

/// One attention call of a step: query rows, key rows (local), and the spec to run them with.
#[derive(Clone, Debug)]
struct Call {
    q: (usize, usize),
    k: (usize, usize),
    spec: AttentionSpec,
}

impl RingAttentionOp {
    /// The segments rank `t` holds when the local length is `n`.
    fn segments(&self, t: usize, n: usize) -> Vec<Segment> {
        let p = self.group.size();
        match self.layout {
            RingLayout::Contiguous => vec![Segment { start: 0, len: n, pos: t * n }],
            RingLayout::Zigzag => {
                let c = n / 2;
                vec![Segment { start: 0, len: c, pos: t * c }, Segment { start: c, len: c, pos: (2 * p - 1 - t) * c }]
            }
        }
    }

    /// The attention calls of the step where this rank's queries meet the block of rank `t`: (query segment, key
    /// segment) pairs that the mask (causal cut, sliding window, documents) hides entirely are skipped, pairs it does not
    /// touch are grouped and run unmasked, the others run with the spec at their true positions.
    fn calls(&self, t: usize, n: usize) -> Vec<Call> {
        let r = self.group.rank();
        let (qs, ks) = (self.segments(r, n), self.segments(t, n));
        let full = self.spec.unmasked();
        let class = |a: &Segment, b: &Segment| pair_class(&self.spec, a, b);
        if qs.iter().all(|a| ks.iter().all(|b| class(a, b) == Visibility::Full)) {
            return vec![Call { q: (0, n), k: (0, n), spec: full }];
        }
        let mut calls = Vec::new();
        for a in &qs {
            if ks.iter().all(|b| class(a, b) == Visibility::Full) {
                calls.push(Call { q: (a.start, a.len), k: (0, n), spec: full.clone() });
                continue;
            }
            for b in &ks {
                let spec = match class(a, b) {
                    Visibility::Hidden => continue,
                    Visibility::Full => full.clone(),
                    Visibility::Partial => self.spec.clone().shifted(a.pos, b.pos),
                };
                calls.push(Call { q: (a.start, a.len), k: (b.start, b.len), spec });
            }
        }
        calls
    }

    /// The local sequence length, after checking the shapes and the layout.
    fn check(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> autosp_core::Result<usize> {
        let dims = self.spec.dims("ring_attention", q, k, v)?;
        if dims.q_len != dims.k_len {
            return Err(SpError::Config {
                what: "ring_attention",
                msg: format!(
                    "q has {} local tokens but k has {}; ring attention shards queries and keys alike",
                    dims.q_len, dims.k_len
                ),
            }
            .into());
        }
        let n = dims.q_len;
        if n == 0 || (self.layout == RingLayout::Zigzag && n % 2 != 0) {
            return Err(SpError::UnevenShards { what: "ring_attention (zigzag local shard)", len: n, parts: 2 }.into());
        }
        Ok(n)
    }

    /// `(t, received)`: runs `work` while `x` goes `r -> r+1` (on a helper thread when `overlap`), then returns
    /// the block received from r-1.
    fn pass_on<R>(
        &self,
        x: &Tensor,
        work: impl FnOnce() -> autosp_core::Result<R>,
    ) -> autosp_core::Result<(R, Tensor)> {
        let (p, r) = (self.group.size(), self.group.rank());
        let (dst, src) = ((r + 1) % p, (r + p - 1) % p);
        if !self.overlap {
            let out = work()?;
            return Ok((out, self.group.send_recv(x, dst, src)?));
        }
        std::thread::scope(|scope| {
            let group = &self.group;
            let transfer = scope.spawn(move || group.send_recv(x, dst, src));
            let out = work();
            let got = transfer
                .join()
                .map_err(|_| autosp_core::Error::Internal("ring attention: the transfer thread panicked".into()))?;
            Ok((out?, got?))
        })
    }
}

/// How much of key segment `b` query segment `a` sees under `spec` (whose offsets are those of the whole
/// sequence): the spec's own answer for the pair at its true positions. Segments are non-empty.
fn pair_class(spec: &AttentionSpec, a: &Segment, b: &Segment) -> Visibility {
    spec.clone().shifted(a.pos, b.pos).block(0..a.len, 0..b.len)
}

impl Op for RingAttentionOp {
    fn name(&self) -> &'static str {
        "ring_attention"
    }

    fn kind(&self) -> NodeKind {
        NodeKind::Attention
    }

    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1, 2]).and_outputs(&[0, 1])
    }

    fn forward(&self, inputs: &[&Tensor]) -> autosp_core::Result<Vec<Tensor>> {
        let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
        let n = self.check(q, k, v)?;
        let (p, r) = (self.group.size(), self.group.rank());
        let b = k.dim(0)?;
        let qs = self.segments(r, n);
        let mut acc: Vec<Option<RunningAttention>> = (0..qs.len()).map(|_| None).collect();
        let mut block = Tensor::cat(&[k, v], 0)?;
        for s in 0..p {
            let t = (r + p - s) % p;
            let compute = |acc: &mut Vec<Option<RunningAttention>>| -> autosp_core::Result<()> {
                let (kb, vb) = (block.narrow(0, 0, b)?, block.narrow(0, b, b)?);
                for c in self.calls(t, n) {
                    let (o, lse) = attention_forward(
                        &q.narrow(1, c.q.0, c.q.1)?,
                        &kb.narrow(1, c.k.0, c.k.1)?,
                        &vb.narrow(1, c.k.0, c.k.1)?,
                        &c.spec,
                    )?;
                    for (i, seg) in qs.iter().enumerate() {
                        if seg.start < c.q.0 || seg.start + seg.len > c.q.0 + c.q.1 {
                            continue;
                        }
                        let o = o.narrow(1, seg.start - c.q.0, seg.len)?;
                        let lse = lse.narrow(2, seg.start - c.q.0, seg.len)?;
                        match &mut acc[i] {
                            Some(run) => run.merge(&o, &lse)?,
                            None => acc[i] = Some(RunningAttention::new(&o, &lse)?),
                        }
                    }
                }
                Ok(())
            };
            if s + 1 < p {
                let ((), next) = self.pass_on(&block, || compute(&mut acc))?;
                block = next;
            } else {
                compute(&mut acc)?;
            }
        }
        let mut os = Vec::new();
        let mut lses = Vec::new();
        for (run, seg) in acc.into_iter().zip(&qs) {
            let (o, lse) = match run {
                Some(run) => run.finish()?,
                // No key of any block is visible to this segment (possible only when the caller's q_offset and
                // k_offset differ): o = 0 and lse = -inf, as the attention kernels give a row that sees no key.
                None => {
                    let (h, d) = (q.dim(2)?, q.dim(3)?);
                    let lse_dtype = Precision::float(q.dtype()).accumulate();
                    (
                        Tensor::zeros((b, seg.len, h, d), q.dtype(), q.device())?,
                        Tensor::full(f64::NEG_INFINITY, (b, h, seg.len), q.device())?.to_dtype(lse_dtype)?,
                    )
                }
            };
            os.push(o);
            lses.push(lse);
        }
        Ok(vec![Tensor::cat(&os, 1)?, Tensor::cat(&lses, 2)?])
    }

    fn backward(&self, saved: &SavedTensors<'_>, grads: &[Option<Tensor>]) -> autosp_core::Result<Vec<Option<Tensor>>> {
        let (q, k, v, o, lse) = (saved.input(0)?, saved.input(1)?, saved.input(2)?, saved.output(0)?, saved.output(1)?);
        let d_o = match &grads[0] {
            Some(d) => d.clone(),
            None => o.zeros_like()?,
        };
        let d_lse = grads[1].as_ref();
        let n = self.check(q, k, v)?;
        let (p, r) = (self.group.size(), self.group.rank());
        let b = k.dim(0)?;
        let acc_dtype = Precision::float(q.dtype()).accumulate();
        let mut dq: Option<Tensor> = None;
        let mut block = Tensor::cat(&[k, v], 0)?;
        let mut dkv: Option<Tensor> = None;
        for s in 0..p {
            let t = (r + p - s) % p;
            let ks = self.segments(t, n);
            let compute = || -> autosp_core::Result<(Option<Tensor>, Tensor)> {
                let (kb, vb) = (block.narrow(0, 0, b)?, block.narrow(0, b, b)?);
                // This step's dQ, summed call by call as each is made (in call order, as before): never more
                // than the sum and one padded call's dQ alive, whatever the number of calls.
                let mut dq_sum: Option<Tensor> = None;
                let mut dk_seg: Vec<Option<Tensor>> = vec![None; ks.len()];
                let mut dv_seg: Vec<Option<Tensor>> = vec![None; ks.len()];
                let mut dk_all: Option<(Tensor, Tensor)> = None;
                for c in self.calls(t, n) {
                    let rows = |x: &Tensor, dim: usize| x.narrow(dim, c.q.0, c.q.1);
                    let (dq_c, dk_c, dv_c) = attention_backward(
                        &rows(q, 1)?,
                        &kb.narrow(1, c.k.0, c.k.1)?,
                        &vb.narrow(1, c.k.0, c.k.1)?,
                        &rows(o, 1)?,
                        &rows(lse, 2)?,
                        &rows(&d_o, 1)?,
                        d_lse.map(|d| rows(d, 2)).transpose()?.as_ref(),
                        &c.spec,
                    )?;
                    let dq_c = dq_c.to_dtype(acc_dtype)?.pad_with_zeros(1, c.q.0, n - c.q.0 - c.q.1)?;
                    add_to(&mut dq_sum, dq_c)?;
                    let (dk_c, dv_c) = (dk_c.to_dtype(acc_dtype)?, dv_c.to_dtype(acc_dtype)?);
                    if c.k == (0, n) {
                        dk_all = Some(match dk_all.take() {
                            Some((a, bb)) => ((a + dk_c)?, (bb + dv_c)?),
                            None => (dk_c, dv_c),
                        });
                    } else {
                        let i = ks.iter().position(|seg| seg.start == c.k.0).expect("calls use whole segments");
                        add_to(&mut dk_seg[i], dk_c)?;
                        add_to(&mut dv_seg[i], dv_c)?;
                    }
                }
                // This step's dK/dV of the whole block: per-segment parts placed, plus whole-block parts.
                let (hkv, d) = (k.dim(2)?, k.dim(3)?);
                let place = |parts: Vec<Option<Tensor>>| -> candle_core::Result<Tensor> {
                    let pieces = parts
                        .into_iter()
                        .zip(&ks)
                        .map(|(x, seg)| match x {
                            Some(x) => Ok(x),
                            None => Tensor::zeros((b, seg.len, hkv, d), acc_dtype, k.device()),
                        })
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    Tensor::cat(&pieces, 1)
                };
                let (mut dk_b, mut dv_b) = (place(dk_seg)?, place(dv_seg)?);
                if let Some((a, bb)) = dk_all {
                    dk_b = (dk_b + a)?;
                    dv_b = (dv_b + bb)?;
                }
                Ok((dq_sum, Tensor::cat(&[dk_b, dv_b], 0)?))
            };
            let ((dq_s, dkv_s), next) = if s + 1 < p {
                let (out, next) = self.pass_on(&block, compute)?;
                (out, Some(next))
            } else {
                (compute()?, None)
            };
            if let Some(d) = dq_s {
                add_to(&mut dq, d)?;
            }
            let mine = match dkv.take() {
                Some(acc) => (acc + dkv_s)?,
                None => dkv_s,
            };
            // The accumulator of block t goes on with the block; after P hops it is back at its owner.
            dkv = Some(self.group.send_recv(&mine, (r + 1) % p, (r + p - 1) % p)?);
            if let Some(next) = next {
                block = next;
            }
        }
        let dq = match dq {
            Some(d) => d.to_dtype(q.dtype())?,
            None => q.zeros_like()?,
        };
        let dkv = dkv.expect("P >= 1 steps ran");
        let dk = dkv.narrow(0, 0, b)?.to_dtype(k.dtype())?;
        let dv = dkv.narrow(0, b, b)?.to_dtype(v.dtype())?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The class of every (query segment, key segment) pair agrees with the spec's own `visible`, pair by pair:
    /// Hidden exactly when no pair is visible (the call is skipped), Full exactly when every pair is (the call
    /// runs unmasked). Exhaustive over small segments, causal or not, without and with windows, without and
    /// with documents, and offsets.
    #[test]
    fn pair_classes_agree_with_the_mask() {
        use autosp_core::ops::attention::Documents;
        let packed = Some(Arc::new(Documents::from_lengths(&[2, 1, 4, 3], 0).unwrap()));
        let mut seen = [0usize; 3];
        for causal in [false, true] {
            for w in std::iter::once(None).chain((0..7).map(Some)) {
                for (q_offset, k_offset, documents) in
                    [(0, 0, None), (3, 0, None), (0, 4, None), (0, 0, packed.clone()), (3, 0, packed.clone())]
                {
                    let spec = AttentionSpec { causal, scale: None, q_offset, k_offset, max_distance: w, documents };
                    for (qpos, qlen, kpos, klen) in (0..6).flat_map(|qp| {
                        (1..4).flat_map(move |ql| (0..6).flat_map(move |kp| (1..4).map(move |kl| (qp, ql, kp, kl))))
                    }) {
                        let a = Segment { start: 0, len: qlen, pos: qpos };
                        let b = Segment { start: 0, len: klen, pos: kpos };
                        let vis = |i: usize, j: usize| {
                            let s = spec.clone().shifted(qpos, kpos);
                            s.visible(i, j)
                        };
                        let pairs: Vec<bool> =
                            (0..qlen).flat_map(|i| (0..klen).map(move |j| (i, j))).map(|(i, j)| vis(i, j)).collect();
                        let want = if !pairs.iter().any(|&x| x) {
                            Visibility::Hidden
                        } else if pairs.iter().all(|&x| x) {
                            Visibility::Full
                        } else {
                            Visibility::Partial
                        };
                        assert_eq!(pair_class(&spec, &a, &b), want, "{spec:?} {a:?} {b:?}");
                        seen[want as usize] += 1;
                    }
                }
            }
        }
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    }

    /// Packed documents that end at the chunk boundaries: a step whose (query, key) chunk pairs all hold
    /// different documents makes no attention call at all, where the document-blind causal step computes them.
    #[test]
    fn chunk_pairs_in_different_documents_are_never_computed() {
        use autosp_core::comm::run_ranks;
        use autosp_core::ops::attention::Documents;
        let out = run_ranks(2, std::time::Duration::from_secs(10), |group| {
            let docs = Some(Arc::new(Documents::from_lengths(&[4, 4, 4, 4], 0).unwrap()));
            let op = |spec| RingAttentionOp { group: group.clone(), layout: RingLayout::Zigzag, spec, overlap: false };
            // Zigzag over 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; n = 8 local tokens.
            let (blind, packed) = (op(AttentionSpec::causal()), op(AttentionSpec::causal().with_documents(docs)));
            let other = 1 - group.rank();
            (blind.calls(other, 8).len(), packed.calls(other, 8).len(), packed.calls(group.rank(), 8).len())
        });
        let (r0, r1) = (out[0].as_ref().unwrap(), out[1].as_ref().unwrap());
        // Rank 0 against rank 1's chunks 1 and 2: its chunk 3 sees both without documents, neither with them.
        assert!(r0.0 > 0 && r0.1 == 0, "rank 0: {r0:?}");
        // Rank 1 against rank 0's chunks 0 and 3: chunks 1 and 2 see chunk 0 only without documents.
        assert!(r1.0 > 0 && r1.1 == 0, "rank 1: {r1:?}");
        // Each rank's own chunks: only the diagonal pairs (chunk against itself), masked.
        assert_eq!((r0.2, r1.2), (2, 2));
    }
}
