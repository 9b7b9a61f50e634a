//! The command line of `llama_longctx` (clap): one option per setting of [`RunOptions`], parsed by the
//! library's parsers (strategy, checkpointing, window, dtype, device), plus the launcher and the display.

use std::path::PathBuf;

use autosp::train::{parse_checkpointing, parse_max_attention_distance, parse_strategy, RunOptions};
use autosp::{Checkpointing, Strategy};
use candle_core::DType;
use clap::Parser;

/// Long-context fine-tuning of Llama-family models with sequence parallelism.
///
/// With no arguments: makes (once, cached) a tiny random Llama, compiles it for 2 thread ranks with
/// sequence-aware checkpointing and trains it on synthetic multi-needle retrieval across the shards.
#[derive(Parser, Debug, Clone)]
#[command(name = "llama_longctx", version, about, long_about)]
pub struct Args {
    /// The model: a local directory (config.json + safetensors), a hub repo id `owner/name[@revision]`
    /// (HF cache first; HF_HUB_OFFLINE=1 uses only the cache) or a `.gguf` file. Default: a tiny random
    /// Llama made once under the autosp cache (AUTOSP_CACHE, else $XDG_CACHE_HOME/autosp, else ~/.cache/autosp).
    #[arg(long)]
    pub model: Option<String>,

    /// Tokens per training sequence.
    #[arg(long, default_value_t = 4096)]
    pub seq_len: usize,

    /// Sequence-parallel ranks per replica: each sequence is split over them (threads: default 2 on the CPU, 1
    /// on a GPU, where thread ranks would share its one stream and each hold a whole replica of the model
    /// states; with `--launcher mpi`: mpirun's process count / --dp).
    #[arg(long)]
    pub sp: Option<usize>,

    /// Data-parallel replicas: the ranks are --dp replicas of --sp ranks, each replica trains its own
    /// sequences; the loss is the mean over all of them and gradients are summed over every rank.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,

    /// How model states are sharded over all ranks (ZeRO-style): none, optimizer (AdamW's moments and
    /// f32 masters), gradients (also the gradients, reduce-scattered in backward) or parameters (also the
    /// weights, gathered for each use). Default: none below 1 GiB of model state per rank, else gradients
    /// (`--explain` says which and why).
    #[arg(long, value_parser = str::parse::<autosp::core::ShardLevel>)]
    pub shard: Option<autosp::core::ShardLevel>,

    /// The dtype gradients travel in when they are reduced over the ranks (every --shard level): f32, or
    /// bf16 for half the bytes (summed in f32 after each receive).
    #[arg(long, default_value = "f32", value_parser = autosp::compile::GradReduction::parse_dtype)]
    pub reduce_dtype: DType,

    /// MiB of f32 gradient per reduction bucket; each bucket is reduced as soon as backward has made all of
    /// it, while backward goes on (thread ranks, MPI, NCCL with NCCL_RUNTIME_CONNECT=0). At --shard gradients and
    /// parameters: the most whole gradients in flight to the reduce-scatter thread.
    #[arg(long = "bucket-mb", value_name = "MIB", default_value = "16", value_parser = autosp::compile::GradReduction::parse_bucket_mb)]
    pub bucket_bytes: usize,

    /// At --shard parameters, gather each weight at its use instead of gathering the next block's weights on
    /// a communication thread while a block computes (the default: two blocks' weights whole at once, as the
    /// accounting counts).
    #[arg(long)]
    pub no_prefetch_gathers: bool,

    /// The memory the ranks on this host may hold for model states (suffixes K, M, G, KiB, MiB, GiB). A run
    /// that resumes a checkpoint is checked against it (default: the host's available memory), and any run
    /// that gives it: when the accounting exceeds it the run is refused before a rank allocates the model,
    /// naming the --shard level or rank count that fits.
    #[arg(long, value_name = "BYTES", value_parser = autosp::train::parse_memory_budget)]
    pub memory_budget: Option<u64>,

    /// How attention is made whole across ranks: ulysses, ring, hybrid:U (Ulysses degree U), auto.
    #[arg(long, default_value = "auto", value_parser = parse_strategy)]
    pub strategy: Strategy,

    /// Activation checkpointing: none, full, sequence-aware, or a per-rank tape budget in bytes
    /// (suffixes K, M, G, KiB, MiB, GiB allowed).
    #[arg(long, default_value = "sequence-aware", value_parser = parse_checkpointing)]
    pub checkpoint: Checkpointing,

