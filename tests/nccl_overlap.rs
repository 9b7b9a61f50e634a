//! NCCL handles that run at once (issue #41 item 5): a group and its `duplicate`, each queuing on its own CUDA
//! stream, used from two threads of one rank. Needs features `cuda` and `nccl` and two CUDA GPUs (one rank per
//! GPU, a thread per rank, NCCL bootstrapped over thread ranks); `scripts/gpu_check.sh` runs it in its `nccl`
//! stage where a machine has two GPUs: `cargo test --release --features cuda,nccl --test nccl_overlap --
//! --test-threads=1` (one test at a time: two tests' NCCL groups on the same GPUs could wait for each other,
//! see `nccl.rs`). It sets `NCCL_RUNTIME_CONNECT=0` where it is unset, before NCCL starts: with NCCL's lazy
//! connection (2.22 and later) the handles are not concurrent.
//!
//! - The duplicate's all-reduce equals the group's (and the sum), and both say `concurrent_handles`.
//! - Concurrency: rank 0 enters an all-reduce on the group, and while it waits, its second thread runs one on
//!   the duplicate; rank 1 runs the duplicate's first and the group's only after it returned. Rank 0's group
//!   call can only finish after the duplicate's did, so handles that serialised their calls (a lock held for
//!   a whole call, or the duplicate's kernel queued behind the group's on one stream) would end in the timeout.
//! - compile(): gradients with the gradient reduction overlapped on a `grad-reduce` thread (and, at
//!   `parameters`, the gathers prefetched on a thread) equal those reduced after backward with no thread,
//!   within 1e-6, at every level on 1 × 2 and 2 × 1; a recording shows the buckets came from the thread.
//!
//! Not yet run on a GPU: this file is type-checked (`scripts/cuda_typecheck.sh`) on a machine without one.

#![cfg(all(feature = "cuda", feature = "nccl"))]

use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use autosp::compile::{compile, Accumulation, Checkpointing, CompileConfig, GradReduction, Mesh, Strategy};
use autosp::core::comm::{run_ranks_fallible, Collective, NcclGroup, NcclId, ProcessGroup, RecordingGroup, ReduceOp};
use autosp::core::{CausalLm, CheckpointPolicy, ShardLevel};
use autosp::models::{random_weights, LlamaModel, TinySpec};
use autosp::DeviceSpec;
use candle_core::{DType, Device, Tensor};

/// The NCCL group's timeout: long enough for a first collective's connection set-up, short enough that a
/// deadlock ends the test in seconds.
const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `f` on two thread ranks, rank r on `cuda:r` with its handle on a two-rank NCCL group; panics naming
/// the rank that failed.
fn on_two_gpus<R: Send>(f: impl Fn(usize, Arc<dyn ProcessGroup>, &Device) -> Result<R, String> + Sync) -> Vec<R> {
    // Before any NCCL call of this process (NCCL reads its settings once); the other tests wait here.
    static CONNECT_UP_FRONT: Once = Once::new();
    CONNECT_UP_FRONT.call_once(|| {
        if std::env::var_os("NCCL_RUNTIME_CONNECT").is_none() {
            std::env::set_var("NCCL_RUNTIME_CONNECT", "0");
        }
    });
    let gpus = autosp::device::cuda_device_count();
    assert!(gpus >= 2, "this test needs two CUDA GPUs (one NCCL rank per GPU); this machine has {gpus}");
    let out = run_ranks_fallible(2, Duration::from_secs(60), |pg| -> Result<R, String> {
        let rank = pg.rank();
        let device = DeviceSpec::Cuda(Some(rank)).open(None).map_err(|e| e.to_string())?;
        let id = NcclId::share(pg.as_ref(), 0).map_err(|e| e.to_string())?;
        let nccl: Arc<dyn ProcessGroup> =
            Arc::new(NcclGroup::init(&device, rank, 2, id, TIMEOUT).map_err(|e| e.to_string())?);
        f(rank, nccl, &device)
    });
    out.into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r}: {e}")).unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// Rank `rank`'s tensor of `n` values on `device`: distinct per rank and element, exact in f32 sums.
