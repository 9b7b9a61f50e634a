//! `llama_longctx --prompt`: generation from the command line over thread ranks. Reads the prompt (a file or
//! the text itself; `ids:1,2,3` for token ids), tokenizes it with the model's tokenizer (with its chat
//! template under `--chat`), loads the model the training options name (`--model`, `--lora-adapter`,
//! `--resume`, `--rope-scaling`, `--shard`, `--strategy`, `--dtype`), compiles it on `--sp` thread ranks and
//! generates, printing the text as it comes, then a summary and one closing JSON line. Ctrl-C stops the
//! decode (every rank agrees on it, one all-reduce per token) and prints what was generated. One process
//! per rank (`--launcher mpi`) runs [`prepare`] and [`run_rank`] itself.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use autosp_core::comm::{abort_on_error, run_ranks_fallible, ProcessGroup, ReduceOp};
use autosp_core::TrackingAllocator;
use autosp_models::{LlamaModel, Tokenizer};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

use super::{Finish, GenerateConfig, Generated, InferError, Sampling};
use crate::train::{checkpoint, interrupt, lora::LoraRun, model, RunOptions, TrainError};
use crate::{compile, CompileConfig};

/// What to generate (`--prompt`, `--max-new-tokens`, `--temperature`, `--top-p`, `--top-k`, `--chat`).
#[derive(Clone, Debug)]
pub struct PromptOptions {
    /// A file holding the prompt (UTF-8), else the prompt's text; `ids:1,2,3` gives token ids.
    pub prompt: String,
    /// At most this many new tokens.
    pub max_new_tokens: usize,
    /// 0: greedy; above 0: sampling at this temperature.
    pub temperature: f64,
    /// The nucleus (1: off).
    pub top_p: f64,
    /// The `top_k` most likely tokens only (0: off).
    pub top_k: usize,
    /// Wrap the prompt as one user message in the model's chat template.
    pub chat: bool,
}

impl PromptOptions {
    /// The sampling rule these options ask for.
    pub fn sampling(&self) -> Sampling {
        let (temperature, top_p) = (self.temperature, self.top_p);
        match self.top_k {
            _ if temperature == 0.0 => Sampling::Greedy,
            0 => Sampling::TopP { temperature, top_p },
            top_k => Sampling::TopK { temperature, top_k, top_p },
        }
    }
}

