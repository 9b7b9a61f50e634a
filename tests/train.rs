//! The trainer through its library API (`autosp::train::Trainer`), without the `llama_longctx` command line:
//! a run stopped, saved and resumed gives the very bytes of an uninterrupted run (on 2 thread ranks, with 2
//! micro-batches a step), a stop flag raised before the first step saves nothing, and a non-finite loss stops
//! the run naming the newest checkpoint it kept. A rank whose run fails (a step it refuses, a save directory it
//! cannot lock) stops the others within seconds, naming it, rather than at the group's timeout.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use autosp::core::comm::{run_ranks, ProcessGroup};
use autosp::core::CheckpointPolicy;
use autosp::models::{random_weights, LlamaModel, TinySpec};
use autosp::train::{checkpoint, data, Ended, Event, Outcome, Stream, TrainConfig, TrainError, Trainer};
use autosp::{compile, Checkpointing, CompileConfig, Compiled, Strategy};
use candle_core::{DType, Device, Tensor};

const SEQ: usize = 64;

fn weights() -> (autosp::models::LlamaConfig, HashMap<String, Tensor>) {
    let config = TinySpec::default().config();
    let w = random_weights(&config, 11, DType::F32, &Device::Cpu).unwrap();
    (config, w)
}

fn compiled(pg: Arc<dyn ProcessGroup>, model: LlamaModel) -> Compiled<LlamaModel> {
    let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
    compile(model, CompileConfig::new(pg, Strategy::Auto, policy)).unwrap()
}

fn stream() -> Stream {
    let ids: Vec<u32> = (0..SEQ as u32 * 13).map(|i| (i * 5 + i / 7) % 60).collect();
    Stream::packed(data::pack(&ids, SEQ, "test ids").unwrap())
}

fn config(save: &Path, steps: usize) -> TrainConfig {
    let mut c = TrainConfig::new(SEQ, steps);
    c.lr = 3e-3;
    c.warmup = 2;
    c.micro_batches = 2;
    c.save_dir = Some(save.to_path_buf());
    c
}

/// Runs `f` on 2 thread ranks and returns rank 0's result.
fn on_two_ranks<R: Send>(f: impl Fn(Arc<dyn ProcessGroup>) -> R + Sync) -> R {
    run_ranks(2, Duration::from_secs(120), f).into_iter().next().unwrap().unwrap()
}

fn bytes(dir: &Path, file: &str) -> Vec<u8> {
    std::fs::read(dir.join(file)).unwrap()
}

#[test]
fn a_resumed_run_saves_the_bytes_of_an_uninterrupted_one() {
    let (cfg, w) = weights();
    let tmp = tempfile::tempdir().unwrap();
    let (whole, parts) = (tmp.path().join("whole"), tmp.path().join("parts"));
    let train = |save: &Path, steps: usize, stop_after: Option<usize>| -> Outcome {
        on_two_ranks(|pg| {
            let model = LlamaModel::from_weights(&cfg, w.clone()).unwrap();
            let mut t = Trainer::new(compiled(pg, model), config(save, steps), stream()).unwrap();
            let done = std::sync::atomic::AtomicUsize::new(0);
            let stop = || stop_after.is_some_and(|n| done.load(std::sync::atomic::Ordering::SeqCst) >= n);
            t.run(&stop, &mut |e| {
                if let Event::Step(_) = e {
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            })
            .unwrap()
        })
    };
    let full = train(&whole, 4, None);
    assert_eq!((full.ended, full.first_step, full.last_step), (Ended::Done, 0, 4));
    let (first, last) = full.loss.unwrap();
    assert!(last < first, "the loss fell: {first} -> {last}");

    // Stopped after 2 steps (only rank 0 sees its flag: the all-reduce stops both), then resumed to 4.
    let stopped = train(&parts, 4, Some(2));
    assert_eq!((stopped.ended, stopped.last_step), (Ended::Interrupted, 2));
    let at2 = stopped.checkpoint.expect("a stopped run that took steps saves");
    assert_eq!(at2, parts.join("step-2"));
    let state = checkpoint::verify(&at2).unwrap();
    assert_eq!((state.step, state.data.drawn, state.micro_batches), (2, 4, 2));
    let resumed = on_two_ranks(|pg| {
        let model = LlamaModel::load(at2.to_str().unwrap(), DType::F32).unwrap();
        let mut t = Trainer::new(compiled(pg, model), config(&parts, 4), stream()).unwrap();
        t.resume(&at2, &state).unwrap();
        t.run(&|| false, &mut |_| {}).unwrap()
    });
    assert_eq!((resumed.first_step, resumed.last_step), (2, 4));
    assert_eq!(resumed.loss.unwrap().1, last, "the last step's loss, resumed vs uninterrupted");
    for f in ["model.safetensors", "optimizer.safetensors", checkpoint::STATE_FILE] {
        let (a, b) = (bytes(&whole.join("step-4"), f), bytes(&parts.join("step-4"), f));
        assert!(a == b, "{f} after 4 steps differs from 2 steps + resume + 2 steps");
    }
}

#[test]
fn a_stop_before_the_first_step_saves_nothing() {
    let (cfg, w) = weights();
    let tmp = tempfile::tempdir().unwrap();
    let out = on_two_ranks(|pg| {
        let model = LlamaModel::from_weights(&cfg, w.clone()).unwrap();
        let mut t = Trainer::new(compiled(pg, model), config(tmp.path(), 4), stream()).unwrap();
        let mut events = Vec::new();
        let out = t.run(&|| true, &mut |e| events.push(e)).unwrap();
        (out, events)
    });
    assert_eq!((out.0.ended, out.0.last_step, out.0.checkpoint), (Ended::Interrupted, 0, None));
    assert!(out.1.is_empty(), "{:?}", out.1);
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "nothing written");
}