fn values(rank: usize, n: usize, device: &Device) -> Tensor {
    let v: Vec<f32> = (0..n).map(|i| ((i * 7 + rank * 13) % 97) as f32 + rank as f32 * 0.5).collect();
    Tensor::from_vec(v, n, device).unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

/// The sum over both ranks of [`values`].
fn sum_of_ranks(n: usize) -> Vec<f32> {
    let (a, b) = (host(&values(0, n, &Device::Cpu)), host(&values(1, n, &Device::Cpu)));
    a.iter().zip(&b).map(|(x, y)| x + y).collect()
}

#[test]
fn the_duplicate_reduces_as_the_group_does() {
    let n = 1 << 16;
    on_two_gpus(|rank, nccl, device| {
        let dup = nccl.duplicate().map_err(|e| e.to_string())?;
        assert!(
            nccl.concurrent_handles() && dup.concurrent_handles(),
            "rank {rank}: the handles are not concurrent (stream-ordered allocation, NCCL_RUNTIME_CONNECT=0 and \
             NCCL_LAUNCH_ORDER_IMPLICIT unset are needed)"
        );
        let x = values(rank, n, device);
        let a = nccl.all_reduce(&x, ReduceOp::Sum).map_err(|e| e.to_string())?;
        let b = dup.all_reduce(&x, ReduceOp::Sum).map_err(|e| e.to_string())?;
        assert!(a.device().is_cuda() && b.device().is_cuda(), "rank {rank}: results on the GPU");
        assert_eq!(host(&a), sum_of_ranks(n), "rank {rank}: the group's sum");
        assert_eq!(host(&b), host(&a), "rank {rank}: the duplicate's sum differs from the group's");
        // bf16 (widened to f32 and rounded once) the same way on both handles.
        let xb = x.to_dtype(DType::BF16).unwrap();
        let (ab, bb) = (nccl.all_reduce(&xb, ReduceOp::Sum), dup.all_reduce(&xb, ReduceOp::Sum));
        let (ab, bb) = (ab.map_err(|e| e.to_string())?, bb.map_err(|e| e.to_string())?);
        assert_eq!(bb.dtype(), DType::BF16);
        assert_eq!(host(&bb), host(&ab), "rank {rank}: bf16 sums differ between the handles");
        Ok(())
    });
}

#[test]
fn a_group_call_and_a_duplicate_call_run_at_once() {
    let n = 1 << 20;
    let took = on_two_gpus(|rank, nccl, device| {
        let dup = nccl.duplicate().map_err(|e| e.to_string())?;
        // One call on each handle first, so that connection set-up is not part of what is timed.
        let warm = values(rank, 8, device);
        nccl.all_reduce(&warm, ReduceOp::Sum).map_err(|e| e.to_string())?;
        dup.all_reduce(&warm, ReduceOp::Sum).map_err(|e| e.to_string())?;
        let (x, y) = (values(rank, n, device), values(rank, n, device).affine(2.0, 1.0).unwrap());
        let start = Instant::now();
        let (on_group, on_dup) = if rank == 0 {
            std::thread::scope(|s| {
                let second = s.spawn(|| {
                    // The group's call is in flight by now (it cannot end before rank 1 gets to it).
                    std::thread::sleep(Duration::from_millis(500));
                    dup.all_reduce(&y, ReduceOp::Sum)
                });
                let a = nccl.all_reduce(&x, ReduceOp::Sum);
                (a, second.join().expect("the duplicate's thread panicked"))
            })
        } else {
            let b = dup.all_reduce(&y, ReduceOp::Sum);
            // Rank 0's group call has waited for this one since rank 0 entered it.
            (nccl.all_reduce(&x, ReduceOp::Sum), b)
        };
        let (a, b) = (on_group.map_err(|e| e.to_string())?, on_dup.map_err(|e| e.to_string())?);
        let want_y: Vec<f32> = {
            let (y0, y1) = (host(&values(0, n, &Device::Cpu)), host(&values(1, n, &Device::Cpu)));
            y0.iter().zip(&y1).map(|(p, q)| (2.0 * p + 1.0) + (2.0 * q + 1.0)).collect()
        };
        assert_eq!(host(&a), sum_of_ranks(n), "rank {rank}: the group's sum");
        assert_eq!(host(&b), want_y, "rank {rank}: the duplicate's sum");
        Ok(start.elapsed())
    });
    for (r, t) in took.iter().enumerate() {
        assert!(*t < TIMEOUT / 2, "rank {r}: the crossed calls took {t:?} (the handles waited for each other)");
    }
}

/// Buckets of 32 KiB: several per step on the tiny model.
const BUCKET_BYTES: usize = 32 << 10;

/// What one rank saw of a step.
struct Step {
    /// Whole gradients, model order.
    grads: Vec<Vec<f32>>,
    /// The names of the threads that made the gradient reductions (all-reduces and reduce-scatters of more
    /// than one element).
    threads: Vec<Option<String>>,
    /// The names of the threads that made the all-gathers.
    gatherers: Vec<Option<String>>,
}

/// One step of two micro-batches on `mesh` at `level` over `world`, the reduction overlapped (and the gathers
/// prefetched) or not.
fn nccl_step(
    world: Arc<dyn ProcessGroup>,
    device: &Device,
    mesh: Mesh,
    level: ShardLevel,
    overlap: bool,
) -> Result<Step, String> {
    let config = TinySpec::default().config();
    let weights = random_weights(&config, 5, DType::F32, device).map_err(|e| e.to_string())?;
    let model = LlamaModel::from_weights(&config, weights).map_err(|e| e.to_string())?;
    let recorder = RecordingGroup::new(world);
    let world: Arc<dyn ProcessGroup> = recorder.clone();
    let reduction = GradReduction { bucket_bytes: BUCKET_BYTES, overlap, ..GradReduction::default() };
    let cfg = CompileConfig::new(world, Strategy::Auto, Checkpointing::Policy(CheckpointPolicy::SequenceAware))
        .with_mesh(mesh)
        .with_sharding(level)
        .with_reduction(reduction)
        .with_prefetch_gathers(overlap);
    let c = compile(model, cfg).map_err(|e| e.to_string())?;
    recorder.clear();
    let vocab = c.model().dims().vocab;
    let micro = 2;
    let mut acc = Accumulation::new(micro);
    for m in 0..micro {
        let ids: Vec<u32> = (0..64u32).map(|i| (i * 13 + 7 + 11 * m as u32) % vocab as u32).collect();
        let labels: Vec<i64> =
            ids.iter().enumerate().map(|(i, &x)| if i % 32 < 2 + 3 * m { -100 } else { x as i64 }).collect();
        let ids = Tensor::from_vec(ids, (2, 32), &Device::Cpu).unwrap();
        let labels = Tensor::from_vec(labels, (2, 32), &Device::Cpu).unwrap();
        c.accumulate_step(&mut acc, &ids, Some(&labels), None, 1.0, m + 1 == micro).map_err(|e| e.to_string())?;
    }
    let grads = c.finish_accumulation(acc).map_err(|e| e.to_string())?;
    let records = recorder.records();
    let threads = records
        .iter()
        .filter(|r| matches!(r.collective, Collective::AllReduce | Collective::ReduceScatter) && r.elems > 1)
        .map(|r| r.thread.clone())
        .collect();
    let gatherers =
        records.iter().filter(|r| r.collective == Collective::AllGather).map(|r| r.thread.clone()).collect();
    let whole = c.whole_grads(&grads).map_err(|e| e.to_string())?;
    Ok(Step { grads: c.params().iter().map(|p| host(whole.get(p).unwrap())).collect(), threads, gatherers })
}

#[test]
fn overlapped_reduction_over_nccl_gives_the_gradients_of_the_reduction_after_backward() {
    on_two_gpus(|rank, nccl, device| {
        for mesh in [Mesh::new(1, 2), Mesh::new(2, 1)] {
            for level in ShardLevel::ALL {
                let what = format!("rank {rank}, {} × {}, {level}", mesh.data, mesh.sequence);
                let after = nccl_step(nccl.clone(), device, mesh, level, false)?;
                let overlapped = nccl_step(nccl.clone(), device, mesh, level, true)?;
                assert_eq!(overlapped.grads.len(), after.grads.len());
                for (i, (o, a)) in overlapped.grads.iter().zip(&after.grads).enumerate() {
                    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12) as f64;
                    let e = o.iter().zip(a).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale;
                    assert!(e <= 1e-6, "{what}: gradient {i} off by {e:e} with the reduction overlapped");
                }
                if level <= ShardLevel::Optimizer {
                    assert!(
                        overlapped.threads.iter().any(|t| t.as_deref() == Some("grad-reduce")),
                        "{what}: no bucket was reduced on the grad-reduce thread: {:?}",
                        overlapped.threads
                    );
                }
                if level == ShardLevel::Parameters {
                    assert!(
                        overlapped.gatherers.iter().any(|t| t.as_deref() == Some("gather-prefetch")),
                        "{what}: no block was gathered on the gather-prefetch thread: {:?}",
                        overlapped.gatherers
                    );
                }
            }
        }
        Ok(())
    });
}
