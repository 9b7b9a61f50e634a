//! The plan: how much tape memory a step holds per rank (fitted from two probe steps, so it is right for
//! any model), the predicted peak at a target length, FLOPs per step (attention vs linear, with
//! recompute), communication bytes, and the budget planner that picks a policy per block.

use autosp_core::comm::all_reduce_bytes;
use autosp_core::module::visit_mut;
use autosp_core::shard::{wire_dtype, ShardLevel};
use autosp_core::{CausalLm, CheckpointPolicy, Param, Precision};
use candle_core::{DType, Device, Tensor};

use super::config::Strategy;
use super::grad_reduce::grad_buckets;
use super::step::StepOutput;
use super::strategy::comm_bytes_per_layer_step;
use super::{CompileError, Compiled};

/// A line `a + b * n` through two probe measurements (`n`: the global sequence length).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearFit {
    pub a: f64,
    pub b: f64,
}

impl LinearFit {
    fn through(n1: usize, y1: usize, n2: usize, y2: usize) -> Self {
        let b = (y2 as f64 - y1 as f64) / (n2 as f64 - n1 as f64);
        Self { a: y1 as f64 - b * n1 as f64, b }
    }

    /// The value at `n`.
    pub fn at(&self, n: usize) -> f64 {
        self.a + self.b * n as f64
    }
}

/// Tape bytes per rank under one policy, as functions of the global sequence length.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyMemory {
    /// The policy of every block (`None`: the blocks' own policies, a mix).
    pub policy: Option<CheckpointPolicy>,
    /// The two probe lengths the fits go through.
    pub probes: (usize, usize),
    /// Bytes held when the forward pass ends.
    pub after_forward: LinearFit,
    /// Peak bytes over the step, the line through the probes' peaks.
    pub peak: LinearFit,
    /// The held bytes at every moment they rose, one line per moment (empty when the probes' traces did not
    /// line up).
    pub moments: Vec<LinearFit>,
}

impl PolicyMemory {
    /// The predicted tape peak at `n` tokens: the largest moment, or the line through the probes' peaks
    /// when the moments are unknown.
    pub fn peak_at(&self, n: usize) -> f64 {
        if self.moments.is_empty() {
            return self.peak.at(n);
        }
        self.moments.iter().map(|m| m.at(n)).fold(f64::MIN, f64::max)
    }
}

/// The fraction of causal attention's (query, key) pairs over `n` tokens (about n² / 2) that a sliding window
/// of `w` keeps: `Σ_p min(p + 1, w + 1) / (n (n + 1) / 2)`; 1 without a window.
fn window_fraction(n: usize, window: Option<usize>) -> f64 {
    let n = n as f64;
    let all = n * (n + 1.0) / 2.0;
    match window {
        Some(w) if (w as f64) + 1.0 < n => {
            let w1 = w as f64 + 1.0;
            (w1 * (w1 + 1.0) / 2.0 + (n - w1) * w1) / all
        }
        _ => 1.0,
    }
}

/// The longest probe step the plan runs (tokens): probes stay cheap next to a long target step.
pub const PROBE_CAP: usize = 2048;

/// FLOPs of one training step on one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Flops {
    /// Attention (forward, backward and any recompute).
    pub attention: f64,
    /// Matrix products of the layers and the LM head (forward, backward and any recompute).
    pub linear: f64,
}

/// The compiled model's plan at one sequence length.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Global sequence length the plan is for (before padding).
    pub n: usize,
    /// Ranks.
    pub p: usize,
    /// The policy of each block.
    pub policies: Vec<CheckpointPolicy>,
    /// Tape bytes per local token per layer held when the forward pass ends (the slope of the fit, over
    /// the layers; the LM head's share is included).
    pub bytes_per_token_per_layer: f64,
    /// Predicted tape bytes per rank when the forward pass ends.
    pub predicted_after_forward: f64,
    /// Predicted tape peak per rank over the step.
    pub predicted_peak: f64,
    /// The probe lengths the memory prediction was fitted through.
    pub probes: (usize, usize),
    /// FLOPs per step per rank.
    pub flops: Flops,
    /// Bytes this rank sends per step in the attention's collectives (forward, backward and, under `Full`, the
    /// one replay of each attention in backward; [`comm_bytes_per_layer_step`]): what the `AllToAll` and
    /// `SendRecv` counters of the attention's groups show after a step at the padded length.
    pub attention_comm_bytes: f64,
    /// Bytes this rank sends per step: [`attention_comm_bytes`](Self::attention_comm_bytes), the gradient
    /// all-reduce (f32, f64 for f64 parameters, one per bucket) and the loss's two reductions, each element
    /// counted at its real size.
    pub comm_bytes: f64,
}

