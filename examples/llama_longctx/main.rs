//! `llama_longctx`: long-context fine-tuning of Llama-family models with autosp, the project's main job.
//!
//! With no arguments it makes (once, cached) a tiny random Llama in the HF layout, compiles it for 2 thread
//! ranks with sequence-aware checkpointing, trains it on synthetic multi-needle retrieval across the shards
//! (`autosp::train::synthetic::Needles`: every answer sits thousands of tokens before its question, on the
//! other rank), and prints the loss per step and the accuracy during the curriculum, then a summary table:
//! loss first and last, retrieval accuracy before and after, tokens/s, memory per rank, and where the
//! checkpoint went.
//! With options it fine-tunes a local, hub or GGUF checkpoint on your data (`--help`).
//!
//! ```text
//! cargo run --release --example llama_longctx
//! cargo run --release --example llama_longctx -- --model HuggingFaceTB/SmolLM2-135M --data corpus.jsonl \
//!     --seq-len 8192 --sp 4 --strategy ring --steps 200 --save runs/smollm2
//! cargo build --release --features mpi --example llama_longctx
//! mpirun -np 4 target/release/examples/llama_longctx --launcher mpi --seq-len 8192
//! ```
//!
//! Under `--launcher mpi` with a CUDA device, a build with `nccl` runs the collectives over NCCL (bootstrapped
//! over MPI, one GPU per process; `autosp::train::over_mpi`), type-checked only: it has not run on GPUs.
//!
//! This file is the command line only: the run itself is `autosp::train::Job` (model, data, resume checks,
//! compile, the training loop, checkpoints, the summary); here are the options (`args.rs`), the launch
//! (thread ranks, or one process per rank under mpirun) and the printing of the run's reports.

mod args;

use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Result;
use autosp::core::TrackingAllocator;
use autosp::train::{interrupt, Ended, Event, Job, Progress};
use clap::{CommandFactory, FromArgMatches};

use args::Args;

/// The process heap, counted (live and peak bytes) for the memory report.
#[global_allocator]
pub static ALLOC: TrackingAllocator = TrackingAllocator::new();

/// How long any collective waits for the other ranks (a save on rank 0 can take a while for big models).
const TIMEOUT: Duration = Duration::from_secs(1800);

/// Exit status after Ctrl-C (128 + SIGINT, as shells report it), once the checkpoint is saved.
const INTERRUPTED: u8 = 130;

fn main() -> ExitCode {
    let matches = Args::command().get_matches();
    let args = match Args::from_arg_matches(&matches) {
        Ok(a) => a.finish(&matches),
        Err(e) => e.exit(),
    };
    if let Some(w) = autosp::cpu_matmul::stand_in_warning() {
        eprintln!("llama_longctx: warning: {w}");
    }
    interrupt::install();
    // `--steps 0 --lora-adapter DIR --merge-lora OUT`: merge only, no training.
    match autosp::train::lora::merge_only(&args.options()) {
        Ok(Some(out)) => {
            println!("merged {} into {}", args.lora_adapter.clone().unwrap_or_default().display(), out.display());
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(e) => {
            report(&e.into());
            return ExitCode::FAILURE;
        }
    }
    if let Some(g) = args.prompt_options() {
        return generate(&args, &g);
    }
    let result = match args.launcher.as_str() {
        "mpi" => run_mpi(args),
        _ => run_threads(args),
    };
    match result {
        Ok(Some(Ended::Done)) => ExitCode::SUCCESS,
        Ok(Some(Ended::Interrupted)) => ExitCode::from(INTERRUPTED),
        // Failed, and the error is already reported (one process per rank: said before the others were told).
        Ok(None) => ExitCode::FAILURE,
        Err(e) => {
            report(&e);
            ExitCode::FAILURE
        }
    }
}

/// `--prompt`: generation over thread ranks (`autosp::infer::cli`); exit 130 after Ctrl-C.
fn generate(args: &Args, g: &autosp::infer::cli::PromptOptions) -> ExitCode {
    if args.launcher == "mpi" {
        return generate_mpi(args, g);
    }
    let p = args.sp.unwrap_or_else(|| args.options().default_sp_threads());
    match autosp::infer::cli::run_threads(&args.options(), g, p, Some(&ALLOC)) {
        Ok(out) if out.finish == autosp::infer::Finish::Interrupted => ExitCode::from(INTERRUPTED),
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            report(&e.into());
            ExitCode::FAILURE
        }
    }
}

