//! LoRA on any model built from [`crate::nn::Linear`]s: [`add_lora`] freezes every parameter and gives the
//! target linears (matched by their module name, `q_proj`, `down_proj`, ..) a trainable [`LoraAdapter`];
//! embeddings and norms may stay trainable too (LongLoRA's context extension trains them). [`merge_lora`] folds
//! the adapters into the base weights; [`lora_config_of`] reads a model's adapters back as a [`LoraConfig`].
//! The base weights sit in the model's dtype with no gradient and no optimizer state; the adapters train with
//! f32 optimizer state (AdamW's masters when the model is bf16/f16).

use crate::module::{visit_mut, Module};
use crate::nn::LoraAdapter;
use crate::{Error, Result};

/// The projections a Llama-family model can adapt, as `--lora-targets` spells them and as PEFT names them.
pub const TARGETS: [(&str, &str); 7] = [
    ("q", "q_proj"),
    ("k", "k_proj"),
    ("v", "v_proj"),
    ("o", "o_proj"),
    ("gate", "gate_proj"),
    ("up", "up_proj"),
    ("down", "down_proj"),
];

/// What LoRA adapts and how.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The rank `r` of every adapter.
    pub r: usize,
    /// `alpha`: the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// Dropout on the adapters' input while training.
    pub dropout: f32,
    /// The linear layers' module names to adapt (`q_proj`, ..).
    pub targets: Vec<String>,
    /// Whether the embedding (and a head tied to it) trains too.
    pub train_embed: bool,
    /// Whether every RMSNorm's weight trains too.
    pub train_norm: bool,
    /// The seed of the adapters' initialisation and dropout masks.
    pub seed: u64,
}

impl LoraConfig {
    /// Rank `r`, `alpha = 2r`, no dropout, every projection adapted, nothing else trained.
    pub fn new(r: usize) -> Self {
        Self {
            r,
            alpha: 2.0 * r as f64,
            dropout: 0.0,
            targets: TARGETS.iter().map(|(_, n)| n.to_string()).collect(),
            train_embed: false,
            train_norm: false,
            seed: 0,
        }
    }

    /// `R` or `R:ALPHA` (`--lora 16`, `--lora 16:32`); alpha defaults to `2R`.
    pub fn parse(spec: &str) -> Result<Self> {
        let bad = |why: &str| Error::InvalidArgument {
            op: "--lora",
            msg: format!("`{spec}`: {why}; give the rank and optionally alpha, e.g. `16` or `16:32`"),
        };
        let (r, alpha) = match spec.split_once(':') {
            Some((r, a)) => (r, Some(a)),
            None => (spec, None),
        };
        let r: usize = r.trim().parse().map_err(|_| bad("the rank is not a whole number"))?;
        if r == 0 {
            return Err(bad("the rank must be at least 1"));
        }
        let mut c = Self::new(r);
        if let Some(a) = alpha {
            c.alpha = a.trim().parse().map_err(|_| bad("alpha is not a number"))?;
            if !(c.alpha.is_finite() && c.alpha > 0.0) {
                return Err(bad("alpha must be a positive number"));
            }
        }
        Ok(c)
    }

    /// Sets the targets from `q,k,v,o,gate,up,down` (short or PEFT names, comma-separated).
    pub fn with_targets(mut self, list: &str) -> Result<Self> {
        let mut targets = Vec::new();
        for t in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let name = TARGETS.iter().find(|(short, full)| t == *short || t == *full).map(|(_, full)| *full);
            let name = name.ok_or_else(|| Error::InvalidArgument {
                op: "--lora-targets",
                msg: format!("`{t}` is not a projection; choose from q, k, v, o, gate, up, down"),
            })?;
            if !targets.iter().any(|x| x == name) {
                targets.push(name.to_string());
            }
        }
        if targets.is_empty() {
            return Err(Error::InvalidArgument {
                op: "--lora-targets",
                msg: "no target given: name at least one of q, k, v, o, gate, up, down".into(),
            });
        }
        self.targets = targets;
        Ok(self)
    }

    /// Sets what else trains from `embed,norm` (either or both; empty for neither).
    pub fn with_train(mut self, list: &str) -> Result<Self> {
        for t in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            match t {
                "embed" => self.train_embed = true,
                "norm" => self.train_norm = true,
                _ => {
                    return Err(Error::InvalidArgument {
                        op: "--lora-train",
                        msg: format!("`{t}` cannot train beside the adapters; choose from embed, norm"),
                    })
                }
            }
        }
        Ok(self)
    }

    /// Sets the dropout probability (`[0, 1)`).
    pub fn with_dropout(mut self, p: f32) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "--lora-dropout",
                msg: format!("{p} is outside [0, 1): give a probability such as 0.05"),
            });
        }
        self.dropout = p;
        Ok(self)
    }
}