/// The prompt's text: the file `prompt` names, else `prompt` itself.
fn prompt_text(prompt: &str) -> Result<String, InferError> {
    let path = Path::new(prompt);
    if !path.is_file() {
        return Ok(prompt.to_string());
    }
    let bytes = std::fs::read(path).map_err(|e| InferError::Prompt(format!("reading {}: {e}", path.display())))?;
    String::from_utf8(bytes).map_err(|e| {
        InferError::Prompt(format!(
            "{} is not UTF-8 text (invalid byte at offset {}): convert it to UTF-8 (e.g. iconv -t UTF-8), or give \
             token ids as --prompt ids:1,2,3",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })
}

/// The model the options name: the checkpoint resumed (a LoRA checkpoint: its base, with its adapter),
/// `--model` (with `--lora-adapter`), or the demo model; and the LoRA run to apply.
fn source(o: &RunOptions) -> Result<(String, Option<LoraRun>), InferError> {
    let resumed = o.resume.as_ref().map(|d| Ok::<_, TrainError>((d.clone(), checkpoint::verify(d)?))).transpose()?;
    let lora = LoraRun::from_options(o, resumed.as_ref().map(|(d, s)| (d.as_path(), s.base_model.as_deref())))?;
    let base = o.model.clone().or_else(|| lora.as_ref().and_then(|l| l.base.clone()));
    let source = match (&resumed, base) {
        (Some((dir, _)), _) if !autosp_models::is_adapter(dir) => dir.display().to_string(),
        (Some((dir, _)), None) => {
            return Err(InferError::Prompt(format!(
                "--resume {}: the LoRA checkpoint does not name its base model; give it with --model",
                dir.display()
            )))
        }
        (_, Some(m)) => m,
        (None, None) => model::tiny_model(o.seed)?.display().to_string(),
    };
    Ok((source, lora))
}

/// The prompt's token ids: `ids:` given, else the text tokenized (as one user message under `chat`).
fn tokenize(text: &str, loaded: &model::Loaded, chat: bool) -> Result<Vec<u32>, InferError> {
    if let Some(ids) = text.trim().strip_prefix("ids:") {
        return ids
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().parse::<u32>().map_err(|e| InferError::Prompt(format!("--prompt ids: `{s}`: {e}"))))
            .collect();
    }
    let Some(tok) = &loaded.tokenizer else {
        return Err(InferError::Prompt(
            "the model has no tokenizer (tokenizer.json): give the prompt as token ids, --prompt ids:1,2,3".into(),
        ));
    };
    let encoded = if chat {
        let Some(template) = &loaded.chat_template else {
            return Err(InferError::Prompt(
                "--chat: the model has no chat template (tokenizer_config.json's chat_template); drop --chat".into(),
            ));
        };
        let rendered = template.render(&[json!({ "role": "user", "content": text })], true)?;
        autosp_models::tokenizer::encode(tok, &rendered)
    } else {
        autosp_models::tokenizer::encode_document(tok, text)
    };
    Ok(encoded?)
}

/// Prints the text of `ids` past what was printed (`printed` characters), as tokens come.
fn print_new(tok: Option<&Tokenizer>, ids: &[u32], printed: &mut usize) {
    let Some(tok) = tok else {
        print!("{} ", ids[ids.len() - 1]);
        let _ = std::io::stdout().flush();
        return;
    };
    if let Ok(text) = autosp_models::tokenizer::decode(tok, ids) {
        let chars: Vec<char> = text.chars().collect();
        if chars.len() > *printed {
            print!("{}", chars[*printed..].iter().collect::<String>());
            *printed = chars.len();
            let _ = std::io::stdout().flush();
        }
    }
}

/// Whether any rank of `pg` was asked to stop (one all-reduce: every rank gets the same answer).
fn stop_agreed(pg: &dyn ProcessGroup) -> Result<bool, InferError> {
    let mine = Tensor::new(&[f32::from(u8::from(interrupt::requested()))], &Device::Cpu)?;
    let any = if pg.size() > 1 { pg.all_reduce(&mine, ReduceOp::Max).map_err(autosp_core::Error::from)? } else { mine };
    Ok(any.to_vec1::<f32>()?[0] > 0.0)
}

/// What every rank needs, read once per process before the ranks start.
pub struct Prepared {
    prompt: Vec<u32>,
    cfg: GenerateConfig,
    config: autosp_models::LlamaConfig,
    weights: std::collections::HashMap<String, Tensor>,
    lora: Option<LoraRun>,
    dtype: DType,
    tokenizer: Option<Tokenizer>,
}

/// Reads the prompt and the model `o` and `g` name, and tokenizes the prompt (see the module doc).
pub fn prepare(o: &RunOptions, g: &PromptOptions) -> Result<Prepared, InferError> {
    let text = prompt_text(&g.prompt)?;
    let (source, lora) = source(o)?;
    let dtype = o.dtype.unwrap_or(DType::F32);
    let loaded = model::load(&source, dtype)?;
    let prompt = tokenize(&text, &loaded, g.chat)?;
    if prompt.is_empty() {
        return Err(InferError::EmptyPrompt);
    }
    let cfg =
        GenerateConfig { max_new_tokens: g.max_new_tokens, sampling: g.sampling(), seed: o.seed, stop_tokens: None };
    Ok(Prepared {
        prompt,
        cfg,
        config: loaded.model.config.clone(),
        weights: loaded.model.to_weights(),
        lora,
        dtype,
        tokenizer: loaded.tokenizer,
    })
}

/// One rank's generation over `pg` (thread or process): builds its model on its device, compiles it and
/// generates; rank 0 prints the text as it comes, then the summary and the closing JSON line (every rank's
/// KV-cache bytes gathered, one all-gather).
pub fn run_rank(
    o: &RunOptions,
    job: &Prepared,
    pg: Arc<dyn ProcessGroup>,
    heap: Option<&'static TrackingAllocator>,
) -> Result<Generated, InferError> {
    let device = o.device_spec().open(Some((crate::device::local_rank(pg.rank()), pg.size())))?;
    let weights = job
        .weights
        .iter()
        .map(|(k, t)| Ok((k.clone(), t.to_device(&device)?)))
        .collect::<Result<std::collections::HashMap<_, _>, candle_core::Error>>()?;
    let mut m = LlamaModel::from_weights(&job.config, weights)?;
    if let Some(l) = &job.lora {
        l.apply(&mut m)?;
    }
    let mut c = CompileConfig::new(pg.clone(), o.strategy, o.checkpoint)
        .with_dtype(job.dtype)
        .with_max_attention_distance(o.max_attention_distance);
    if let Some(level) = o.shard {
        c = c.with_sharding(level);
    }
    if let Some(r) = &o.rope_scaling {
        c = c.with_rope_scaling(r.clone());
    }
    let compiled = compile(m, c)?;
    let rank0 = pg.rank() == 0;
    let (mut ids, mut printed, mut failed) = (Vec::new(), 0, None);
    let out = compiled.generate_streaming(&job.prompt, &job.cfg, |e| {
        if rank0 {
            ids.push(e.token);
            print_new(job.tokenizer.as_ref(), &ids, &mut printed);
        }
        match stop_agreed(pg.as_ref()) {
            Ok(stop) => !stop,
            Err(err) => {
                failed = Some(err);
                false
            }
        }
    })?;
    if let Some(err) = failed {
        return Err(err);
    }
    let mine = Tensor::new(&[out.stats.kv_cache_bytes as f64], &Device::Cpu)?;
    let all = if pg.size() > 1 { pg.all_gather(&mine, 0).map_err(autosp_core::Error::from)? } else { mine };
    let kv: Vec<usize> = all.to_vec1::<f64>()?.into_iter().map(|b| b as usize).collect();
    if rank0 {
        summary(&out, &kv, heap.map(|h| h.peak_bytes()), pg.size(), o);
    }
    Ok(out)
}

/// Generates on `p` thread ranks as `o` and `g` ask, printing on stdout (see the module doc). Returns rank 0's
/// generation.
pub fn run_threads(
    o: &RunOptions,
    g: &PromptOptions,
    p: usize,
    heap: Option<&'static TrackingAllocator>,
) -> Result<Generated, InferError> {
    let job = prepare(o, g)?;
    let results = run_ranks_fallible(p, Duration::from_secs(1800), |pg| {
        // Told with the error's causes first: `run_ranks_fallible`'s own notice (`{e:#}`) is then a no-op.
        let ran = run_rank(o, &job, pg.clone(), heap);
        abort_on_error(&*pg, ran)
    });
    let mut first = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(out)) => {
                first.get_or_insert(out);
            }
            Ok(Err(e)) => return Err(InferError::Prompt(format!("rank {rank}: {e}"))),
            Err(e) => return Err(InferError::Prompt(format!("rank {rank}: {e}"))),
        }
    }
    first.ok_or_else(|| InferError::Prompt("no rank ran: give --sp 1 or more".into()))
}

/// Rank 0's report: the summary line and the closing JSON line.
fn summary(out: &Generated, kv: &[usize], peak: Option<usize>, p: usize, o: &RunOptions) {
    let s = &out.stats;
    println!();
    if out.finish == Finish::Interrupted {
        println!("interrupted: {} tokens generated", out.tokens.len());
    }
    println!(
        "prompt {} tokens | {} new | prefill {:.1} tok/s | decode {:.1} tok/s | KV cache per rank {:?} bytes | \
         peak {} | sp {p} ({})",
        s.prompt_tokens,
        s.new_tokens,
        s.prefill_tokens_per_s,
        s.decode_tokens_per_s,
        kv,
        peak.map_or("-".into(), |b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)),
        crate::train::strategy_flag(o.strategy),
    );
    let mut line = s.to_json();
    line["kv_cache_bytes_per_rank"] = json!(kv);
    line["peak_bytes"] = json!(peak);
    line["finish"] = json!(format!("{:?}", out.finish).to_lowercase());
    line["tokens"] = json!(out.tokens);
    println!("{line}");
    let _ = std::io::stdout().flush();
}