impl<M: CausalLm> Compiled<M> {
    /// The shortest probe length: a short sequence that fits the layout.
    fn probe_base(&self) -> usize {
        self.padded_len(64.max(16 * self.sp.size()))
    }

    /// One probe step of `n` tokens per data-parallel replica (a batch of D sequences, one for each replica,
    /// so each rank's figures are those of one `n`-token sequence split over its replica's S ranks): under
    /// `policy` in every block, or (`None`) under the blocks' own policies as they stand.
    fn probe_step(&self, n: usize, policy: Option<CheckpointPolicy>) -> Result<StepOutput, CompileError> {
        let vocab = self.model.dims().vocab as u32;
        let rows = self.mesh.data;
        let ids: Vec<u32> = (0..(rows * n) as u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let ids = Tensor::from_vec(ids, (rows, n), &Device::Cpu)?;
        self.run_step(&ids, None, None, policy.unwrap_or(self.tape_policy()), true, 1.0)
    }

    /// Probes two lengths `n1` and `n2 = 2 n1` and fits the tape's bytes through them. The bytes after the
    /// forward pass are linear in n. The peak is the maximum over the step of the held bytes, each moment's
    /// bytes affine in n (activations held, gradients made so far), so the peak is convex in n and a line
    /// through two probes misses every change of the moment that peaks. The probes therefore trace the held
    /// bytes after every increase: the same program gives traces of the same length, the peak at any n is
    /// the largest of the per-moment lines. (If the traces differ in length the secant is kept: a lower
    /// bound.) `n2` is the largest layout-aligned length at most `target / 4` and [`PROBE_CAP`], never below
    /// twice the shortest probe.
    fn probe_fit(&self, policy: Option<CheckpointPolicy>, target: usize) -> Result<PolicyMemory, CompileError> {
        let step = 2 * self.padded_len(1);
        let n2 = ((target / 4).min(PROBE_CAP) / step * step).max(2 * self.probe_base());
        let n1 = n2 / 2;
        let (s1, s2) = (self.probe_step(n1, policy)?, self.probe_step(n2, policy)?);
        let fit = |a: usize, b: usize| LinearFit::through(n1, a, n2, b);
        let moments = if s1.memory_trace.len() == s2.memory_trace.len() {
            s1.memory_trace.iter().zip(&s2.memory_trace).map(|(&a, &b)| fit(a, b)).collect()
        } else {
            Vec::new()
        };
        Ok(PolicyMemory {
            policy,
            probes: (n1, n2),
            after_forward: fit(s1.after_forward.held_bytes, s2.after_forward.held_bytes),
            peak: fit(s1.peak_bytes, s2.peak_bytes),
            moments,
        })
    }

    /// Measures tape memory under `policy` (every block) with probe steps sized for predictions at `target`
    /// tokens: every rank of the group must call this at the same time. Parameters are not changed.
    pub fn measure_policy(&mut self, policy: CheckpointPolicy, target: usize) -> Result<PolicyMemory, CompileError> {
        let saved = self.region_policies();
        self.set_region_policies(&vec![None; saved.len()]);
        let m = self.probe_fit(Some(policy), target);
        self.set_region_policies(&saved);
        m
    }

    /// The region policy of every block (`None`: the tape's).
    pub(crate) fn region_policies(&mut self) -> Vec<Option<CheckpointPolicy>> {
        let mut out = Vec::new();
        visit_mut(&mut self.model, "", &mut |_, m| {
            if let Some(r) = m.region_slot() {
                out.push(r.policy());
            }
        });
        out
    }

    pub(crate) fn set_region_policies(&mut self, policies: &[Option<CheckpointPolicy>]) {
        let mut i = 0;
        visit_mut(&mut self.model, "", &mut |_, m| {
            if let Some(r) = m.region_slot() {
                r.set_policy(policies.get(i).copied().flatten());
                i += 1;
            }
        });
    }

    /// Picks a policy per block so that the predicted tape peak at `n` tokens stays within `budget` bytes:
    /// all blocks start at `Full`; blocks are raised to `SequenceAware`, then to `None`, one at a time, while
    /// the prediction fits; then the mix is probed as it stands and the last raises are undone until its own
    /// prediction fits. Collective (probes run steps).
    pub(crate) fn plan_budget(&mut self, budget: usize, n: usize) -> Result<(), CompileError> {
        let full = self.measure_policy(CheckpointPolicy::Full, n)?;
        let sa = self.measure_policy(CheckpointPolicy::SequenceAware, n)?;
        let none = self.measure_policy(CheckpointPolicy::None, n)?;
        let layers = self.region_policies().len().max(1) as f64;
        let smallest = full.peak_at(n);
        if smallest > budget as f64 {
            return Err(CompileError::BudgetTooSmall { budget, smallest: smallest as usize, n });
        }
        // Per block, the extra bytes of a policy over Full (held from forward to backward).
        let extra = |m: &PolicyMemory| ((m.after_forward.at(n) - full.after_forward.at(n)) / layers).max(0.0);
        let overhead = |m: &PolicyMemory| m.peak_at(n) - m.after_forward.at(n);
        let mut policies = vec![CheckpointPolicy::Full; layers as usize];
        let predict = |ps: &[CheckpointPolicy]| {
            let held: f64 = full.after_forward.at(n)
                + ps.iter()
                    .map(|p| match p {
                        CheckpointPolicy::SequenceAware => extra(&sa),
                        CheckpointPolicy::None => extra(&none),
                        CheckpointPolicy::Full => 0.0,
                    })
                    .sum::<f64>();
            let over = ps
                .iter()
                .map(|p| match p {
                    CheckpointPolicy::SequenceAware => overhead(&sa),
                    CheckpointPolicy::None => overhead(&none),
                    CheckpointPolicy::Full => overhead(&full),
                })
                .fold(0.0, f64::max);
            held + over
        };
        let mut raised = Vec::new();
        for target in [CheckpointPolicy::SequenceAware, CheckpointPolicy::None] {
            for i in 0..policies.len() {
                let mut trial = policies.clone();
                trial[i] = target;
                if predict(&trial) <= budget as f64 {
                    policies = trial;
                    raised.push(i);
                }
            }
        }
        // The sum above estimates a mix from the uniform policies; the mix's own traced probe steps are what
        // counts: while they predict more than the budget, the last block raised goes back one level.
        loop {
            self.set_region_policies(&policies.iter().copied().map(Some).collect::<Vec<_>>());
            let Some(i) = raised.last().copied() else { break };
            if self.probe_fit(None, n)?.peak_at(n) <= budget as f64 {
                break;
            }
            raised.pop();
            policies[i] = match policies[i] {
                CheckpointPolicy::None => CheckpointPolicy::SequenceAware,
                _ => CheckpointPolicy::Full,
            };
        }
        Ok(())
    }

    /// The plan at `n` tokens. Collective: it runs two (or a few more) short probe steps.
    pub fn plan(&mut self, n: usize) -> Result<Plan, CompileError> {
        let region = self.region_policies();
        let policies: Vec<CheckpointPolicy> = region.iter().map(|p| p.unwrap_or(self.tape_policy())).collect();
        let mut distinct = policies.clone();
        distinct.dedup();
        let m = if distinct.len() <= 1 {
            self.measure_policy(distinct.first().copied().unwrap_or(self.tape_policy()), n)?
        } else {
            // Mixed policies: measure the mix as it stands (probes use the region policies).
            self.probe_fit(None, n)?
        };
        let (held, peak, slope) = (m.after_forward.at(n), m.peak_at(n), m.after_forward.b);
        let d = self.model.dims();
        let p = self.sp.size();
        let n_loc = self.padded_len(n) as f64 / p as f64;
        let (dq, dkv) = ((d.heads * d.head_dim) as f64, (d.kv_heads * d.head_dim) as f64);
        let layer_params = d.hidden as f64 * (2.0 * dq + 2.0 * dkv) + 3.0 * (d.hidden * d.intermediate) as f64;
        let mut flops = Flops::default();
        for pol in &policies {
            let lin = 2.0 * n_loc * layer_params;
            // Causal attention forward: half of 4 * N * n_loc * d_q (fewer under a sliding window: each query
            // sees at most w + 1 keys); backward 2.5x forward.
            let attn = 2.0 * n as f64 * n_loc * dq * window_fraction(n, self.max_attention_distance);
            let (lin_recompute, attn_recompute) = match pol {
                CheckpointPolicy::None => (0.0, 0.0),
                CheckpointPolicy::SequenceAware => (lin, 0.0),
                CheckpointPolicy::Full => (lin, attn),
            };
            flops.linear += 3.0 * lin + lin_recompute;
            flops.attention += 3.5 * attn + attn_recompute;
        }
        flops.linear += 3.0 * 2.0 * n_loc * (d.hidden * d.vocab) as f64;
        let s = self.resolved.strategy;
        // Activations travel in the compute dtype, the LSE, Ring's dK/dV accumulators and the gradients in f32
        // (f64 for f64); the step runs at the padded length.
        let elem = self.dtype.size_in_bytes();
        let acc_elem = Precision::float(self.dtype).reduce().size_in_bytes();
        let n_pad = self.padded_len(n);
        let attn_comm: f64 = if p > 1 {
            policies.iter().map(|&pol| comm_bytes_per_layer_step(s, &d, n_pad, p, pol, elem, acc_elem)).sum()
        } else {
            0.0
        };
        // The gradient reduction as `reduce_grads` and the sharded parameters make it, the gathers of sharded
        // weights, and the two one-element f64 all-reduces of the loss (valid-token count and loss), with this
        // rank's share of each, over the world.
        let (w, rank) = (self.world.size(), self.world.rank());
        let grad_comm: u64 = if w > 1 {
            self.model_state_comm_bytes() + 2 * all_reduce_bytes(1, w, rank, DType::F64.size_in_bytes())
        } else {
            0
        };
        Ok(Plan {
            n,
            p,
            policies,
            bytes_per_token_per_layer: slope * p as f64 / d.layers.max(1) as f64,
            predicted_after_forward: held,
            predicted_peak: peak,
            probes: m.probes,
            flops,
            attention_comm_bytes: attn_comm,
            comm_bytes: attn_comm + grad_comm as f64,
        })
    }

    /// Bytes this rank sends per step to reduce the gradients and, at `Parameters`, to gather the weights
    /// (nothing on one rank): `None` all-reduces each gradient bucket; `Optimizer` reduce-scatters each bucket
    /// (`(W-1)/W` of it); `Gradients` reduce-scatters each parameter's gradient once per use; `Parameters` also
    /// all-gathers each weight for each use, once more for the weights of a checkpointed block, whose backward
    /// gathers them again. One use per parameter is counted, and an embedding tied to the LM head twice.
    pub fn model_state_comm_bytes(&self) -> u64 {
        let (w, rank) = (self.world.size(), self.world.rank());
        if w == 1 {
            return 0;
        }
        let params = autosp_core::module::trainable_params(&self.model);
        // Gradients travel in the reduction's wire dtype (bf16 for f32 gradients under `--reduce-dtype bf16`).
        let wire_of = |p: &Param| wire_dtype(Precision::float(p.tensor().dtype()).reduce(), self.reduction.dtype);
        let level = self.sharding();
        if level <= ShardLevel::Optimizer {
            return grad_buckets(&params, self.reduction.bucket_elems())
                .into_iter()
                .map(|bucket| {
                    let size = wire_of(bucket[0]).size_in_bytes();
                    match level {
                        ShardLevel::None => {
                            let elems: usize = bucket.iter().map(|x| x.shape().elem_count()).sum();
                            all_reduce_bytes(elems, w, rank, size)
                        }
                        _ => {
                            let chunks: usize = bucket.iter().map(|x| x.shard().map_or(0, |s| s.layout.chunk)).sum();
                            ((w - 1) * chunks * size) as u64
                        }
                    }
                })
                .sum();
        }
        let uses = self.param_uses();
        params
            .iter()
            .map(|p| {
                let Some(s) = p.shard() else { return 0 };
                let (n_uses, in_block) = uses.get(&p.id()).copied().unwrap_or((1, false));
                let scatter = (w - 1) * s.layout.chunk * wire_of(p).size_in_bytes();
                let gathers = if level == ShardLevel::Parameters { n_uses + usize::from(in_block) } else { 0 };
                let gather = (w - 1) * s.layout.chunk * p.tensor().dtype().size_in_bytes();
                (n_uses * scatter + gathers * gather) as u64
            })
            .sum()
    }

    /// Per parameter: how many times a step uses it (2 for an embedding tied to the LM head, else 1) and
    /// whether it belongs to a checkpointed block.
    fn param_uses(&self) -> std::collections::HashMap<autosp_core::ParamId, (usize, bool)> {
        let mut uses = std::collections::HashMap::new();
        for p in autosp_core::module::all_params(&self.model) {
            uses.insert(p.id(), (1, self.counts.in_block.contains(&p.id())));
        }
        if let Some(tied) = self.counts.tied {
            if let Some(u) = uses.get_mut(&tied) {
                u.0 = 2;
            }
        }
        uses
    }

    /// The rewritten module tree with the strategy, policies and the plan at `n` tokens. Collective (probes).
    pub fn explain(&mut self, n: usize) -> Result<String, CompileError> {
        let plan = self.plan(n)?;
        let strategy = match self.resolved.strategy {
            Strategy::Hybrid { ulysses } => format!("Hybrid (Ulysses {ulysses} x Ring {})", plan.p / ulysses),
            s => format!("{s:?}"),
        };
        let gib = |b: f64| b / (1u64 << 30) as f64;
        let mut out = format!(
            "autosp plan: P = {}, strategy {strategy} ({}), layout {:?}\n",
            plan.p,
            self.resolved.reason,
            self.layout()
        );
        out.push_str(&format!(
            "mesh: {} ({} ranks; each replica trains its own rows of the batch, its {} ranks split each sequence)\n",
            self.mesh,
            self.world.size(),
            self.mesh.sequence
        ));
        out.push_str(&format!(
            "model states: sharded at `{}` ({}); {}\n",
            self.sharding(),
            self.sharding_reason(),
            self.model_state_bytes()
        ));
        out.push_str(&format!("checkpointing: {:?}\n", self.checkpoint));
        if let Some(w) = self.max_attention_distance {
            out.push_str(&format!(
                "attention window: each token sees the tokens at most {w} positions before it (out-of-window tiles \
                 and Ring blocks skipped)\n"
            ));
        }
        out.push_str(&format!(
            "compute dtype: {}; LSE, loss, gradient all-reduce, master weights and optimizer moments: {}\n",
            self.dtype.as_str(),
            Precision::float(self.dtype).reduce().as_str()
        ));
        let blocks: Vec<String> = plan.policies.iter().enumerate().map(|(i, p)| format!("{i}: {p:?}")).collect();
        out.push_str(&format!("policy per block: {}\n", blocks.join(", ")));
        out.push_str(&autosp_core::module::describe_tree(&mut self.model));
        out.push_str(&format!(
            "at N = {}{}: tape {:.0} bytes per token per layer; predicted per rank: {:.3} GiB after forward, \
             {:.3} GiB peak ({:.0} bytes; fitted through probe steps of {} and {} tokens)\n",
            n,
            if self.mesh.data > 1 {
                format!(" tokens per sequence, one sequence per replica ({} replicas)", self.mesh.data)
            } else {
                String::new()
            },
            plan.bytes_per_token_per_layer,
            gib(plan.predicted_after_forward),
            gib(plan.predicted_peak),
            plan.predicted_peak,
            plan.probes.0,
            plan.probes.1
        ));
        out.push_str(&format!(
            "FLOPs per step per rank: attention {:.3e}, linear {:.3e}; communication {:.3e} bytes per rank per step \
             ({:.3e} in attention: forward, backward and Full's one replay; the rest gradient and loss all-reduces)\n",
            plan.flops.attention, plan.flops.linear, plan.comm_bytes, plan.attention_comm_bytes
        ));
        Ok(out)
    }
}
