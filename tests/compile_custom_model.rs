//! A small transformer defined here, not in autosp-models, built from autosp modules: compiled for P ranks
//! with each strategy and policy it trains exactly like the uncompiled model on one rank, with no change to
//! its code. Tolerances (f32): Ulysses moves data without arithmetic, so only the attention's summation order
//! differs (1e-5 relative to the largest gradient); Ring merges partial softmaxes (1e-5 * P). A model whose
//! head is tied to its embedding (one `Param` in two modules) trains the same way at P = 2 as on one rank,
//! and one optimiser step moves the tied weight once.

use std::sync::Arc;

mod common;

use autosp::compile::{compile, Checkpointing, CompileConfig, CompileError, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::gradcheck::probe;
use autosp_core::module::{all_params, Module};
use autosp_core::nn::{Embedding, Linear, RmsNorm};
use autosp_core::ops::{self, AttentionSpec};
use autosp_core::optim::{Optimizer, Sgd};
use autosp_core::{AttentionSlot, CausalLm, CheckpointPolicy, LmDims, Param, RegionSlot, Result, Tape, Value};
use candle_core::{DType, Device, Tensor};

const HIDDEN: usize = 32;
const HEADS: usize = 4;
const HD: usize = 8;
const VOCAB: usize = 40;

fn param(name: &str, shape: &[usize], seed: u64, scale: f64) -> Param {
    Param::new(
        name,
        probe(shape, seed, &Device::Cpu).unwrap().affine(scale, 0.0).unwrap().to_dtype(DType::F32).unwrap(),
    )
}

fn norm(name: &str, seed: u64) -> RmsNorm {
    let w = probe(&[HIDDEN], seed, &Device::Cpu).unwrap().affine(0.1, 1.0).unwrap().to_dtype(DType::F32).unwrap();
    RmsNorm::new(Param::new(name, w), 1e-5)
}

struct Layer {
    norm: RmsNorm,
    qkv: Linear,
    out: Linear,
    attention: AttentionSlot,
    region: RegionSlot,
    kv_heads: usize,
}

impl Module for Layer {
    fn kind(&self) -> &'static str {
        "TinyLayer"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("norm".into(), &self.norm), ("qkv".into(), &self.qkv), ("out".into(), &self.out)]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![("norm".into(), &mut self.norm), ("qkv".into(), &mut self.qkv), ("out".into(), &mut self.out)]
    }
    fn attention_slot(&mut self) -> Option<&mut AttentionSlot> {
        Some(&mut self.attention)
    }
    fn region_slot(&mut self) -> Option<&mut RegionSlot> {
        Some(&mut self.region)
    }
}

struct Tiny {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    head: Linear,
    kv_heads: usize,
}

impl Tiny {
    fn new(kv_heads: usize) -> Self {
        let layers = (0..2)
            .map(|i| {
                let s = 100 * (i as u64 + 1);
                Layer {
                    norm: norm("norm", s),
                    qkv: Linear::new(param("qkv", &[(HEADS + 2 * kv_heads) * HD, HIDDEN], s + 1, 0.3), None),
                    out: Linear::new(param("out", &[HIDDEN, HEADS * HD], s + 2, 0.3), None),
                    attention: AttentionSlot::new(Arc::new(autosp_core::module::NaiveAttention)),
                    region: RegionSlot::default(),
                    kv_heads,
                }
            })
            .collect();
        Self {
            embed: Embedding::new(param("embed", &[VOCAB, HIDDEN], 1, 1.0)),
            layers,
            norm: norm("final_norm", 2),
            head: Linear::new(param("head", &[VOCAB, HIDDEN], 3, 0.3), None),
            kv_heads,
        }
    }

    /// The same model with the output head tied to the embedding: one [`Param`] in two modules.
    fn tied(kv_heads: usize) -> Self {
        let mut m = Self::new(kv_heads);
        m.head.weight = m.embed.table.clone();
        m
    }

