//! Multi-process check of the MPI back end: every collective against values each process computes on its
//! own, bit-identical agreement with the thread back end, exact byte counts, 2x2 subgroups, a ring step with
//! messages above MPI's eager limit, two handles communicating from two threads at once, a rank that calls another collective than the others (every rank must get
//! `OutOfStep`), and a rank that never arrives (the others must get the timeout error). Exits non-zero on the
//! first mismatch (without finalising, so mpirun stops the whole job at once).
//!
//! With `--fail-rank R` it checks instead that a failing rank stops the job: after one all_reduce, rank R
//! fails (calls `abort` with its error, as `llama_longctx` does) and exits with status 3; every other rank,
//! waiting in the next all_reduce with a 30 s timeout, must get `PeerFailed` naming R and its message within
//! 5 s, print `stopped after` and exit with status 3 too (status 2 if it got anything else). With
//! `--busy-ms M` as well, the other ranks compute (sleep) M ms before that all_reduce: past the failing rank's
//! 5 s grace they have not taken its notice, so it ends the whole job with `MPI_Abort` (the fallback).
//!
//! ```text
//! cargo build --release -p autosp-core --features mpi --example mpi_collectives
//! mpirun --allow-run-as-root --oversubscribe -np 4 target/release/examples/mpi_collectives
//! mpirun --allow-run-as-root --oversubscribe -np 2 target/release/examples/mpi_collectives --fail-rank 1
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use autosp_core::comm::{
    contiguous_groups, run_ranks, strided_groups, Collective, CommError, MpiGroup, PeerCall, ProcessGroup, ReduceOp,
};
use candle_core::{DType, Device, Tensor};

/// Guard against hangs in the checks that must succeed (generous: ranks may share one core).
const TIMEOUT: Duration = Duration::from_secs(30);
/// Timeout of the deliberately failing call, and the slack allowed on top of it.
const SHORT: Duration = Duration::from_secs(1);
const MARGIN: Duration = Duration::from_secs(1);

fn main() -> ExitCode {
    let world = match MpiGroup::init(TIMEOUT) {
        Ok(w) => Arc::new(w) as Arc<dyn ProcessGroup>,
        Err(e) => {
            eprintln!("mpi_collectives: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (rank, size) = (world.rank(), world.size());
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--fail-rank") {
        let Some(failing) = args.get(i + 1).and_then(|v| v.parse::<usize>().ok()).filter(|&r| r < size) else {
            eprintln!("mpi_collectives: --fail-rank needs a rank below {size}");
            return ExitCode::from(2);
        };
        let busy = args.iter().position(|a| a == "--busy-ms").and_then(|i| args.get(i + 1)?.parse::<u64>().ok());
        return fail_rank(&world, failing, Duration::from_millis(busy.unwrap_or(0)));
    }
    match check_all(&world) {
        Ok(checks) => {
            drop(world); // finalises MPI
            if rank == 0 {
                println!("mpi_collectives: {checks} checks passed on each of {size} ranks");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mpi_collectives: rank {rank} of {size} FAILED: {e:#}");
            std::process::exit(1);
        }
    }
}

/// `--fail-rank`: rank `failing` fails after one all_reduce; the others, after `busy` of work, must get
/// `PeerFailed` within 5 s.
fn fail_rank(world: &Arc<dyn ProcessGroup>, failing: usize, busy: Duration) -> ExitCode {
    let rank = world.rank();
    let x = Tensor::ones(16, DType::F32, &Device::Cpu).expect("a CPU tensor");
    if let Err(e) = world.all_reduce(&x, ReduceOp::Sum) {
        eprintln!("mpi_collectives: rank {rank}: the first all_reduce failed: {e}");
        return ExitCode::from(2);
    }
    let message = format!("injected failure on rank {failing} (mpi_collectives --fail-rank)");
    if rank == failing {
        // Let the others leave the first all_reduce (this rank can finish it while they are still in its last
        // round): the failure must reach them in the next call, or during their `busy` work.
        std::thread::sleep(Duration::from_millis(500));
        eprintln!("mpi_collectives: rank {rank}: {message}");
        world.abort(&message);
        return ExitCode::from(3);
    }
    std::thread::sleep(busy);
    let start = Instant::now();
    let res = world.all_reduce(&x, ReduceOp::Sum);
    let took = start.elapsed();
    match res {
        Err(e @ CommError::PeerFailed { .. }) if took < Duration::from_secs(5) => {
            let CommError::PeerFailed { peer, message: got, .. } = &e else { unreachable!() };
            if *peer != failing || !got.contains(&message) {
                eprintln!("mpi_collectives: rank {rank}: PeerFailed names the wrong rank or message: {e}");
                return ExitCode::from(2);
            }
            println!("mpi_collectives: rank {rank} stopped after {took:?}: {e}");
            ExitCode::from(3)
        }
        other => {
            eprintln!("mpi_collectives: rank {rank}: expected PeerFailed from rank {failing} within 5 s, got {other:?} after {took:?}");
            ExitCode::from(2)
        }
    }
}

/// Deterministic per-rank data with magnitudes from 0.01 to 100 (summation order shows in the rounding).
fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13) as f32 * 0.731).sin() * 10f32.powi((i % 5) as i32 - 2)).collect()
}

