//! `CompileConfig::rope_scaling` for library users: compiling a loaded `LlamaModel` with an extension gives the
//! model that config.json would build with the scaling written in (the same config, the same loss on a sequence
//! past the original window, at P = 1 and 2); a model that is not a `LlamaModel` is refused saying where the
//! scaling goes; a scaling that does not compose with the checkpoint's is refused naming the option.

use autosp::compile::{compile, Checkpointing, CompileConfig, CompileError, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::module::Module;
use autosp_core::{CausalLm, CheckpointPolicy, LmDims, Tape, Value};
use autosp_models::{random_weights, LlamaModel, RopeExtension, RopeScaling, TinySpec, Yarn};
use candle_core::{DType, Device, Tensor};
use std::time::Duration;

/// A tiny Llama with a window of 64 tokens, with `scaling` and `max_position_embeddings` as given.
fn tiny(scaling: Option<RopeScaling>, max_position_embeddings: usize) -> LlamaModel {
    let spec = TinySpec { hidden: 32, intermediate: 64, ..TinySpec::default() };
    let mut config = spec.config();
    let weights = random_weights(&config, 11, DType::F32, &Device::Cpu).unwrap();
    config.rope_scaling = scaling;
    config.max_position_embeddings = max_position_embeddings;
    LlamaModel::from_weights(&config, weights).unwrap()
}

/// The mean loss of 200 ids (past the window of 64) on `p` thread ranks, and rank 0's model config.
fn loss(make: fn() -> LlamaModel, extension: Option<RopeExtension>, p: usize) -> (f64, autosp_models::LlamaConfig) {
    let n = 200;
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % 128).collect();
    let out = run_ranks(p, Duration::from_secs(60), move |pg| -> Result<_, String> {
        let mut cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None));
        if let Some(x) = extension.clone() {
            cfg = cfg.with_rope_scaling(x);
        }
        let c = compile(make(), cfg).map_err(|e| e.to_string())?;
        let ids = Tensor::from_vec(ids.clone(), (1, n), &Device::Cpu).unwrap();
        let (loss, _) = c.eval_loss(&ids, None).map_err(|e| e.to_string())?;
        Ok((loss, c.model().config.clone()))
    });
    out.into_iter().next().unwrap().unwrap().unwrap()
}

#[test]
fn an_extension_gives_the_model_with_the_scaling_in_its_config() {
    let yarn4: RopeExtension = "yarn:4".parse().unwrap();
    let (extended, config) = loss(|| tiny(None, 64), Some(yarn4.clone()), 1);
    assert_eq!(config.rope_scaling, Some(RopeScaling::Yarn(Yarn::new(4.0, 64))));
    assert_eq!(config.max_position_embeddings, 256);
    let (written, _) = loss(|| tiny(Some(RopeScaling::Yarn(Yarn::new(4.0, 64))), 256), None, 1);
    assert_eq!(extended, written, "the extension must build what the scaled config builds");
    let (plain, _) = loss(|| tiny(None, 64), None, 1);
    assert!((plain - extended).abs() > 1e-4 * plain, "yarn:4 must change the loss: {plain} vs {extended}");
    let (two, _) = loss(|| tiny(None, 64), Some(yarn4), 2);
    assert!((two - extended).abs() <= 1e-5 * extended, "P = 2 {two} vs P = 1 {extended}");
}

#[test]
fn an_extension_that_does_not_compose_is_refused() {
    let out = run_ranks(1, Duration::from_secs(60), |pg| {
        let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None))
            .with_rope_scaling("linear:2".parse().unwrap());
        compile(tiny(Some(RopeScaling::Yarn(Yarn::new(4.0, 64))), 256), cfg).err().map(|e| e.to_string())
    });
    let e = out.into_iter().next().unwrap().unwrap().expect("linear on a yarn model must be refused");
    assert!(e.contains("CompileConfig::rope_scaling") && e.contains("already has a yarn scaling"), "{e}");
}

/// A causal LM that is not a `LlamaModel` (one wrapped).
struct Wrapped(LlamaModel);

impl Module for Wrapped {
    fn kind(&self) -> &'static str {
        "Wrapped"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("inner".into(), &self.0)]
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        vec![("inner".into(), &mut self.0)]
    }
}

impl CausalLm for Wrapped {
    fn loss(
        &self,
        tape: &Tape,
        ids: &Tensor,
        positions: &[usize],
        targets: &Tensor,
    ) -> autosp_core::Result<(Value, usize)> {
        CausalLm::loss(&self.0, tape, ids, positions, targets)
    }
    fn logits(&self, tape: &Tape, ids: &Tensor, positions: &[usize]) -> autosp_core::Result<Value> {
        CausalLm::logits(&self.0, tape, ids, positions)
    }
    fn dims(&self) -> LmDims {
        self.0.dims()
    }
}

#[test]
fn a_model_that_is_not_a_llama_model_is_refused_saying_where_the_scaling_goes() {
    let out = run_ranks(1, Duration::from_secs(60), |pg| {
        let cfg = CompileConfig::new(pg, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::None))
            .with_rope_scaling("yarn:2".parse().unwrap());
        match compile(Wrapped(tiny(None, 64)), cfg) {
            Err(e @ CompileError::RopeScalingNotLlama { .. }) => Some(e.to_string()),
            _ => None,
        }
    });
    let e = out.into_iter().next().unwrap().unwrap().expect("a model that is not a LlamaModel must be refused");
    assert!(e.contains("yarn:2") && e.contains("LlamaModel only") && e.contains("model's own config"), "{e}");
}

#[test]
fn a_phi3_model_is_refused_as_transformers_reads_only_longrope_for_it() {
    let spec =
        TinySpec { model_type: autosp_models::ModelType::Phi3, hidden: 32, intermediate: 64, ..TinySpec::default() };
    let config = spec.config();
    let mut model =
        LlamaModel::from_weights(&config, random_weights(&config, 1, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let e = model.extend_rope(&"yarn:2".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("--rope-scaling yarn:2") && e.contains("phi3 model takes only a longrope"), "{e}");
    assert_eq!(model.config, config, "a refused extension leaves the model as it was");
    // `none` on it is allowed (it has no scaling to remove).
    model.extend_rope(&RopeExtension::None).unwrap();
}