#[test]
fn a_nonfinite_loss_stops_naming_the_checkpoint_kept() {
    let (cfg, w) = weights();
    let tmp = tempfile::tempdir().unwrap();
    let err = on_two_ranks(|pg| {
        let model = LlamaModel::from_weights(&cfg, w.clone()).unwrap();
        let mut c = config(tmp.path(), 4);
        (c.lr, c.warmup, c.save_every) = (1e30, 0, 1);
        let mut t = Trainer::new(compiled(pg, model), c, stream()).unwrap();
        t.run(&|| false, &mut |_| {}).map(|_| ()).unwrap_err()
    });
    let TrainError::NonFinite { step, kept, .. } = &err else { panic!("{err}") };
    assert!(*step >= 2, "{err}");
    assert_eq!(kept.as_deref(), Some(tmp.path().join(format!("step-{}", step - 1)).as_path()), "{err}");
    assert!(err.to_string().contains("--skip-nonfinite"), "{err}");
}

/// The group's timeout in the tests of a failing rank: far past what the tests allow the others to take.
const LONG: Duration = Duration::from_secs(60);

/// After its call, the failing rank stays alive with its group and its trainer (as a process of an MPI job
/// does, or a library user's thread that goes on) until the other rank has its answer, 30 s at most; the
/// other says it has.
fn settle(failing: bool, answered: &AtomicBool) {
    if !failing {
        answered.store(true, Ordering::SeqCst);
        return;
    }
    let until = Instant::now() + Duration::from_secs(30);
    while !answered.load(Ordering::SeqCst) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Only rank 1's batch is bad (ids outside the vocabulary): its step refuses it, and rank 0, inside the step's
/// collectives, stops within seconds naming rank 1 and its error (the group would wait 60 s).
#[test]
fn a_rank_whose_step_fails_stops_the_others_within_seconds() {
    let (cfg, w) = weights();
    let answered = AtomicBool::new(false);
    let out = run_ranks(2, LONG, |pg| {
        let rank = pg.rank();
        let model = LlamaModel::from_weights(&cfg, w.clone()).unwrap();
        let data = match rank {
            1 => Stream::packed(data::pack(&vec![1000; SEQ * 4], SEQ, "bad ids").unwrap()),
            _ => stream(),
        };
        let mut c = TrainConfig::new(SEQ, 2);
        c.micro_batches = 2;
        let mut t = Trainer::new(compiled(pg, model), c, data).unwrap();
        let start = Instant::now();
        let out = t.run(&|| false, &mut |_| {}).map(|_| ()).map_err(|e| e.to_string());
        let took = start.elapsed();
        settle(rank == 1, &answered);
        (out, took)
    });
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    let (e1, e0) = (out[1].0.clone().unwrap_err(), out[0].0.clone().unwrap_err());
    assert!(e1.contains("id 1000") && e1.contains("outside the model's vocabulary"), "{e1}");
    assert!(e0.contains("rank 1 of the job failed") && e0.contains("id 1000"), "rank 0: {e0}");
    assert!(out[0].1 < Duration::from_secs(10), "rank 0 stopped after {:?}", out[0].1);
}

/// `Job::run_rank` likewise: rank 0 alone cannot take the save directory's lock (another holder), and rank 1,
/// gone on into the run's collectives, stops within seconds naming rank 0 and why.
#[test]
fn a_rank_whose_job_fails_stops_the_others_within_seconds() {
    use autosp::train::{Job, RunOptions};
    let tmp = tempfile::tempdir().unwrap();
    let save = tmp.path().join("run");
    let o = RunOptions { steps: 2, ..common::quick_run(&save) };
    let job = Job::prepare(o, 2, true).unwrap();
    let _held = checkpoint::SaveLock::acquire(&save).unwrap();
    let answered = AtomicBool::new(false);
    let out = run_ranks(2, LONG, |pg| {
        let rank = pg.rank();
        let start = Instant::now();
        let out = job.run_rank(pg, &|| false, &mut |_| {}).map(|_| ()).map_err(|e| e.to_string());
        let took = start.elapsed();
        settle(rank == 0, &answered);
        (out, took)
    });
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    let (e0, e1) = (out[0].0.clone().unwrap_err(), out[1].0.clone().unwrap_err());
    assert!(e0.contains("another run"), "{e0}");
    assert!(e1.contains("rank 0 of the job failed") && e1.contains("another run"), "rank 1: {e1}");
    assert!(out[1].1 < Duration::from_secs(10), "rank 1 stopped after {:?}", out[1].1);
}
