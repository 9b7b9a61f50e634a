//! LoRA runs ([`super::Job`]): the adapter settings from the options (`--lora R[:ALPHA]`, `--lora-targets`,
//! `--lora-dropout`, `--lora-train`), the adapter a run starts from (`--lora-adapter DIR`, or the `--resume`
//! checkpoint's, which holds the adapter and names its base model), and the merged HF checkpoint
//! (`--merge-lora DIR`).
//!
//! Defaults: alpha `2r` (the common choice: the update's scale stays 2 whatever the rank), dropout 0, every
//! projection adapted (QLoRA's finding: adapting all linear layers matches full fine-tuning best), nothing
//! else trained, peak learning rate [`super::options::DEFAULT_LORA_LR`] with `--model`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use autosp_core::lora::LoraConfig;
use autosp_models::{is_adapter, load_adapter, LlamaModel, RopeExtended, RopeExtension};
use candle_core::{DType, Tensor};

use super::error::{Result, TrainError};
use super::options::RunOptions;

/// A LoRA run's adapters: their settings, the tensors they start from, and the base model.
#[derive(Clone, Debug)]
pub struct LoraRun {
    /// Rank, alpha, dropout, targets, what else trains, seed.
    pub config: LoraConfig,
    /// The tensors of the adapter the run starts from, by the model's names; `None`: fresh adapters.
    pub weights: Option<Arc<HashMap<String, Tensor>>>,
    /// The base model named by the adapter's checkpoint (`--resume`) or file (`--lora-adapter`), when the
    /// options do not give `--model`.
    pub base: Option<String>,
}

impl LoraRun {
    /// The LoRA run `o` asks for (`None`: full fine-tuning). `resume`: the checkpoint resumed and its
    /// recorded base model (a LoRA checkpoint holds the adapter). Settings given beside an adapter that brings
    /// its own, or without `--lora`, are refused.
    pub fn from_options(o: &RunOptions, resume: Option<(&Path, Option<&str>)>) -> Result<Option<Self>> {
        let settings = [
            ("--lora-targets", o.lora_targets.is_some()),
            ("--lora-dropout", o.lora_dropout.is_some()),
            ("--lora-train", o.lora_train.is_some()),
        ];
        let adapter_dir =
            match (resume, &o.lora_adapter) {
                (Some(_), Some(_)) => return Err(TrainError::Config(
                    "--lora-adapter with --resume: the checkpoint holds the run's adapter (or its whole model); give \
                     one of them"
                        .into(),
                )),
                (Some((dir, _)), None) => is_adapter(dir).then(|| dir.to_path_buf()),
                (None, a) => a.clone(),
            };
        let asked = Self::asked(o, &settings)?;
        if let Some(dir) = adapter_dir {
            let adapter = load_adapter(&dir).map_err(|cause| TrainError::ModelFile {
                what: format!("loading the LoRA adapter in {}", dir.display()),
                cause: Box::new(cause.into()),
            })?;
            let mut config = adapter.config;
            config.seed = o.seed;
            // Options given beside the adapter must say what it is (a resumed run repeats its command line).
            if let Some(mut asked) = asked {
                asked.seed = o.seed;
                let sorted = |c: &LoraConfig| {
                    let mut c = c.clone();
                    c.targets.sort();
                    c
                };
                if sorted(&asked) != sorted(&config) {
                    return Err(TrainError::Config(format!(
                        "the LoRA options ask for {} but the adapter in {} is {}: leave the LoRA options out (the \
                         adapter brings its own settings) or give its own",
                        describe(&asked),
                        dir.display(),
                        describe(&config)
                    )));
                }
            }
            let recorded = resume.and_then(|(_, base)| base.map(str::to_string));
            return Ok(Some(Self {
                config,
                weights: Some(Arc::new(adapter.weights)),
                base: recorded.or(adapter.base_model),
            }));
        }
        if o.merge_lora.is_some() && asked.is_none() {
            return Err(TrainError::Config(
                "--merge-lora merges LoRA adapters: give --lora R or --lora-adapter DIR too".into(),
            ));
        }
        Ok(asked.map(|config| Self { config, weights: None, base: None }))
    }

    /// The adapters the options ask for (`None` without `--lora`; the other LoRA options without it are
    /// refused).
    fn asked(o: &RunOptions, settings: &[(&str, bool)]) -> Result<Option<LoraConfig>> {
        let Some(spec) = &o.lora else {
            if let Some((flag, _)) = settings.iter().find(|(_, g)| *g) {
                return Err(TrainError::Config(format!(
                    "{flag} sets up LoRA adapters: give --lora R (rank) too, or leave {flag} out"
                )));
            }
            return Ok(None);
        };
        let mut config = LoraConfig::parse(spec)?;
        if let Some(t) = &o.lora_targets {
            config = config.with_targets(t)?;
        }
        if let Some(p) = o.lora_dropout {
            config = config.with_dropout(p)?;
        }
        if let Some(t) = &o.lora_train {
            config = config.with_train(t)?;
        }
        config.seed = o.seed;
        Ok(Some(config))
    }

