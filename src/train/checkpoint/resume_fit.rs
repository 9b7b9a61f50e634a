//! Whether a run can start, checked by the job before any rank allocates the model (#41): a checkpoint
//! resumed belongs to this model (an adapter's base has the architecture the adapter was trained on; the
//! optimizer state holds this run's trained parameters with their shapes: [`super::resume::check_state`]),
//! and the model states fit: the accounting per rank at the run's sharding level on its mesh
//! ([`model_state_bytes_with`], the gathered weights of `parameters` included, two blocks where the gather
//! prefetch runs ([`gathered_blocks`](crate::compile::gathered_blocks)), activations not: they depend on
//! the sequence and the checkpointing, which `--explain` reports) times the ranks sharing this host's
//! memory, against a memory budget (`--memory-budget`, else the host's available memory).

use std::path::Path;

use autosp_core::module::trainable_params;
use autosp_core::{CausalLm, ShardLevel};
use autosp_models::{LlamaConfig, LlamaModel};
use candle_core::{DType, Device};

use super::model_slices::skeleton;
use super::TrainerState;
use crate::train::lora::LoraRun;

use crate::compile::sharding::{default_level, model_state_bytes_with, ModelStateBytes, ParamCounts};
use crate::train::error::{Result, TrainError};
use crate::train::metrics::mib;

/// The memory the ranks of this host may hold, and where the figure comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Bytes.
    pub bytes: u64,
    /// Where it comes from, for messages (`--memory-budget`, or the host's available memory).
    pub source: &'static str,
}

impl Budget {
    /// `--memory-budget` when given, else the host's available memory (`MemAvailable` of /proc/meminfo);
    /// `None` where neither is known.
    pub fn of(given: Option<u64>) -> Option<Self> {
        match given {
            Some(bytes) => Some(Self { bytes, source: "--memory-budget" }),
            None => host_available().map(|bytes| Self { bytes, source: "the host's available memory (MemAvailable)" }),
        }
    }
}

/// The host's available memory in bytes (`MemAvailable` of /proc/meminfo), where the system says it.
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The ranks of this job on this host: all of them for thread ranks; under MPI the launcher's count of the
/// host's ranks (`OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS`), else 1.
pub fn ranks_on_host(world: usize, threads: bool) -> usize {
    if threads {
        return world;
    }
    crate::device::local_size().unwrap_or(1)
}

/// The architecture fields in which `run` (the model this run loads) differs from `trained` (the one the
/// checkpoint was trained on), as `field trained -> run`.
pub fn architecture_changes(trained: &LlamaConfig, run: &LlamaConfig) -> Vec<String> {
    let fields: [(&str, String, String); 9] = [
        ("model_type", trained.model_type.as_str().into(), run.model_type.as_str().into()),
        ("hidden_size", trained.hidden_size.to_string(), run.hidden_size.to_string()),
        ("intermediate_size", trained.intermediate_size.to_string(), run.intermediate_size.to_string()),
        ("num_hidden_layers", trained.num_hidden_layers.to_string(), run.num_hidden_layers.to_string()),
        ("num_attention_heads", trained.num_attention_heads.to_string(), run.num_attention_heads.to_string()),
        ("num_key_value_heads", trained.num_key_value_heads.to_string(), run.num_key_value_heads.to_string()),
        ("head_dim", trained.head_dim.to_string(), run.head_dim.to_string()),
        ("vocab_size", trained.vocab_size.to_string(), run.vocab_size.to_string()),
        ("tie_word_embeddings", trained.tie_word_embeddings.to_string(), run.tie_word_embeddings.to_string()),
    ];
    fields.into_iter().filter(|(_, a, b)| a != b).map(|(f, a, b)| format!("{f} {a} -> {b}")).collect()
}