    /// Compute dtype: bf16, f16 or f32 (default: f32 on the CPU, bf16 on CUDA). Under bf16/f16 the
    /// optimizer keeps f32 master weights and moments; the LSE, the loss and the gradient all-reduce stay
    /// f32; checkpoints are saved in the model's own dtype (config.json's torch_dtype).
    #[arg(long, value_parser = autosp::precision::parse_dtype)]
    pub dtype: Option<DType>,

    /// Limit attention to a sliding window of D positions: each token sees only itself and the D tokens
    /// before it (0: itself only), in training, evaluation and the passkey probes alike. The control that shows
    /// whether a task needs long range (passkey retrieval with D below the distance between key and question
    /// should stay at chance). Key tiles and Ring blocks out of reach are skipped, so it is also cheaper.
    /// Default: no window.
    #[arg(long, value_name = "D", value_parser = parse_max_attention_distance)]
    pub max_attention_distance: Option<usize>,

    /// Extend the model's context window by RoPE scaling: TYPE:FACTOR[,KEY=VALUE...] with TYPE linear,
    /// dynamic or yarn (yarn's keys: attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim,
    /// truncate), or `none` to train without a scaling (a checkpoint's own removed). The original window is
    /// the checkpoint's original_max_position_embeddings if it has a scaling (the same type composes: the
    /// factors multiply), else its max_position_embeddings; every checkpoint saved carries the scaling in its
    /// config.json. E.g. --rope-scaling yarn:2 takes an 8192-token model to 16384.
    #[arg(long, value_name = "SPEC", value_parser = parse_rope_scaling)]
    pub rope_scaling: Option<autosp::models::RopeExtension>,

    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    pub steps: usize,

    /// Peak learning rate (AdamW; linear warm-up, then cosine decay to lr / 10 at the last step). Default:
    /// 2e-5 with --model (the usual rate for fine-tuning a pretrained 0.1-8B model whole; a rate like 1e-2
    /// wrecks it in a few steps), the checkpoint's own with --resume, 1e-2 for the built-in demo model
    /// (random weights, trained from scratch).
    #[arg(long)]
    pub lr: Option<f64>,

    /// Put weight decay on norms, biases and the embedding too. By default a run with --model leaves them out
    /// (only the projection matrices and an untied LM head decay), as fine-tuning recipes do; the demo model
    /// decays everything.
    #[arg(long)]
    pub decay_all: bool,

    /// Warm-up steps.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,

    /// Clip the gradients' global L2 norm to this (0 turns clipping off).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f64,

    /// Tokens per optimizer step: a multiple of --seq-len; the gradients of batch-tokens / seq-len
    /// micro-batches are accumulated (token-weighted mean). Default: one sequence.
    #[arg(long)]
    pub batch_tokens: Option<usize>,

    /// Training data: `needles` (synthetic multi-needle retrieval across the shards: the evidence in the
    /// first eighth of each sequence, the questions after 5/8 of it; trained on the answers only, with a
    /// length curriculum), `passkey` (synthetic passkey retrieval), a JSONL file with a "text" field per line
    /// (documents, each with the BOS the tokenizer adds and an EOS after it, packed to --seq-len), a JSONL file
    /// with a "messages" list per line (conversations rendered with the model's chat template; only the
    /// assistant's tokens train; see --chat-layout), a plain text file of any size (documents separated by blank
    /// lines, each like a "text" line), or `ids:FILE` (whitespace-separated token ids, used as they are). Text is
    /// tokenised once, streamed, into a cache file beside the data (`.NAME.autosp-KEY.tokens`, remade when the
    /// data, tokenizer or template change; one process tokenises, the others wait for it) and read a window at a
    /// time.
    #[arg(long, default_value = "needles")]
    pub data: String,

    /// How conversations (`--data` JSONL with "messages") fill the --seq-len windows: `pack` (one after
    /// another, none straddling two windows: the rest of a window is padded with the model's EOS, which does
    /// not train) or `truncate` (one per window, padded). One longer than a window keeps its end (the last
    /// answer and as much context before it as fits) after its opening (the template's start, the system turn).
    #[arg(long, default_value = "pack")]
    pub chat_layout: autosp::train::corpus::ChatLayout,