/// FNV-1a of a name, to give each adapter its own stream from one seed.
fn name_seed(seed: u64, name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Adds `config`'s adapters to `m`: every parameter is frozen, every linear whose module name is a target gets
/// a fresh adapter (named after its weight: `{prefix}.lora_A.weight`, `{prefix}.lora_B.weight`, in the weight's
/// dtype and device), and the embeddings' and norms' parameters train when `config` says so. Every rank that
/// calls it with the same config gets the same adapters. Returns the number of adapters; fails when `m` has
/// adapters already or none of its linears is a target.
pub fn add_lora(m: &mut dyn Module, config: &LoraConfig) -> Result<usize> {
    if lora_config_of(m).is_some() {
        return Err(Error::InvalidArgument {
            op: "add_lora",
            msg: "the model has LoRA adapters already: merge them first (merge_lora) or train the ones it has".into(),
        });
    }
    let mut added = 0;
    let mut failed = None;
    visit_mut(m, "", &mut |path, module| {
        let name = path.rsplit('.').next().unwrap_or(path);
        let kind = module.kind();
        let trains = (kind == "Embedding" && config.train_embed) || (kind == "RmsNorm" && config.train_norm);
        for p in module.own_params() {
            p.set_frozen(!trains);
        }
        let Some(linear) = module.as_linear_mut() else { return };
        if failed.is_some() || !config.targets.iter().any(|t| t == name) {
            return;
        }
        let w = linear.weight.tensor();
        let dims = linear.weight.shape().dims().to_vec();
        let prefix = linear.weight.name().strip_suffix(".weight").unwrap_or(linear.weight.name()).to_string();
        match LoraAdapter::init(
            &prefix,
            dims[0],
            dims[1],
            config.r,
            config.alpha,
            config.dropout,
            name_seed(config.seed, &prefix),
            w.dtype(),
            w.device(),
        ) {
            Ok(a) => {
                linear.lora = Some(a);
                added += 1;
            }
            Err(e) => failed = Some(e),
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if added == 0 {
        return Err(Error::InvalidArgument {
            op: "add_lora",
            msg: format!("no linear layer of the model is named one of {:?}: choose targets it has", config.targets),
        });
    }
    Ok(added)
}

/// The LoRA settings of a model with adapters (`None` without): rank, alpha and dropout of its first adapter,
/// the module names adapted, and whether embeddings and norms train. `seed` reads 0.
pub fn lora_config_of(m: &dyn Module) -> Option<LoraConfig> {
    let mut found: Option<LoraConfig> = None;
    let (mut embed, mut norm) = (false, false);
    walk(m, "", &mut |path, module| {
        let trainable = module.own_params().iter().any(|p| !p.is_frozen());
        match module.kind() {
            "Embedding" => embed |= trainable,
            "RmsNorm" => norm |= trainable,
            _ => {}
        }
        let name = path.rsplit('.').next().unwrap_or(path).to_string();
        let Some(lora) = module.as_linear().and_then(|l| l.lora.as_ref()) else { return };
        let c = found.get_or_insert_with(|| LoraConfig {
            r: lora.rank(),
            alpha: lora.alpha(),
            dropout: lora.dropout,
            targets: Vec::new(),
            train_embed: false,
            train_norm: false,
            seed: 0,
        });
        if !c.targets.contains(&name) {
            c.targets.push(name);
        }
    });
    found.map(|mut c| {
        c.train_embed = embed;
        c.train_norm = norm;
        c
    })
}

/// Sets every adapter's dropout masks to optimizer step `step` and a micro-batch whose first sequence is
/// `first_sequence` in the step's batch ([`LoraAdapter::seed_batch`]): call it before each micro-batch, so
/// that a resumed run draws the masks an uninterrupted one drew, and every mesh the same ones.
pub fn seed_dropout(m: &dyn Module, step: u64, first_sequence: u64) {
    walk(m, "", &mut |_, module| {
        if let Some(lora) = module.as_linear().and_then(|l| l.lora.as_ref()) {
            lora.seed_batch(step, first_sequence);
        }
    });
}

/// Calls `f(path, module)` on `m` and every descendant, depth first (read-only).
fn walk(m: &dyn Module, path: &str, f: &mut dyn FnMut(&str, &dyn Module)) {
    f(path, m);
    for (name, c) in m.children() {
        let p = if path.is_empty() { name } else { format!("{path}.{name}") };
        walk(c, &p, f);
    }
}

/// Folds every adapter into its base weight (`W += (alpha / r) · B A`, computed in f32 (f64 for an f64
/// model), stored in W's dtype),
/// removes the adapters and makes every parameter trainable again: the model is an ordinary model with the
/// adapted weights. Collective when the adapters are sharded at `Parameters`. Returns the number merged.
pub fn merge_lora(m: &mut dyn Module) -> Result<usize> {
    let mut merged = 0;
    let mut failed = None;
    visit_mut(m, "", &mut |_, module| {
        for p in module.own_params() {
            p.set_frozen(false);
        }
        let Some(linear) = module.as_linear_mut() else { return };
        let Some(lora) = linear.lora.take() else { return };
        if failed.is_some() {
            return;
        }
        let step = || -> Result<()> {
            let w = linear.weight.whole()?;
            let wide = crate::Precision::float(w.dtype()).master();
            let new = (w.to_dtype(wide)? + lora.delta(wide)?)?.to_dtype(w.dtype())?;
            match linear.weight.shard() {
                Some(s) if s.level == crate::ShardLevel::Parameters => linear.weight.set(s.slice(&new)?),
                _ => linear.weight.set(new),
            }
        };
        match step() {
            Ok(()) => merged += 1,
            Err(e) => failed = Some(e),
        }
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(merged),
    }
}