/// Rank `rank`'s all_reduce input: a non-contiguous [5, 7] (transpose of [7, 5]) in `dtype`.
fn reduce_input(rank: usize, dtype: DType) -> candle_core::Result<Tensor> {
    let mut v = values(rank, 35);
    if !dtype.is_float() {
        v = v.iter().map(|x| (x * 7.0).round()).collect();
    }
    Tensor::from_vec(v, (7, 5), &Device::Cpu)?.t()?.to_dtype(dtype)
}

fn as_f64(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

/// Rank-order reduction computed here, element by element (f32 and bf16 accumulate in f32).
fn expected(inputs: &[Vec<f64>], dtype: DType, op: ReduceOp) -> Vec<f64> {
    (0..inputs[0].len())
        .map(|i| {
            let col: Vec<f64> = inputs.iter().map(|v| v[i]).collect();
            match (op, dtype) {
                (ReduceOp::Max, _) => col.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                (ReduceOp::Sum, DType::F32) => col[1..].iter().fold(col[0] as f32, |a, &x| a + x as f32) as f64,
                (ReduceOp::Sum, DType::BF16) => {
                    let s = col[1..].iter().fold(col[0] as f32, |a, &x| a + x as f32);
                    half::bf16::from_f32(s).to_f64()
                }
                (ReduceOp::Sum, _) => col[1..].iter().fold(col[0], |a, &x| a + x),
            }
        })
        .collect()
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_all(world: &Arc<dyn ProcessGroup>) -> Result<usize> {
    let (rank, size) = (world.rank(), world.size());
    let dev = &Device::Cpu;
    let mut checks = 0;

    // all_reduce: independent reference, and the same bits as the thread back end.
    for (dtype, op) in [
        (DType::F32, ReduceOp::Sum),
        (DType::BF16, ReduceOp::Sum),
        (DType::I64, ReduceOp::Sum),
        (DType::F64, ReduceOp::Max),
    ] {
        let got = as_f64(&world.all_reduce(&reduce_input(rank, dtype)?, op)?)?;
        let inputs = (0..size).map(|r| as_f64(&reduce_input(r, dtype)?)).collect::<Result<Vec<_>>>()?;
        ensure!(bits(&got) == bits(&expected(&inputs, dtype, op)), "all_reduce {dtype:?} {op:?}: {got:?}");
        let threads = run_ranks(size, TIMEOUT, |pg| -> Result<Vec<f64>> {
            as_f64(&pg.all_reduce(&reduce_input(pg.rank(), dtype)?, op)?)
        });
        let theirs = threads.into_iter().nth(rank).context("thread rank")???;
        ensure!(bits(&got) == bits(&theirs), "all_reduce {dtype:?} {op:?} differs from the thread back end");
        checks += 2;
    }

    // all_gather of uneven shards [2, r + 1] along dim 1 (value 100 r + flat index).
    let shard = |r: usize| -> candle_core::Result<Tensor> {
        let v: Vec<f32> = (0..2 * (r + 1)).map(|i| (100 * r + i) as f32).collect();
        Tensor::from_vec(v, (2, r + 1), dev)
    };
    let g = world.all_gather(&shard(rank)?, 1)?;
    let want: Vec<f64> = (0..2)
        .flat_map(|b| (0..size).flat_map(move |r| (0..r + 1).map(move |k| (100 * r + b * (r + 1) + k) as f64)))
        .collect();
    ensure!(as_f64(&g)? == want, "all_gather: {:?}", as_f64(&g)?);
    checks += 1;

    // reduce_scatter along dim 0 of [3 P, 4]: rank r keeps rows 3r..3r+3 of the rank-order sum.
    let rs_input = |r: usize| Tensor::from_vec(values(r, 12 * size), (3 * size, 4), dev);
    let got = as_f64(&world.reduce_scatter(&rs_input(rank)?, 0, ReduceOp::Sum)?)?;
    let inputs = (0..size).map(|r| as_f64(&rs_input(r)?)).collect::<Result<Vec<_>>>()?;
    let full = expected(&inputs, DType::F32, ReduceOp::Sum);
    ensure!(bits(&got) == bits(&full[12 * rank..12 * (rank + 1)]), "reduce_scatter: {got:?}");
    checks += 1;

    // all_to_all: rank i sends rank j a [i + 1, j + 2] tensor of value 100 i + j, f64 to even j, u32 to odd.
    let piece = |i: usize, j: usize| -> candle_core::Result<Tensor> {
        let t = Tensor::full((100 * i + j) as f64, (i + 1, j + 2), dev)?;
        t.to_dtype(if j.is_multiple_of(2) { DType::F64 } else { DType::U32 })
    };
    let outs = world.all_to_all((0..size).map(|j| piece(rank, j)).collect::<candle_core::Result<_>>()?)?;
    for (j, t) in outs.iter().enumerate() {
        let dtype = if rank % 2 == 0 { DType::F64 } else { DType::U32 };
        ensure!(t.dims() == [j + 1, rank + 2] && t.dtype() == dtype, "all_to_all from {j}: {t:?}");
        ensure!(as_f64(t)?.iter().all(|&v| v == (100 * j + rank) as f64), "all_to_all from {j}");
    }
    checks += 1;

    // Ring: P send_recv steps of a 1 MiB block (above the eager limit, so sends need the receiver).
    let mut block = Tensor::full(rank as f32, 256 * 1024, dev)?;
    for step in 1..=size {
        block = world.send_recv(&block, (rank + 1) % size, (rank + size - 1) % size)?;
        let from = (rank + 2 * size - step) % size;
        ensure!(block.max(0)?.to_scalar::<f32>()? == from as f32, "ring step {step}");
        ensure!(block.min(0)?.to_scalar::<f32>()? == from as f32, "ring step {step}");
    }
    checks += 1;

    // The same ring with started steps: the 1 MiB transfer is under way while this rank computes.
    let mut work = Tensor::ones((64, 64), DType::F32, dev)?;
    for step in 1..=size {
        let pending = world.start_send_recv(&block, (rank + 1) % size, (rank + size - 1) % size)?;
        work = work.matmul(&work)?.affine(1.0 / 64.0, 0.)?;
        block = pending.wait()?;
        let from = (rank + 2 * size - step) % size;
        ensure!(block.max(0)?.to_scalar::<f32>()? == from as f32, "started ring step {step}");
    }
    ensure!(work.max(0)?.max(0)?.to_scalar::<f32>()? == 1.0, "compute during the ring");
    checks += 1;

    // Point to point: rank 0 sends two messages to every other rank, which receive them in order.
    if rank == 0 {
        for dst in 1..size {
            world.send(&Tensor::new(&[dst as u32, 1], dev)?, dst)?;
            world.send(&Tensor::new(&[dst as u32, 2], dev)?, dst)?;
        }
    } else {
        for k in 1..=2u32 {
            let got = world.recv(0)?.to_vec1::<u32>()?;
            ensure!(got == vec![rank as u32, k], "recv {k}: {got:?}");
        }
    }
    world.barrier()?;
    checks += 1;

    // Exact byte counts of one all_reduce of 48 f32 elements: (n + (P-2) c_r) s.
    world.reset_stats();
    world.all_reduce(&Tensor::zeros((8, 6), DType::F32, dev)?, ReduceOp::Sum)?;
    let c_r = 48 / size + usize::from(rank < 48 % size);
    let want_bytes = ((48 + (size as i64 - 2) * c_r as i64) * 4) as u64;
    let s = world.stats();
    ensure!(
        (s.calls(Collective::AllReduce), s.total_bytes_sent()) == (1, want_bytes),
        "stats: {s:?}, want 1 call and {want_bytes} bytes"
    );
    checks += 1;

    // 2x2 layout: consecutive groups and their orthogonal groups.
    if size % 2 == 0 {
        let inner = world.split(&contiguous_groups(size, 2)?)?;
        let outer = world.split(&strided_groups(size, 2)?)?;
        let me = Tensor::new(&[rank as f32], dev)?;
        let gi = inner.all_gather(&me, 0)?.to_vec1::<f32>()?;
        let go = outer.all_gather(&me, 0)?.to_vec1::<f32>()?;
        let base = (rank / 2 * 2) as f32;
        ensure!(gi == vec![base, base + 1.], "inner group: {gi:?}");
        let want: Vec<f32> = (0..size / 2).map(|g| (2 * g + rank % 2) as f32).collect();
        ensure!(go == want, "orthogonal group: {go:?}");
        checks += 2;
    }

    // Two handles at once (a duplicate on a second thread, as the gradient reduction and the gather prefetch
    // use it): rank 0's main thread enters an all_reduce on `a` first, then its second thread one on the
    // duplicate `b`; the other ranks do `b` first and enter `a` only once `b` completed. `b` completes only
    // if rank 0's waiting call on `a` lets the other thread's call progress; if one call held MPI for its whole
    // wait, `a` would time out (5 s). Each result is checked against the sum of the ranks' values.
    {
        let a = world.split(&[(0..size).collect()])?;
        let b = a.duplicate()?;
        ensure!(a.concurrent_handles(), "the MPI transport must allow two handles at once");
        a.set_timeout(Duration::from_secs(5));
        b.set_timeout(Duration::from_secs(5));
        let value = |base: f32| Tensor::full(base + rank as f32, 1024, dev);
        let sum = |base: f32| (0..size).map(|r| base + r as f32).sum::<f32>();
        let (on_a, on_b) = std::thread::scope(|s| -> Result<(f32, f32)> {
            if rank == 0 {
                let second = s.spawn(|| -> Result<f32> {
                    std::thread::sleep(Duration::from_millis(100));
                    Ok(b.all_reduce(&value(1000.)?, ReduceOp::Sum)?.max(0)?.to_scalar::<f32>()?)
                });
                let on_a = a.all_reduce(&value(0.)?, ReduceOp::Sum)?.max(0)?.to_scalar::<f32>()?;
                let on_b = second.join().map_err(|_| anyhow::anyhow!("the second thread panicked"))??;
                Ok((on_a, on_b))
            } else {
                let on_b = b.all_reduce(&value(1000.)?, ReduceOp::Sum)?.max(0)?.to_scalar::<f32>()?;
                let on_a = a.all_reduce(&value(0.)?, ReduceOp::Sum)?.max(0)?.to_scalar::<f32>()?;
                Ok((on_a, on_b))
            }
        })?;
        ensure!((on_a, on_b) == (sum(0.), sum(1000.)), "two handles at once: {on_a}, {on_b}");
        checks += 1;
    }

    // Rank 1 calls all_gather where the others call all_to_all (each sends [2]-tensors to every rank, so the
    // calls would pair silently by call number alone): every rank must get OutOfStep naming both operations
    // and the call number, and the group is poisoned. On a group of its own, so the world stays usable.
    if size >= 2 {
        let skewed = world.split(&[(0..size).collect()])?;
        let x = Tensor::full(rank as f32, 2, dev)?;
        let res =
            if rank == 1 { skewed.all_gather(&x, 0).map(|_| ()) } else { skewed.all_to_all(vec![x; size]).map(|_| ()) };
        let (mine, want): (Collective, Vec<PeerCall>) = if rank == 1 {
            let others = (0..size).filter(|&r| r != 1);
            (
                Collective::AllGather,
                others.map(|r| PeerCall { rank: r, collective: Collective::AllToAll, call: 0 }).collect(),
            )
        } else {
            (Collective::AllToAll, vec![PeerCall { rank: 1, collective: Collective::AllGather, call: 0 }])
        };
        match res {
            Err(CommError::OutOfStep { collective, call: 0, others, .. }) if collective == mine && others == want => {}
            other => anyhow::bail!("expected OutOfStep ({mine} against {want:?}), got {other:?}"),
        }
        let again = skewed.barrier();
        ensure!(matches!(again, Err(CommError::Poisoned { .. })), "after OutOfStep: {again:?}");
        checks += 2;
    }

    // The last rank never joins: the others must get a timeout naming it, within the timeout.
    if size >= 2 {
        let doomed = world.split(&[(0..size).collect()])?;
        doomed.set_timeout(SHORT);
        if rank != size - 1 {
            let start = Instant::now();
            let res = doomed.all_reduce(&Tensor::ones(4, DType::F32, dev)?, ReduceOp::Sum);
            let took = start.elapsed();
            match res {
                Err(CommError::Timeout { collective: Collective::AllReduce, missing, .. })
                    if missing == vec![size - 1] => {}
                other => {
                    anyhow::bail!("expected a timeout naming rank {}, got {other:?}", size - 1)
                }
            }
            ensure!(took < SHORT + MARGIN, "the timeout came after {took:?}");
            let again = doomed.barrier();
            ensure!(matches!(again, Err(CommError::Poisoned { .. })), "after the timeout: {again:?}");
            checks += 2;
        }
        world.barrier()?;
    }
    Ok(checks)
}