    /// How --seq-len windows are packed from the documents of --data: `documents` (each token attends only to
    /// its own document, positions restart at each document, and no document's first token is trained on the
    /// one before; a document longer than the room left in a window goes on in the next, its positions
    /// continuing) or `stream` (document-blind: every window is one sequence). Default: documents for text,
    /// JSONL and chat data, stream for ids: files (with documents, each line of an ids: file is a document).
    /// Not for the synthetic tasks.
    #[arg(long, value_parser = str::parse::<autosp::train::Packing>)]
    pub packing: Option<autosp::train::Packing>,

    /// Sequence lengths before --seq-len (`--data needles` only): `L1:S1,L2:S2,...` trains S1 steps on
    /// sequences of L1 tokens, then S2 steps at L2, ..., and the remaining steps at --seq-len; every step
    /// holds --seq-len tokens (seq-len / L sequences of L tokens). `none`: every step at --seq-len. Default:
    /// lengths doubling from 256 for 90% of the steps (40% at 256, the rest shared by the longer ones), then
    /// 10% at --seq-len.
    #[arg(long)]
    pub curriculum: Option<String>,

    /// Directory for checkpoints (each one in `DIR/step-N`, written atomically). Default: the directory
    /// holding the --resume checkpoint, else `runs/latest` under the autosp cache. One run at a time: a second
    /// run saving into the same directory is refused, naming the first one's process id.
    #[arg(long)]
    pub save: Option<PathBuf>,

    /// Save every N steps (0: only at the end, and on Ctrl-C).
    #[arg(long, default_value_t = 0)]
    pub save_every: usize,

    /// Resume from a checkpoint directory (`.../step-N`): model, optimizer state, step, data position and
    /// random state. The other options must describe the same run: a different --batch-tokens, --data or
    /// --seed is refused; a different --steps, --lr, --warmup, --seq-len or --curriculum needs --allow-changes.
    #[arg(long)]
    pub resume: Option<PathBuf>,

    /// With --resume: go on when --steps, --lr, --warmup, --seq-len or --curriculum differ from the checkpoint's run,
    /// printing each change (the schedule, or the data's shape, then differ from an uninterrupted run).
    /// Without it such a resume is refused, naming what differs.
    #[arg(long)]
    pub allow_changes: bool,

    /// Skip an optimizer step whose loss or gradient norm is not finite (NaN or infinite): no update, a line
    /// saying so, training goes on. Without it training stops at such a step with `loss is not finite at
    /// step K` (or `gradient norm ...`), saves nothing (the last checkpoint stays the newest) and exits
    /// non-zero.
    #[arg(long)]
    pub skip_nonfinite: bool,

    /// Loss scaling: `auto` (dynamic from 65536, doubling every 2000 good steps, when --dtype f16; none in bf16
    /// and f32), `off`, or `INIT[:INTERVAL]` (dynamic from INIT, a power of two). A step whose f16 gradients
    /// overflow is skipped and the scale halved.
    #[arg(long, default_value = "auto", value_parser = autosp::train::LossScaling::parse)]
    pub loss_scale: autosp::train::LossScaling,

    /// Print the model's mean token loss on the whitespace-separated token ids in FILE as one JSON line, and exit.
    #[arg(long)]
    pub eval_tokens: Option<PathBuf>,

    /// Held-out data scored before training, every --eval-every steps and after (mean next-token loss,
    /// forward only): a text or JSONL file (tokenised like --data) or `ids:FILE`; up to --eval-tokens-max of its
    /// tokens are scored, in windows of --seq-len (each a sequence of its own; the mean weighs every target
    /// alike). The ids scored are written to `heldout-ids.txt` in the --save directory, one window per line.
    #[arg(long)]
    pub eval_data: Option<String>,

    /// With --eval-data: also score it every N steps (0: only before and after training).
    #[arg(long, default_value_t = 0)]
    pub eval_every: usize,

    /// With --eval-data: score at most N of its tokens (the first ones), in windows of --seq-len.
    #[arg(long, default_value_t = 65536, value_name = "N")]
    pub eval_tokens_max: usize,