    fn hidden(&self, t: &Tape, ids: &Tensor, positions: &[usize]) -> Result<Value> {
        let (b, n) = ids.dims2()?;
        let inv = ops::rope::default_inv_freq(HD, 10000.0);
        let (cos, sin) = ops::rope_tables(positions, &inv, DType::F32, &Device::Cpu)?;
        let (cos, sin) = (t.constant(cos), t.constant(sin));
        let mut x = self.embed.forward(t, &t.constant(ids.clone()))?;
        for (i, l) in self.layers.iter().enumerate() {
            x = l.region.run(t, &format!("layers.{i}"), |t| {
                let h = l.norm.forward(t, &x)?;
                let qkv = l.qkv.forward(t, &h)?;
                let q = ops::reshape(t, &ops::narrow(t, &qkv, 2, 0, HEADS * HD)?, (b, n, HEADS, HD))?;
                let k =
                    ops::reshape(t, &ops::narrow(t, &qkv, 2, HEADS * HD, l.kv_heads * HD)?, (b, n, l.kv_heads, HD))?;
                let v = ops::narrow(t, &qkv, 2, (HEADS + l.kv_heads) * HD, l.kv_heads * HD)?;
                let v = ops::reshape(t, &ops::contiguous(t, &v)?, (b, n, l.kv_heads, HD))?;
                let q = ops::rope(t, &ops::contiguous(t, &q)?, &cos, &sin)?;
                let k = ops::rope(t, &ops::contiguous(t, &k)?, &cos, &sin)?;
                let (a, _) = l.attention.forward(t, &q, &k, &v, &AttentionSpec::causal())?;
                let a = l.out.forward(t, &ops::reshape(t, &a, (b, n, HEADS * HD))?)?;
                ops::add(t, &x, &a)
            })?;
        }
        self.norm.forward(t, &x)
    }
}

impl Module for Tiny {
    fn kind(&self) -> &'static str {
        "Tiny"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> = vec![("embed".into(), &self.embed)];
        for (i, l) in self.layers.iter().enumerate() {
            c.push((format!("layers.{i}"), l));
        }
        c.push(("norm".into(), &self.norm));
        c.push(("head".into(), &self.head));
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> = vec![("embed".into(), &mut self.embed)];
        for (i, l) in self.layers.iter_mut().enumerate() {
            c.push((format!("layers.{i}"), l));
        }
        c.push(("norm".into(), &mut self.norm));
        c.push(("head".into(), &mut self.head));
        c
    }
}

impl CausalLm for Tiny {
    fn loss(&self, t: &Tape, ids: &Tensor, positions: &[usize], targets: &Tensor) -> Result<(Value, usize)> {
        let h = self.hidden(t, ids, positions)?;
        let logits = self.head.forward(t, &h)?;
        let logits = ops::reshape(t, &logits, (targets.elem_count(), VOCAB))?;
        ops::cross_entropy(t, &logits, &t.constant(targets.clone()))
    }
    fn logits(&self, t: &Tape, ids: &Tensor, positions: &[usize]) -> Result<Value> {
        let h = self.hidden(t, ids, positions)?;
        self.head.forward(t, &h)
    }
    fn dims(&self) -> LmDims {
        LmDims {
            layers: self.layers.len(),
            hidden: HIDDEN,
            intermediate: 0,
            heads: HEADS,
            kv_heads: self.kv_heads,
            head_dim: HD,
            vocab: VOCAB,
        }
    }
}

#[test]
fn compiled_custom_model_matches_single_rank() {
    // n = 45: not divisible by P or 2P, so every layout pads.
    let n = 45;
    for kv in [2, 1] {
        let want = common::reference(Tiny::new(kv), n);
        for p in [1, 2, 4] {
            for s in common::strategies(p) {
                for policy in [CheckpointPolicy::None, CheckpointPolicy::Full, CheckpointPolicy::SequenceAware] {
                    let got = common::compiled(move || Tiny::new(kv), p, n, s, policy);
                    let what = format!("P={p} kv={kv} {s:?} {policy:?}");
                    common::assert_close(&what, &got, &want, common::tolerance(s, p));
                }
            }
        }
    }
}

#[test]
fn impossible_requests_fail_before_any_step() {
    let out = run_ranks(4, std::time::Duration::from_secs(10), |pg| {
        // 4 heads, 3 kv heads: Ulysses cannot split over 4.
        let cfg = CompileConfig::new(pg, Strategy::Ulysses, Checkpointing::Policy(CheckpointPolicy::None));
        match compile(Tiny::new(3), cfg) {
            Err(e @ CompileError::Infeasible { .. }) => Ok(e.to_string()),
            Err(e) => Err(format!("wrong error: {e}")),
            Ok(_) => Err("compiled".to_string()),
        }
    });
    for r in out {
        let msg = r.unwrap().unwrap();
        assert!(msg.contains("P = 4") && msg.contains("Ring"), "{msg}");
    }
    let out = run_ranks(1, std::time::Duration::from_secs(30), |pg| {
        let mut cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Budget(1000));
        cfg.seq_len = Some(4096);
        compile(Tiny::new(2), cfg).err().map(|e| e.to_string())
    });
    let msg = out.into_iter().next().unwrap().unwrap().expect("a 1000-byte budget must be refused");
    assert!(msg.contains("budget") && msg.contains("Full"), "{msg}");
    let out = run_ranks(1, std::time::Duration::from_secs(10), |pg| {
        let mut cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None));
        cfg.dtype = DType::BF16;
        compile(Tiny::new(2), cfg).err().map(|e| e.to_string())
    });
    let msg = out.into_iter().next().unwrap().unwrap().expect("an f32 model compiled as bf16 must be refused");
    assert!(msg.contains("F32") && msg.contains("BF16"), "{msg}");
}

