//! The module tree. Models are built from modules that list their named children, so the compile step can
//! walk any model — a Llama from autosp-models or a user's own — fill its attention slots and switch on its
//! checkpoint regions without touching the model's code.
//!
//! Two slots carry the rewrite: an [`AttentionSlot`] (which attention runs: naive, flash, Ulysses, Ring) and a
//! [`RegionSlot`] (whether a repeated block runs inside a checkpoint region).

use std::sync::Arc;

use crate::ops::attention::{naive_attention, AttentionSpec};
use candle_core::Tensor;

use crate::{CheckpointPolicy, Op, Param, Result, Tape, Value};

/// An attention implementation. `q: [b, nq, h, d]`, `k, v: [b, nk, h_kv, d]` -> `(o: [b, nq, h, d],
/// lse: [b, h, nq])`. Sequence-parallel implementations receive the local shard and return the local shard.
pub trait Attention: std::fmt::Debug + Send + Sync {
    /// A short description for `explain()`, e.g. `ulysses(p=4) > local`.
    fn describe(&self) -> String;

    /// Attention over the given queries, keys and values.
    fn forward(&self, tape: &Tape, q: &Value, k: &Value, v: &Value, spec: &AttentionSpec) -> Result<(Value, Value)>;

    /// The attention output alone, for callers that do not use the LSE (the model's attention layer).
    /// The default runs [`forward`](Self::forward) and drops the LSE; an implementation that cannot produce
    /// the LSE on some device (CUDA flash attention) overrides this.
    fn forward_output(&self, tape: &Tape, q: &Value, k: &Value, v: &Value, spec: &AttentionSpec) -> Result<Value> {
        Ok(self.forward(tape, q, k, v, spec)?.0)
    }

    /// This attention as one tape op of kind attention, when it is one: inputs `q, k, v`, outputs `o, lse`,
    /// and a backward that reads exactly those five. A wrapper that moves data around its inner attention
    /// (Ulysses) runs it inside an op of its own, so that checkpointing keeps only the wrapper's inputs and
    /// outputs. The default is `None`: the wrapper records its steps one by one.
    fn as_op(&self, _spec: &AttentionSpec) -> Option<Arc<dyn Op>> {
        None
    }
}

/// The naive reference attention (materialises the scores): correct everywhere, fast nowhere.
#[derive(Debug, Default, Clone, Copy)]
pub struct NaiveAttention;

impl Attention for NaiveAttention {
    fn describe(&self) -> String {
        "naive".into()
    }

    fn forward(&self, tape: &Tape, q: &Value, k: &Value, v: &Value, spec: &AttentionSpec) -> Result<(Value, Value)> {
        naive_attention(tape, q, k, v, spec.clone())
    }

    fn as_op(&self, spec: &AttentionSpec) -> Option<Arc<dyn Op>> {
        Some(Arc::new(crate::ops::attention::NaiveAttention { spec: spec.clone() }))
    }
}

/// Where a model's attention goes; the compile step replaces what it holds. The slot may also carry a
/// sliding window ([`set_max_distance`](Self::set_max_distance)) that it applies to every spec it runs, on top
/// of the model's own mask: the compile step sets it from `CompileConfig::max_attention_distance`, and
/// [`set_max_attention_distance`] sets it on a whole model.
#[derive(Clone, Debug)]
pub struct AttentionSlot {
    imp: Arc<dyn Attention>,
    max_distance: Option<usize>,
}

impl AttentionSlot {
    /// A slot holding `imp`, with no window of its own.
    pub fn new(imp: Arc<dyn Attention>) -> Self {
        Self { imp, max_distance: None }
    }

    /// Limits every attention this slot runs to keys at most `distance` positions from the query
    /// ([`AttentionSpec::max_distance`]; the smaller one wins when the model's spec has a window too).
    /// `None` adds no limit.
    pub fn set_max_distance(&mut self, distance: Option<usize>) {
        self.max_distance = distance;
    }

    /// The window this slot adds (see [`set_max_distance`](Self::set_max_distance)).
    pub fn max_distance(&self) -> Option<usize> {
        self.max_distance
    }

    /// `spec` with this slot's window applied.
    fn spec(&self, spec: &AttentionSpec) -> AttentionSpec {
        spec.clone().narrowed(self.max_distance)
    }