    /// Adds the adapters to `model` (built from the base weights) and, when the run starts from an adapter,
    /// puts its tensors in. Every rank does the same, before sharding.
    pub fn apply(&self, model: &mut LlamaModel) -> Result<()> {
        model.add_lora(&self.config)?;
        if let Some(w) = &self.weights {
            model.set_adapter_weights(w)?;
        }
        Ok(())
    }
}

/// Writes the merged model: `base` (a directory, hub id or `.gguf`) with the adapter in `adapter_dir` folded
/// in, as an HF checkpoint in `out` (the base's dtype on disk, its tokenizer files beside it), with the
/// positions the adapter was trained with ([`adapter_positions`]: `rope`, else the adapter's base config).
/// The merge is computed in f32 from the files, so it is the same whatever the run's dtype or sharding was.
pub fn merge_into(base: &str, adapter_dir: &Path, out: &Path, rope: Option<&RopeExtension>) -> Result<PathBuf> {
    let adapter = load_adapter(adapter_dir).map_err(|cause| TrainError::ModelFile {
        what: format!("loading the LoRA adapter in {}", adapter_dir.display()),
        cause: Box::new(cause.into()),
    })?;
    let loaded = super::model::load(base, DType::F32)?;
    let tokenizer = loaded.tokenizer_files();
    let mut model = loaded.model;
    adapter_positions(&mut model, adapter_dir, rope)?;
    model.add_lora(&adapter.config)?;
    model.set_adapter_weights(&adapter.weights)?;
    model.merge_lora()?;
    let disk = model.config.torch_dtype.unwrap_or(DType::F32);
    model.save(out, &autosp_models::SaveOptions { dtype: Some(disk), ..Default::default() }).map_err(|cause| {
        TrainError::ModelFile { what: format!("writing the merged model to {}", out.display()), cause: Box::new(cause) }
    })?;
    for (name, text) in tokenizer {
        let path = out.join(name);
        std::fs::write(&path, text).map_err(|e| TrainError::io(format!("writing {}", path.display()), e))?;
    }
    Ok(out.to_path_buf())
}

/// `--steps 0 --lora-adapter DIR --merge-lora OUT`: merges the adapter into its base (`--model`, else the base
/// the adapter names) without training. `None` when `o` does not ask for that.
pub fn merge_only(o: &RunOptions) -> Result<Option<PathBuf>> {
    let (Some(out), Some(dir), 0) = (&o.merge_lora, &o.lora_adapter, o.steps) else { return Ok(None) };
    let base = match &o.model {
        Some(m) => m.clone(),
        None => load_adapter(dir)
            .map_err(|cause| TrainError::ModelFile {
                what: format!("loading the LoRA adapter in {}", dir.display()),
                cause: Box::new(cause.into()),
            })?
            .base_model
            .ok_or_else(|| {
                TrainError::Config(format!("the adapter in {} names no base model: give --model", dir.display()))
            })?,
    };
    merge_into(&base, dir, out, o.rope_scaling.as_ref()).map(Some)
}

/// Gives `model`, an adapter's base loaded from its own files, the positions the adapter in `adapter_dir` was
/// trained with: `rope` applied to it when given (`--rope-scaling`), else those of the adapter's
/// [`BASE_CONFIG`](autosp_models::peft::BASE_CONFIG) when it has one (a LoRA checkpoint of a run that extended
/// the window); returns what `rope` did.
pub fn adapter_positions(
    model: &mut LlamaModel,
    adapter_dir: &Path,
    rope: Option<&RopeExtension>,
) -> Result<Option<RopeExtended>> {
    if let Some(x) = rope {
        return Ok(Some(model.extend_rope(x)?));
    }
    if let Some(c) = written_base_config(adapter_dir)? {
        model.set_positions_from(&c);
    }
    Ok(None)
}

/// The config of the model the adapter in `adapter_dir` was trained on
/// ([`BASE_CONFIG`](autosp_models::peft::BASE_CONFIG)), when it wrote one.
pub(crate) fn written_base_config(adapter_dir: &Path) -> Result<Option<autosp_models::LlamaConfig>> {
    autosp_models::peft::base_config(adapter_dir).map_err(|cause| TrainError::ModelFile {
        what: format!("loading the adapter's base config in {}", adapter_dir.display()),
        cause: Box::new(cause.into()),
    })
}

/// `rank 4, alpha 8, dropout 0, targets q_proj, v_proj, training the norms`, for messages.
pub fn describe(c: &LoraConfig) -> String {
    let mut also = Vec::new();
    if c.train_embed {
        also.push("the embedding");
    }
    if c.train_norm {
        also.push("the norms");
    }
    format!(
        "rank {}, alpha {}, dropout {}, targets {}{}",
        c.r,
        c.alpha,
        c.dropout,
        c.targets.join(", "),
        if also.is_empty() { String::new() } else { format!(", training {}", also.join(" and ")) }
    )
}