    /// The passkey grid, scored before and after training: the standard passkey prompt (through the model's
    /// tokenizer; fixed ids without one) at each of these lengths in tokens (e.g. 4096,8192,16384) with the
    /// key at each --eval-depths, --eval-samples keys per cell, one forward pass each (a hit: every answer
    /// digit right). JSON lines in --metrics, a table in the summary, passkey-before.svg / passkey-after.svg
    /// beside the metrics file (else in --save).
    #[arg(long, value_name = "LENGTHS")]
    pub eval_passkey: Option<String>,

    /// With --eval-passkey: the needle depths in percent of the filler [default: 0,25,50,75,100].
    #[arg(long, value_name = "DEPTHS")]
    pub eval_depths: Option<String>,

    /// With --eval-passkey: keys per (length, depth) cell [default: 5].
    #[arg(long, value_name = "N")]
    pub eval_samples: Option<usize>,

    /// With --eval-passkey: also score each sample by greedy generation after its question (the answer's
    /// tokens + 4): a hit when the generated text's first digits are the key (fixed ids: the answer's ids
    /// exactly). JSON lines {"eval":"passkey_generated",..} and a second table beside the one-forward ones.
    #[arg(long)]
    pub eval_passkey_generate: bool,

    /// With --eval-data: the held-out loss by token position (buckets 0-1K, 1-2K, 2-4K, ... up to --seq-len;
    /// below 2048, sixteenths to halves of it), each window the first --seq-len tokens of a document, before
    /// and after training. JSON lines in --metrics, a table in the summary, positions.svg beside the metrics
    /// file (else in --save) with the model's original window marked.
    #[arg(long)]
    pub eval_positions: bool,

    /// Write the gradients of the first step's mean token loss (before clipping), with HF parameter names,
    /// as safetensors to FILE.
    #[arg(long)]
    pub dump_grads: Option<PathBuf>,

    /// How ranks run: threads (one process), or mpi (one process per rank under mpirun; needs the
    /// `mpi` feature).
    #[arg(long, default_value = "threads", value_parser = ["threads", "mpi"])]
    pub launcher: String,

    /// Seed of the data (and of the default tiny model's weights).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Append one JSON line per step to FILE: step, loss, lr, grad norm, tokens/s, peak bytes.
    #[arg(long)]
    pub metrics: Option<PathBuf>,

    /// Print the compiled plan (module tree, strategy, policy, predicted memory) and exit.
    #[arg(long)]
    pub explain: bool,

    /// A quick run for tests and CI: 512 tokens, 12 steps, no accuracy probe beyond 4 samples.
    #[arg(long)]
    pub quick: bool,

    /// No progress bar (one line per step only).
    #[arg(long)]
    pub no_progress: bool,

    /// Train LoRA adapters of rank R (alpha ALPHA, default 2R: the update is scaled by ALPHA / R) on the
    /// frozen model instead of the whole model: the base weights get no gradients and no optimizer state.
    /// Checkpoints then hold the adapter in PEFT's layout (adapter_config.json + adapter_model.safetensors,
    /// which `peft.PeftModel.from_pretrained(base, dir)` loads) beside the optimizer and trainer state. The
    /// default --lr becomes 2e-4 with --model.
    #[arg(long, value_name = "R[:ALPHA]")]
    pub lora: Option<String>,

    /// With --lora: the projections that get adapters, comma-separated from q, k, v, o, gate, up, down
    /// (default: all seven).
    #[arg(long, value_name = "LIST")]
    pub lora_targets: Option<String>,

    /// With --lora: dropout on the adapters' input while training (default 0).
    #[arg(long, value_name = "P")]
    pub lora_dropout: Option<f32>,

    /// With --lora: also train the embedding (`embed`) and/or every norm (`norm`), comma-separated, as
    /// LongLoRA does to extend the context; PEFT saves them as modules_to_save.
    #[arg(long, value_name = "LIST")]
    pub lora_train: Option<String>,

    /// Start from the LoRA adapter in DIR (PEFT's layout: ours or one PEFT wrote) on --model (default: the
    /// base model the adapter names): for --eval-tokens, --eval-data or further training. Its settings
    /// (rank, alpha, targets) come with it.
    #[arg(long, value_name = "DIR")]
    pub lora_adapter: Option<PathBuf>,

    /// With LoRA: at the end, write the base model with the final adapter merged in (W + ALPHA/R · B A,
    /// computed in f32 from the files) as an HF checkpoint in DIR. With `--lora-adapter` and `--steps 0`: merge
    /// that adapter into its base and stop, training nothing.
    #[arg(long, value_name = "DIR")]
    pub merge_lora: Option<PathBuf>,