#[test]
fn tied_weights_train_the_same_at_p2_as_on_one_rank() {
    // The tied parameter is listed once: Tiny has 1 + 2 * 3 + 1 + 1 parameters, the tied one 1 fewer.
    assert_eq!(all_params(&Tiny::tied(2)).len(), all_params(&Tiny::new(2)).len() - 1);
    let n = 45;
    let want = common::reference(Tiny::tied(2), n);
    for s in common::strategies(2) {
        let got = common::compiled(|| Tiny::tied(2), 2, n, s, CheckpointPolicy::None);
        common::assert_close(&format!("tied P=2 {s:?}"), &got, &want, common::tolerance(s, 2));
    }

    // One SGD step (no momentum, no decay) moves the tied weight by exactly -lr * its summed gradient, once.
    let lr = 0.5;
    let out = run_ranks(2, std::time::Duration::from_secs(60), move |pg| {
        let cfg = CompileConfig::new(pg, Strategy::Ring, Checkpointing::Policy(CheckpointPolicy::None));
        let c = compile(Tiny::tied(2), cfg).map_err(|e| e.to_string())?;
        let (ids, labels) = common::batch(n, VOCAB);
        let step = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
        let tied = c.model().embed.table.clone();
        let before = tied.tensor();
        Sgd::new(0.0, 0.0).unwrap().step(&c.params(), &step.grads, lr).unwrap();
        let want = (&before - (step.grads.get(&tied).unwrap() * lr).unwrap()).unwrap();
        let d = (tied.tensor() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let g = step.grads.get(&tied).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        Ok::<(f32, f32), String>((d, g))
    });
    for r in out {
        let (d, g) = r.expect("rank failed").expect("step failed");
        assert!(g > 0.0, "the tied weight must get a gradient");
        // Exact arithmetic up to f32 rounding of one subtraction: far below one extra step (lr * g).
        assert!(
            d <= 1e-6,
            "the tied weight moved by other than one step: off by {d} (one step moves up to {})",
            lr * g as f64
        );
    }
}

/// `CompileConfig::with_lora` adapts any model's linears by module name (here the custom `qkv` and `out`):
/// the base freezes and gets no gradient, the adapters train, and at P = 2 their gradients equal one rank's
/// (Ring's tolerance, DESIGN.md: 1e-5 · P relative).
#[test]
fn compile_adds_lora_adapters_to_a_custom_model() {
    let n = 45;
    let grads_at = |p: usize| {
        let out = run_ranks(p, std::time::Duration::from_secs(60), move |pg| {
            let mut lora = autosp_core::lora::LoraConfig::new(2);
            lora.targets = vec!["qkv".into(), "out".into()];
            let cfg =
                CompileConfig::new(pg, Strategy::Ring, Checkpointing::Policy(CheckpointPolicy::Full)).with_lora(lora);
            let c = compile(Tiny::new(2), cfg).map_err(|e| e.to_string())?;
            let (ids, labels) = common::batch(n, VOCAB);
            // B starts at zero: give it values so that A gets a gradient too.
            for (i, p) in c.params().iter().filter(|p| p.name().contains("lora_B")).enumerate() {
                let t = autosp_core::gradcheck::probe(p.shape().dims(), 50 + i as u64, &candle_core::Device::Cpu);
                p.set((t.unwrap() * 0.1).unwrap().to_dtype(candle_core::DType::F32).unwrap()).unwrap();
            }
            let step = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
            let names: Vec<String> = c.params().iter().map(|p| p.name().to_string()).collect();
            let frozen = all_params(c.model()).iter().filter(|p| p.is_frozen()).count();
            let grads: Vec<(String, Vec<f32>)> = c
                .params()
                .iter()
                .map(|p| (p.name().to_string(), step.grads.get(p).unwrap().flatten_all().unwrap().to_vec1().unwrap()))
                .collect();
            Ok::<_, String>((names, frozen, grads, step.grads.len()))
        });
        out.into_iter().next().unwrap().expect("rank failed").expect("step failed")
    };
    let (names, frozen, one, count) = grads_at(1);
    assert_eq!(names.len(), 2 * 2 * 2, "A and B of qkv and out in 2 layers: {names:?}");
    assert!(names.iter().all(|n| n.contains(".lora_")), "{names:?}");
    assert_eq!(frozen, all_params(&Tiny::new(2)).len(), "every base parameter is frozen");
    assert_eq!(count, names.len(), "only the adapters get gradients");
    let (_, _, two, _) = grads_at(2);
    for ((name, a), (_, b)) in one.iter().zip(&two) {
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(scale > 0.0 && d <= 2e-5 * scale, "{name}: P=1 vs P=2 differ by {d} (max {scale})");
    }
}