/// `--prompt` under mpirun: one rank per process, each reading the model itself; a failing rank tells the others.
#[cfg(feature = "mpi")]
fn generate_mpi(args: &Args, g: &autosp::infer::cli::PromptOptions) -> ExitCode {
    use autosp::core::comm::{MpiGroup, ProcessGroup};
    use autosp::infer::cli;
    let pg: std::sync::Arc<dyn ProcessGroup> = match MpiGroup::init(TIMEOUT) {
        Ok(pg) => std::sync::Arc::new(pg),
        Err(e) => {
            report(&e.into());
            return ExitCode::FAILURE;
        }
    };
    // The default tiny model is made once, by rank 0, before the others read it.
    if args.model.is_none() && args.resume.is_none() {
        let made = if pg.rank() == 0 { autosp::train::model::tiny_model(args.seed).map(|_| ()) } else { Ok(()) };
        if let Err(e) = pg.barrier().map_err(anyhow::Error::from).and(made.map_err(anyhow::Error::from)) {
            report(&e);
            pg.abort(&format!("{e:#}"));
            return ExitCode::FAILURE;
        }
    }
    let o = args.options();
    // Boxed: with CUDA's errors inside, an InferError is too large to pass by value (clippy result_large_err).
    let run = || -> Result<autosp::infer::Generated, Box<autosp::infer::InferError>> {
        let job = cli::prepare(&o, g)?;
        Ok(cli::run_rank(&o, &job, pg.clone(), Some(&ALLOC))?)
    };
    match run() {
        Ok(out) if out.finish == autosp::infer::Finish::Interrupted => ExitCode::from(INTERRUPTED),
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            report(&anyhow::anyhow!("rank {}: {e}", pg.rank()));
            pg.abort(&autosp::core::comm::with_causes(&*e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn generate_mpi(_args: &Args, _g: &autosp::infer::cli::PromptOptions) -> ExitCode {
    report(&anyhow::anyhow!(
        "--launcher mpi needs the MPI back end, which this binary was built without: build with \
         `cargo build --release --features mpi --example llama_longctx` and start it with \
         `mpirun -np P target/release/examples/llama_longctx --launcher mpi --prompt ...`"
    ));
    ExitCode::FAILURE
}

/// Prints a run's error on stderr (the one line every failing rank prints).
fn report(e: &anyhow::Error) {
    use std::io::Write;
    eprintln!("llama_longctx: error: {e:#}");
    let _ = std::io::stderr().flush();
}

/// Prints rank 0's reports: lines on stdout (above the progress bar, unless --no-progress), warnings on
/// stderr, and the summary table.
fn printer(args: &Args) -> impl FnMut(Event) + Send {
    let mut bar = Progress::new(args.steps, !args.no_progress);
    move |event| match event {
        Event::Step(r) => {
            bar.println(&r.to_string());
            bar.update(r.step, r.loss, r.tokens_per_s);
        }
        Event::Cleaned { .. } => eprintln!("llama_longctx: {event}"),
        Event::Summary(s) => {
            bar.finish();
            print!("{}", s.table("llama_longctx"));
        }
        Event::Interrupted { .. } => {
            bar.finish();
            println!("{event}");
        }
        event => bar.println(&event.to_string()),
    }
}

/// D × S ranks as threads of this process.
fn run_threads(args: Args) -> Result<Option<Ended>> {
    let p = args.dp * args.sp.unwrap_or_else(|| args.options().default_sp_threads());
    let print = Mutex::new(printer(&args));
    let mut job = Job::prepare(args.options(), p, true)?;
    (job.heap, job.name) = (Some(&ALLOC), "llama_longctx".into());
    // A rank that fails tells the others (they stop at once with the failed rank's error).
    let results = autosp::core::comm::run_ranks_fallible(p, TIMEOUT, |pg| {
        let mut observe = |e: Event| (print.lock().unwrap())(e);
        job.run_rank(pg, &interrupt::requested, &mut observe).map_err(anyhow::Error::from)
    });
    // Report the first rank's error (the others usually only saw it fail).
    let mut first_err = None;
    let mut ended = Ended::Done;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(e)) => {
                if e == Ended::Interrupted {
                    ended = e;
                }
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e.context(format!("rank {rank}")));
            }
            Err(e) => {
                first_err.get_or_insert(anyhow::Error::from(e).context(format!("rank {rank}")));
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(Some(ended)),
    }
}

/// One rank per process under mpirun; only rank 0 prints and saves. A rank that fails tells every other
/// process (`ProcessGroup::abort`), so they all stop within moments with its error and exit non-zero.
#[cfg(feature = "mpi")]
fn run_mpi(args: Args) -> Result<Option<Ended>> {
    use autosp::core::comm::{MpiGroup, ProcessGroup};
    use std::sync::Arc;
    let pg: Arc<dyn ProcessGroup> = Arc::new(MpiGroup::init(TIMEOUT)?);
    match run_mpi_rank(args, &pg) {
        Err(e) => {
            // Said before the others are told: once they exit, mpirun may end this process at any moment.
            report(&e);
            pg.abort(&format!("{e:#}"));
            Ok(None)
        }
        Ok(ended) => Ok(Some(ended)),
    }
}

#[cfg(feature = "mpi")]
fn run_mpi_rank(args: Args, pg: &std::sync::Arc<dyn autosp::core::comm::ProcessGroup>) -> Result<Ended> {
    use anyhow::Context;
    let (rank, size) = (pg.rank(), pg.size());
    if args.dp == 0 || !size.is_multiple_of(args.dp) || args.sp.is_some_and(|sp| sp * args.dp != size) {
        anyhow::bail!(
            "--dp {}{} but mpirun started {size} processes: with --launcher mpi, --dp × --sp is mpirun's -np (--sp \
             defaults to -np / --dp)",
            args.dp,
            args.sp.map_or(String::new(), |sp| format!(" --sp {sp}"))
        );
    }
    // The default tiny model is made once, by rank 0, before the others read it.
    if args.model.is_none() && args.resume.is_none() {
        let made = if rank == 0 { autosp::train::model::tiny_model(args.seed).map(|_| ()) } else { Ok(()) };
        pg.barrier()?;
        made?;
    }
    let mut job = Job::prepare_on(args.options(), pg.as_ref()).with_context(|| format!("rank {rank}"))?;
    (job.heap, job.name) = (Some(&ALLOC), "llama_longctx".into());
    // Each process takes its node-local rank's GPU (plain `cuda`), before the NCCL group that needs it.
    let device = job.options.device_spec().open(Some((autosp::device::local_rank(rank), size)));
    let device = device.with_context(|| format!("rank {rank}"))?;
    // NCCL carries the collectives of CUDA tensors in a build with `nccl`; otherwise MPI, through the host.
    let (group, carrier) = autosp::train::over_mpi(pg, &device, TIMEOUT).with_context(|| format!("rank {rank}"))?;
    job.device = Some(device);
    job.carrier = carrier;
    let mut print = printer(&args);
    job.run_rank(group, &interrupt::requested, &mut print).with_context(|| format!("rank {rank}"))
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_args: Args) -> Result<Option<Ended>> {
    anyhow::bail!(
        "--launcher mpi needs the MPI back end, which this binary was built without: build with \
         `cargo build --release --features mpi --example llama_longctx` and start it with \
         `mpirun -np P target/release/examples/llama_longctx --launcher mpi ...`"
    )
}