    /// The device: `cpu`, `cuda`, `cuda:N` or `metal` (default: the first CUDA device when this binary has
    /// CUDA (`--features cuda`) and one exists, else the CPU). Thread ranks share the device; under MPI, plain
    /// `cuda` gives each rank `cuda:(local rank mod device count)`.
    #[arg(long)]
    pub device: Option<autosp::DeviceSpec>,

    /// Generate instead of training: the prompt, a file (UTF-8) or the text itself (`ids:1,2,3` for token
    /// ids), prefilled over the --sp ranks into a sharded KV cache and continued (docs/INFERENCE.md).
    #[arg(long, value_name = "FILE|TEXT")]
    pub prompt: Option<String>,

    /// With --prompt: at most N new tokens (the model's end tokens stop earlier).
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub max_new_tokens: usize,

    /// With --prompt: the sampling temperature (0: greedy, the default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,

    /// With --prompt and a temperature: sample from the nucleus of this probability (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,

    /// With --prompt and a temperature: sample from the K most likely tokens only (0: off).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub top_k: usize,

    /// With --prompt: wrap it as one user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
}

impl Args {
    /// What --prompt asks to generate, when it is given.
    pub fn prompt_options(&self) -> Option<autosp::infer::cli::PromptOptions> {
        Some(autosp::infer::cli::PromptOptions {
            prompt: self.prompt.clone()?,
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            chat: self.chat,
        })
    }

    /// Applies `--quick` (only where the user did not set a value).
    pub fn finish(mut self, given: &clap::ArgMatches) -> Self {
        let default = |name: &str| given.value_source(name) != Some(clap::parser::ValueSource::CommandLine);
        if self.quick {
            if default("seq_len") {
                self.seq_len = 512;
            }
            if default("steps") {
                self.steps = 12;
            }
            if default("warmup") {
                self.warmup = 2;
            }
        }
        self
    }

    /// The run's settings.
    pub fn options(&self) -> RunOptions {
        let a = self.clone();
        RunOptions {
            model: a.model,
            seq_len: a.seq_len,
            dp: a.dp,
            shard: a.shard,
            reduction: autosp::compile::GradReduction {
                dtype: a.reduce_dtype,
                bucket_bytes: a.bucket_bytes,
                ..Default::default()
            },
            prefetch_gathers: !a.no_prefetch_gathers,
            memory_budget: a.memory_budget,
            strategy: a.strategy,
            checkpoint: a.checkpoint,
            dtype: a.dtype,
            max_attention_distance: a.max_attention_distance,
            rope_scaling: a.rope_scaling,
            steps: a.steps,
            lr: a.lr,
            decay_all: a.decay_all,
            warmup: a.warmup,
            grad_clip: a.grad_clip,
            batch_tokens: a.batch_tokens,
            data: a.data,
            curriculum: a.curriculum,
            save: a.save,
            save_every: a.save_every,
            resume: a.resume,
            allow_changes: a.allow_changes,
            skip_nonfinite: a.skip_nonfinite,
            loss_scale: a.loss_scale,
            eval_tokens: a.eval_tokens,
            eval_data: a.eval_data,
            eval_every: a.eval_every,
            eval_tokens_max: a.eval_tokens_max,
            eval_passkey: a.eval_passkey,
            eval_depths: a.eval_depths,
            eval_samples: a.eval_samples,
            eval_passkey_generate: a.eval_passkey_generate,
            eval_positions: a.eval_positions,
            dump_grads: a.dump_grads,
            seed: a.seed,
            metrics: a.metrics,
            explain: a.explain,
            quick: a.quick,
            device: a.device,
            lora: a.lora,
            lora_targets: a.lora_targets,
            lora_dropout: a.lora_dropout,
            lora_train: a.lora_train,
            lora_adapter: a.lora_adapter,
            merge_lora: a.merge_lora,
            chat_layout: a.chat_layout,
            packing: a.packing,
        }
    }
}

/// `--rope-scaling SPEC` ([`autosp::models::RopeExtension`]'s spelling; its error names the option).
fn parse_rope_scaling(spec: &str) -> Result<autosp::models::RopeExtension, String> {
    spec.parse().map_err(|e: autosp::models::Error| e.to_string())
}