/// The job's checks before any rank allocates (see the module doc), on a skeleton of `config` in `dtype`
/// with `lora`'s adapters: when `resume` is given, its adapter's base architecture against `config` and its
/// optimizer state's headers against the parameters this run trains; when resuming or `memory_budget` is
/// given, the model states of `world` ranks (`threads`: threads of this process) at `level` against the
/// budget ([`check_fits`], `prefetch`: the gather prefetch asked for, `--no-prefetch-gathers` not given).
#[allow(clippy::too_many_arguments)]
pub fn check_run(
    config: &LlamaConfig,
    dtype: DType,
    lora: Option<&LoraRun>,
    resume: Option<(&Path, &TrainerState)>,
    level: Option<ShardLevel>,
    world: usize,
    threads: bool,
    prefetch: bool,
    memory_budget: Option<u64>,
) -> Result<()> {
    if let Some((dir, _)) = resume {
        let trained = match autosp_models::is_adapter(dir) {
            true => crate::train::lora::written_base_config(dir)?,
            false => None,
        };
        let changes = trained.map(|t| architecture_changes(&t, config)).unwrap_or_default();
        if !changes.is_empty() {
            return Err(TrainError::Config(format!(
                "--resume {}: the adapter was trained on another model ({}); resume it with the base it was trained \
                 on (--model)",
                dir.display(),
                changes.join(", ")
            )));
        }
    }
    let mut model = skeleton(config, dtype, &Device::Cpu)?;
    if let Some(l) = lora {
        l.apply(&mut model)?;
    }
    if let Some((dir, state)) = resume {
        super::check_state(dir, state, config, &trainable_params(&model))?;
    }
    if resume.is_some() || memory_budget.is_some() {
        if let Some(budget) = Budget::of(memory_budget) {
            let what = match resume {
                Some((dir, _)) => format!("--resume {}", dir.display()),
                None => "this run".to_string(),
            };
            check_fits(&what, &mut model, dtype, level, world, threads, prefetch, &budget)?;
        }
    }
    Ok(())
}

/// The model states of `model` (a skeleton will do: only shapes and which parameters train are read) in
/// `dtype` at `level` (`None`: the level a compile would pick) over `world` ranks, of which `here` share
/// this host, against `budget`: refused when they exceed it, naming the bytes, the budget's source and the
/// sharding level or rank count that would fit. `what` starts the message (`--resume DIR`). `prefetch`: the
/// gather prefetch is asked for, so `parameters` holds two blocks' gathered weights over W > 1
/// ([`gathered_blocks`](crate::compile::gathered_blocks); the check runs before the process group exists, and
/// thread ranks and MPI both have the concurrent handles the prefetch needs).
#[allow(clippy::too_many_arguments)]
pub fn check_fits(
    what: &str,
    model: &mut LlamaModel,
    dtype: DType,
    level: Option<ShardLevel>,
    world: usize,
    threads: bool,
    prefetch: bool,
    budget: &Budget,
) -> Result<()> {
    let dims = model.dims();
    let counts = ParamCounts::of(model, &dims);
    let here = ranks_on_host(world, threads);
    let level = level.unwrap_or_else(|| default_level(&counts, dtype, world, threads, prefetch).0);
    let host = |level: ShardLevel, world: usize| -> (ModelStateBytes, u64) {
        let rank = model_state_bytes_with(&counts, dtype, level, world, prefetch);
        // Thread ranks below `parameters` hold one copy of the weights between them (module doc of sharding).
        let shared = threads && level != ShardLevel::Parameters && world > 1;
        let bytes = match shared {
            true => rank.params + (rank.total() - rank.params) * here,
            false => rank.total() * here,
        };
        (rank, bytes as u64)
    };
    let (rank, need) = host(level, world);
    if need <= budget.bytes {
        return Ok(());
    }
    // In MiB, as the accounting (`rank`) prints its figures.
    let shown = |b: u64| format!("{:.1} MiB", mib(b as f64));
    let fix = match ShardLevel::ALL.into_iter().filter(|&l| l > level).find(|&l| host(l, world).1 <= budget.bytes) {
        Some(l) => format!("resume with --shard {l} ({} on this host)", shown(host(l, world).1)),
        None => {
            // More ranks, as many on each host as here: each holds less.
            match (world + 1..=world.max(1) * 1024).find(|&w| host(ShardLevel::Parameters, w).1 <= budget.bytes) {
                Some(w) => format!(
                    "resume with --shard parameters over {w} ranks or more ({here} a host, on more hosts: --dp/--sp)"
                ),
                None => "resume on hosts with more memory".into(),
            }
        }
    };
    Err(TrainError::Config(format!(
        "{what}: the model states need {rank} at --shard {level} over {world} rank(s), {} for the {here} rank(s) on \
         this host (activations come on top), but {} is {}: {fix}, or give a larger --memory-budget if the memory is \
         there",
        shown(need),
        budget.source,
        shown(budget.bytes),
    )))
}