    /// Replaces the implementation.
    pub fn set(&mut self, imp: Arc<dyn Attention>) {
        self.imp = imp;
    }

    /// The implementation.
    pub fn get(&self) -> &Arc<dyn Attention> {
        &self.imp
    }

    /// Runs the held attention (shapes as [`Attention::forward`]).
    pub fn forward(
        &self,
        tape: &Tape,
        q: &Value,
        k: &Value,
        v: &Value,
        spec: &AttentionSpec,
    ) -> Result<(Value, Value)> {
        self.imp.forward(tape, q, k, v, &self.spec(spec))
    }

    /// Runs the held attention for its output alone (see [`Attention::forward_output`]).
    pub fn forward_output(&self, tape: &Tape, q: &Value, k: &Value, v: &Value, spec: &AttentionSpec) -> Result<Value> {
        self.imp.forward_output(tape, q, k, v, &self.spec(spec))
    }
}

/// Whether a repeated block runs inside a checkpoint region, and under which policy (`None`: the tape's);
/// the compile step switches it on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionSlot {
    enabled: bool,
    policy: Option<CheckpointPolicy>,
}

impl RegionSlot {
    /// Turns the region on or off.
    pub fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
    }

    /// Whether the region is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Gives this region its own policy (`None`: the tape's).
    pub fn set_policy(&mut self, policy: Option<CheckpointPolicy>) {
        self.policy = policy;
    }

    /// This region's own policy, if it has one.
    pub fn policy(&self) -> Option<CheckpointPolicy> {
        self.policy
    }

    /// Runs `f`, inside a checkpoint region named `name` when enabled.
    pub fn run<T>(&self, tape: &Tape, name: &str, f: impl FnOnce(&Tape) -> Result<T>) -> Result<T> {
        match (self.enabled, self.policy) {
            (false, _) => f(tape),
            (true, None) => tape.checkpoint(name, f),
            (true, Some(p)) => tape.checkpoint_with(name, p, f),
        }
    }
}

/// The dimensions of a causal language model, for planning memory, FLOPs and communication.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LmDims {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
}

/// A causal language model the compile step can train and run: a module tree plus its loss and logits over a
/// (shard of a) token sequence with an explicit position per token.
pub trait CausalLm: Module {
    /// `(sum of token losses: [], valid count)` for `ids: [b, n]` (u32), `positions: [n]` and
    /// `targets: [b * n]` (i64, -100 ignored).
    fn loss(&self, tape: &Tape, ids: &Tensor, positions: &[usize], targets: &Tensor) -> Result<(Value, usize)>;

    /// Logits `[b, n, vocab]` for `ids: [b, n]` at `positions: [n]`.
    fn logits(&self, tape: &Tape, ids: &Tensor, positions: &[usize]) -> Result<Value>;

    /// Logits `[b, rows.len(), vocab]` of the positions `rows` (indices into `0..n`) only, for `ids: [b, n]` at
    /// `positions: [n]`. Forward only: on an inference tape (the result takes no gradient). Collective where
    /// `logits` is. The default makes every position's logits and picks; a model may make only the rows'.
    fn logits_at(&self, tape: &Tape, ids: &Tensor, positions: &[usize], rows: &[usize]) -> Result<Value> {
        check_logits_at_tape(tape)?;
        let all = self.logits(tape, ids, positions)?.into_tensor();
        let index = rows.iter().map(|&r| r as u32).collect::<Vec<_>>();
        let index = Tensor::from_vec(index, rows.len(), all.device())?;
        Ok(Value::constant(all.index_select(&index, 1)?))
    }

    /// The model's dimensions.
    fn dims(&self) -> LmDims;

    /// Whether the model honours packed documents ([`Tape::set_documents`]): positions restarting at each
    /// document and attention masked to each token's own document. The default is `false`: the compiled
    /// step refuses packed batches for such a model rather than train it across document boundaries.
    fn supports_documents(&self) -> bool {
        false
    }
}

/// [`CausalLm::logits_at`]'s tape check, for every implementation: forward only, on a tape that does not
/// record.
pub fn check_logits_at_tape(tape: &Tape) -> Result<()> {
    if tape.is_recording() {
        return Err(crate::Error::InvalidArgument {
            op: "logits_at",
            msg: "forward only: call it on Tape::inference(), or take `logits` on a recording tape".into(),
        });
    }
    Ok(())
}

/// A node of the module tree.
pub trait Module: Send + Sync {
    /// The module's type, e.g. `LlamaDecoderLayer`.
    fn kind(&self) -> &'static str;

    /// Named children, in order.
    fn children(&self) -> Vec<(String, &dyn Module)> {
        Vec::new()
    }

    /// Named children, mutable, in the same order as [`children`](Self::children).
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        Vec::new()
    }

    /// The module's own parameters (not its children's).
    fn own_params(&self) -> Vec<Param> {
        Vec::new()
    }

    /// The module's attention slot, if it has one.
    fn attention_slot(&mut self) -> Option<&mut AttentionSlot> {
        None
    }

    /// The module's checkpoint-region slot, if it is a repeated block.
    fn region_slot(&mut self) -> Option<&mut RegionSlot> {
        None
    }

    /// The module as a linear layer, if it is one (LoRA adds its adapters there: [`crate::lora`]).
    fn as_linear_mut(&mut self) -> Option<&mut crate::nn::Linear> {
        None
    }

    /// The module as a linear layer, read-only.
    fn as_linear(&self) -> Option<&crate::nn::Linear> {
        None
    }
}

/// Every distinct parameter of `m` and its descendants, depth first, in child order. A parameter shared by
/// several modules (tied weights: one [`Param`] cloned into two places) is listed once, where it is first
/// met, so that gradient reductions and optimisers see it once.
pub fn all_params(m: &dyn Module) -> Vec<Param> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    collect_params(m, &mut seen, &mut out);
    out
}

/// The parameters of `m` that train: [`all_params`] without the frozen ones ([`Param::is_frozen`]: a LoRA
/// model's base weights). Gradients, optimizers and sharding work on these.
pub fn trainable_params(m: &dyn Module) -> Vec<Param> {
    all_params(m).into_iter().filter(|p| !p.is_frozen()).collect()
}

/// Appends the parameters of `m` and its descendants not yet in `seen` (by [`Param::id`]) to `out`.
fn collect_params(m: &dyn Module, seen: &mut std::collections::HashSet<crate::ParamId>, out: &mut Vec<Param>) {
    out.extend(m.own_params().into_iter().filter(|p| seen.insert(p.id())));
    for (_, c) in m.children() {
        collect_params(c, seen, out);
    }
}

/// Calls `f(path, module)` on `m` and every descendant, depth first; paths join child names with `.`.
pub fn visit_mut(m: &mut dyn Module, path: &str, f: &mut dyn FnMut(&str, &mut dyn Module)) {
    f(path, m);
    for (name, c) in m.children_mut() {
        let p = if path.is_empty() { name } else { format!("{path}.{name}") };
        visit_mut(c, &p, f);
    }
}

/// Sets the sliding window of every attention slot in `m` and its descendants
/// ([`AttentionSlot::set_max_distance`]: a query sees keys at most `distance` positions away; `None` removes
/// the slots' windows). Returns the number of slots set.
pub fn set_max_attention_distance(m: &mut dyn Module, distance: Option<usize>) -> usize {
    let mut slots = 0;
    visit_mut(m, "", &mut |_, m| {
        if let Some(s) = m.attention_slot() {
            s.set_max_distance(distance);
            slots += 1;
        }
    });
    slots
}

/// The tree as indented lines `path: Kind [attention: ..] [checkpointed]`, for `explain()`.
pub fn describe_tree(m: &mut dyn Module) -> String {
    let mut out = String::new();
    visit_mut(m, "", &mut |path, m| {
        let depth = if path.is_empty() { 0 } else { path.matches('.').count() + 1 };
        let name = if path.is_empty() { "model" } else { path.rsplit('.').next().unwrap_or(path) };
        let mut line = format!("{}{}: {}", "  ".repeat(depth), name, m.kind());
        if let Some(slot) = m.attention_slot() {
            line.push_str(&format!(" [attention: {}", slot.get().describe()));
            if let Some(w) = slot.max_distance() {
                line.push_str(&format!(", max distance {w}"));
            }
            line.push(']');
        }
        if let Some(r) = m.region_slot() {
            match (r.enabled(), r.policy()) {
                (true, Some(p)) => line.push_str(&format!(" [checkpoint region: {p:?}]")),
                (true, None) => line.push_str(" [checkpoint region]"),
                _ => {}
            }
        }
        out.push_str(&line);
        out.push('\n');
    });
    out
}
