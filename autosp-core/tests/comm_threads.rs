//! The in-process (thread) back end of `ProcessGroup`: every collective against values computed here
//! independently, for P = 1..4 ranks; exact statistics; subgroups; and failures (a rank that returns,
//! panics or arrives too late) that must end in an error naming the collective, group and rank, never a hang.
//!
//! Every correctness test runs with a 10 s group timeout, so a bug ends in a timeout error, not a hang.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use autosp_core::comm::{
    all_reduce_bytes, contiguous_groups, run_ranks, run_ranks_fallible, strided_groups, Collective, CommError,
    Departure, PeerCall, ProcessGroup, ReduceOp,
};
use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};

/// Group timeout for tests that must succeed: only a guard against hangs.
const GUARD: Duration = Duration::from_secs(10);
/// Group timeout for the failure tests.
const SHORT: Duration = Duration::from_secs(1);
/// Slack allowed on top of a timeout before an error counts as late (thread wake-up, 2 shared CPU cores).
const MARGIN: Duration = Duration::from_millis(700);

/// Runs `f` on `p` ranks and unwraps every rank's result, naming the failed rank.
fn run<R: Send>(p: usize, timeout: Duration, f: impl Fn(Arc<dyn ProcessGroup>) -> Result<R> + Sync) -> Vec<R> {
    run_ranks(p, timeout, f)
        .into_iter()
        .enumerate()
        .map(|(rank, r)| match r {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => panic!("rank {rank} of {p} failed: {e:#}"),
            Err(e) => panic!("rank {rank} of {p}: {e}"),
        })
        .collect()
}

/// Deterministic per-rank data with magnitudes from 0.01 to 100, so that the summation order shows in the
/// rounding.
fn values(rank: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((i * 7 + rank * 13 + salt * 31) as f32 * 0.731).sin();
            x * 10f32.powi((i % 5) as i32 - 2)
        })
        .collect()
}

/// Rank `rank`'s input of the reduction tests: `dims` (built as the transpose of a contiguous tensor when
/// `transposed`, so the collective sees a non-contiguous input), in `dtype`.
fn input(rank: usize, dims: &[usize], dtype: DType, transposed: bool) -> candle_core::Result<Tensor> {
    let n: usize = dims.iter().product();
    let mut v = values(rank, n, 1);
    if !dtype.is_float() {
        v = v.iter().map(|x| (x * 7.0).round().abs()).collect();
    }
    let t = if transposed {
        let rev: Vec<usize> = dims.iter().rev().copied().collect();
        Tensor::from_vec(v, rev, &Device::Cpu)?.t()?
    } else {
        Tensor::from_vec(v, dims, &Device::Cpu)?
    };
    t.to_dtype(dtype)
}

/// Logical values of a tensor as f64 (exact for every dtype used here).
fn as_f64(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()
}

/// The reduction the group must produce, computed element by element in rank order in the dtype's own
/// arithmetic (bf16/f16: f32 accumulation, rounded once).
fn expected_reduce(inputs: &[Vec<f64>], dtype: DType, op: ReduceOp) -> Vec<f64> {
    (0..inputs[0].len())
        .map(|i| {
            let column = inputs.iter().map(|v| v[i]);
            if op == ReduceOp::Max {
                return column.fold(f64::NEG_INFINITY, f64::max);
            }
            match dtype {
                DType::F64 | DType::U32 | DType::I64 => {
                    column.fold(None, |acc: Option<f64>, x| Some(acc.map_or(x, |a| a + x)))
                }
                DType::F32 | DType::BF16 | DType::F16 => column
                    .map(|x| x as f32)
                    .fold(None, |acc: Option<f32>, x| Some(acc.map_or(x, |a| a + x)))
                    .map(|s| match dtype {
                        DType::BF16 => bf16::from_f32(s).to_f64(),
                        DType::F16 => f16::from_f32(s).to_f64(),
                        _ => s as f64,
                    }),
                other => panic!("no reference for {other:?}"),
            }
            .unwrap()
        })
        .collect()
}

fn same_bits(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn all_reduce_is_the_rank_order_reduction_on_every_rank() {
    let cases: &[(DType, &[usize], bool)] = &[
        (DType::F32, &[5, 7], false),
        (DType::F32, &[6, 4], true),
        (DType::F32, &[3], false),
        (DType::F32, &[], false),
        (DType::F64, &[2, 3, 4], false),
        (DType::BF16, &[33], false),
        (DType::F16, &[4, 5], true),
        (DType::U32, &[9], false),
        (DType::I64, &[2, 5], false),
    ];
    for p in 1..=4 {
        for &(dtype, dims, transposed) in cases {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let inputs: Vec<Vec<f64>> =
                    (0..p).map(|r| as_f64(&input(r, dims, dtype, transposed).unwrap())).collect();
                let want = expected_reduce(&inputs, dtype, op);
                let outs = run(p, GUARD, |pg| {
                    let x = input(pg.rank(), dims, dtype, transposed)?;
                    let y = pg.all_reduce(&x, op)?;
                    assert_eq!((y.dims(), y.dtype()), (x.dims(), x.dtype()));
                    Ok(as_f64(&y))
                });
                for (rank, got) in outs.iter().enumerate() {
                    assert!(
                        same_bits(got, &want),
                        "P={p} {dtype:?} {dims:?} transposed={transposed} {op:?}: rank {rank} got {got:?}, \
                         want {want:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn all_gather_concatenates_uneven_shards_in_rank_order() {
    for p in 1..=4 {
        // Rank r holds [2, r + 1, 3] with values 1000 r + index; gathered along dim 1.
        let shard = |r: usize| -> candle_core::Result<Tensor> {
            let n = 2 * (r + 1) * 3;
            let v: Vec<f32> = (0..n).map(|i| (1000 * r + i) as f32).collect();
            Tensor::from_vec(v, (2, r + 1, 3), &Device::Cpu)
        };
        let mut want = Vec::new();
        for b in 0..2 {
            for r in 0..p {
                for k in 0..(r + 1) {
                    for c in 0..3 {
                        want.push((1000 * r + (b * (r + 1) + k) * 3 + c) as f64);
                    }
                }
            }
        }
        let width: usize = (1..=p).sum();
        let outs = run(p, GUARD, |pg| {
            let y = pg.all_gather(&shard(pg.rank())?, 1)?;
            assert_eq!(y.dims(), &[2, width, 3]);
            // bf16 along dim 0, from a non-contiguous input.
            let z = Tensor::full(pg.rank() as f32 + 0.5, (2, 3), &Device::Cpu)?.t()?.to_dtype(DType::BF16)?;
            let g = pg.all_gather(&z, 0)?;
            assert_eq!(g.dims(), &[3 * pg.size(), 2]);
            Ok((as_f64(&y), as_f64(&g)))
        });
        let want_g: Vec<f64> = (0..p).flat_map(|r| vec![r as f64 + 0.5; 6]).collect();
        for (rank, (y, g)) in outs.iter().enumerate() {
            assert_eq!(y, &want, "P={p} rank {rank}");
            assert_eq!(g, &want_g, "P={p} rank {rank}");
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_reduced_chunk() {
    for p in 1..=4 {
        let dims = [3 * p, 4];
        let inputs: Vec<Vec<f64>> = (0..p).map(|r| as_f64(&input(r, &dims, DType::F32, false).unwrap())).collect();
        let full = expected_reduce(&inputs, DType::F32, ReduceOp::Sum);
        // Along dim 1 of a non-contiguous [2, 2p] tensor, with max.
        let dims1 = [2, 2 * p];
        let inputs1: Vec<Vec<f64>> = (0..p).map(|r| as_f64(&input(r, &dims1, DType::F32, true).unwrap())).collect();
        let full1 = expected_reduce(&inputs1, DType::F32, ReduceOp::Max);
        let outs = run(p, GUARD, |pg| {
            let x = input(pg.rank(), &dims, DType::F32, false)?;
            let y = pg.reduce_scatter(&x, 0, ReduceOp::Sum)?;
            assert_eq!(y.dims(), &[3, 4]);
            let x1 = input(pg.rank(), &dims1, DType::F32, true)?;
            let y1 = pg.reduce_scatter(&x1, 1, ReduceOp::Max)?;
            assert_eq!(y1.dims(), &[2, 2]);
            Ok((as_f64(&y), as_f64(&y1)))
        });
        for (r, (y, y1)) in outs.iter().enumerate() {
            assert!(same_bits(y, &full[r * 12..(r + 1) * 12]), "P={p} rank {r}");
            let want1: Vec<f64> =
                (0..2).flat_map(|i| (0..2).map(move |j| (i, j))).map(|(i, j)| full1[i * 2 * p + 2 * r + j]).collect();
            assert_eq!(y1, &want1, "P={p} rank {r}");
        }
    }
}

#[test]
fn all_to_all_routes_uneven_tensors_between_every_pair() {
    // Rank i sends rank j a [i + 1, j + 2] tensor of value 100 i + j + k / 100 at flat index k.
    let piece = |i: usize, j: usize| -> candle_core::Result<Tensor> {
        let v: Vec<f64> = (0..(i + 1) * (j + 2)).map(|k| (100 * i + j) as f64 + k as f64 / 100.0).collect();
        Tensor::from_vec(v, (i + 1, j + 2), &Device::Cpu)
    };
    for p in 1..=4 {
        let outs = run(p, GUARD, |pg| {
            let r = pg.rank();
            let inputs = (0..p).map(|j| piece(r, j)).collect::<candle_core::Result<_>>()?;
            let outputs = pg.all_to_all(inputs)?;
            Ok(outputs.iter().map(|t| (t.dims().to_vec(), as_f64(t))).collect::<Vec<_>>())
        });
        for (r, outputs) in outs.iter().enumerate() {
            assert_eq!(outputs.len(), p);
            for (j, (dims, vals)) in outputs.iter().enumerate() {
                assert_eq!(dims, &[j + 1, r + 2], "P={p}: rank {r}, from rank {j}");
                let want: Vec<f64> = (0..(j + 1) * (r + 2)).map(|k| (100 * j + r) as f64 + k as f64 / 100.0).collect();
                assert_eq!(vals, &want, "P={p}: rank {r}, from rank {j}");
            }
        }
    }
}

#[test]
fn send_recv_rotates_blocks_around_the_ring() {
    for p in 1..=4 {
        let outs = run(p, GUARD, |pg| {
            let (r, p) = (pg.rank(), pg.size());
            let mut block = Tensor::full(r as f32, (2, 3), &Device::Cpu)?;
            let mut seen = vec![];
            for _ in 0..p {
                block = pg.send_recv(&block, (r + 1) % p, (r + p - 1) % p)?;
                seen.push(block.flatten_all()?.to_vec1::<f32>()?[0] as usize);
            }
            Ok(seen)
        });
        for (r, seen) in outs.iter().enumerate() {
            // After step k the block of rank r - k has arrived; after P steps the own block is back.
            let want: Vec<usize> = (1..=p).map(|k| (r + p * 2 - k) % p).collect();
            assert_eq!(seen, &want, "P={p} rank {r}");
        }
    }
}

#[test]
fn started_ring_steps_overlap_with_compute_and_count_as_send_recv() {
    for p in 1..=4 {
        let outs = run(p, GUARD, |pg| {
            let (r, p) = (pg.rank(), pg.size());
            let mut block = Tensor::full(r as f32, 64, &Device::Cpu)?;
            let mut seen = vec![];
            let mut work = Tensor::ones((32, 32), DType::F32, &Device::Cpu)?;
            for _ in 0..p {
                let step = pg.start_send_recv(&block, (r + 1) % p, (r + p - 1) % p)?;
                // Compute on the current block while the next one travels.
                work = work.matmul(&work)?.affine(1.0 / 32.0, 0.)?;
                block = step.wait()?;
                seen.push(block.max(0)?.to_scalar::<f32>()? as usize);
            }
            assert_eq!(work.max_keepdim(0)?.max_keepdim(1)?.flatten_all()?.to_vec1::<f32>()?, vec![1.0]);
            let s = pg.stats();
            let bytes = if p == 1 { 0 } else { 64 * 4 * p as u64 };
            assert_eq!((s.calls(Collective::SendRecv), s.total_bytes_sent()), (p as u64, bytes));
            Ok(seen)
        });
        for (r, seen) in outs.iter().enumerate() {
            let want: Vec<usize> = (1..=p).map(|k| (r + p * 2 - k) % p).collect();
            assert_eq!(seen, &want, "P={p} rank {r}");
        }
    }
}

#[test]
fn send_and_recv_keep_the_order_of_messages() {
    let outs = run(3, GUARD, |pg| {
        let r = pg.rank();
        if r == 0 {
            for dst in 1..3 {
                for k in 0..3 {
                    pg.send(&Tensor::new(&[(10 * dst + k) as u32], &Device::Cpu)?, dst)?;
                }
            }
            Ok(vec![])
        } else {
            (0..3).map(|_| Ok(pg.recv(0)?.to_vec1::<u32>()?[0])).collect::<Result<Vec<_>>>()
        }
    });
    assert_eq!(outs[1], vec![10, 11, 12]);
    assert_eq!(outs[2], vec![20, 21, 22]);
}

#[test]
fn barrier_waits_for_the_last_rank() {
    let start = Instant::now();
    let outs = run(3, GUARD, |pg| {
        if pg.rank() == 2 {
            std::thread::sleep(Duration::from_millis(300));
        }
        pg.barrier()?;
        Ok(start.elapsed())
    });
    for (r, t) in outs.iter().enumerate() {
        assert!(*t >= Duration::from_millis(300), "rank {r} left the barrier after {t:?}");
    }
}

#[test]
fn two_by_two_subgroups_inner_and_orthogonal() {
    let outs = run(4, GUARD, |pg| {
        let r = pg.rank();
        let inner = pg.split(&contiguous_groups(4, 2)?)?;
        let outer = pg.split(&strided_groups(4, 2)?)?;
        assert_eq!((inner.rank(), inner.size()), (r % 2, 2));
        assert_eq!((outer.rank(), outer.size()), (r / 2, 2));
        let me = Tensor::new(&[r as f32], &Device::Cpu)?;
        let gi = inner.all_gather(&me, 0)?.to_vec1::<f32>()?;
        let go = outer.all_gather(&me, 0)?.to_vec1::<f32>()?;
        let si = inner.all_reduce(&me, ReduceOp::Sum)?.to_vec1::<f32>()?;
        // A ring step inside the orthogonal group swaps the two members.
        let swapped = outer.send_recv(&me, 1 - outer.rank(), 1 - outer.rank())?;
        // A custom order: listed position decides the subgroup rank.
        let custom = pg.split(&[vec![3, 1], vec![0, 2]])?;
        let gc = custom.all_gather(&me, 0)?.to_vec1::<f32>()?;
        // Subgroups of a subgroup.
        let single = inner.split(&[vec![0], vec![1]])?;
        let ss = single.all_reduce(&me, ReduceOp::Sum)?.to_vec1::<f32>()?;
        Ok((
            gi,
            go,
            si,
            swapped.to_vec1::<f32>()?,
            (custom.rank(), gc),
            ss,
            [inner.name().to_string(), outer.name().to_string()],
        ))
    });
    for (r, (gi, go, si, swapped, (crank, gc), ss, names)) in outs.into_iter().enumerate() {
        let g = (r / 2) as f32;
        assert_eq!(gi, vec![2. * g, 2. * g + 1.], "rank {r}");
        let i = (r % 2) as f32;
        assert_eq!(go, vec![i, i + 2.], "rank {r}");
        assert_eq!(si, vec![4. * g + 1.], "rank {r}");
        assert_eq!(swapped, vec![((r + 2) % 4) as f32], "rank {r}");
        let (want_rank, want_gc) = match r {
            3 => (0, vec![3., 1.]),
            1 => (1, vec![3., 1.]),
            0 => (0, vec![0., 2.]),
            _ => (1, vec![0., 2.]),
        };
        assert_eq!((crank, gc), (want_rank, want_gc), "rank {r}");
        assert_eq!(ss, vec![r as f32]);
        assert!(names[0].contains("world/split0") && names[1].contains("world/split1"), "{names:?}");
        assert_ne!(names[0], names[1]);
    }
}

#[test]
fn stats_count_calls_and_bytes_exactly() {
    let outs = run(4, GUARD, |pg| {
        let r = pg.rank();
        let dev = &Device::Cpu;
        let x = Tensor::zeros((8, 6), DType::F32, dev)?; // 48 elements, 192 bytes
        pg.all_reduce(&x, ReduceOp::Sum)?;
        pg.all_reduce(&Tensor::zeros(10, DType::F32, dev)?, ReduceOp::Max)?; // chunks 3,3,2,2
        pg.all_gather(&Tensor::zeros((3, 2), DType::BF16, dev)?, 0)?; // 12 bytes
        pg.reduce_scatter(&x, 0, ReduceOp::Sum)?;
        let pieces =
            (0..4).map(|j| Tensor::zeros((r + 1, j + 2), DType::F64, dev)).collect::<candle_core::Result<_>>()?;
        pg.all_to_all(pieces)?;
        pg.send_recv(&Tensor::zeros(5, DType::I64, dev)?, (r + 1) % 4, (r + 3) % 4)?;
        if r == 0 {
            pg.send(&Tensor::zeros(7, DType::U32, dev)?, 1)?;
        }
        if r == 1 {
            pg.recv(0)?;
        }
        pg.barrier()?;
        let before_split = pg.stats();
        let sub = pg.split(&contiguous_groups(4, 2)?)?;
        sub.all_gather(&Tensor::zeros(4, DType::F32, dev)?, 0)?;
        let (world, subs) = (pg.stats(), sub.stats());
        pg.reset_stats();
        Ok((before_split, world, subs, pg.stats()))
    });
    for (r, (s, world, sub, reset)) in outs.into_iter().enumerate() {
        for kind in [
            Collective::AllGather,
            Collective::ReduceScatter,
            Collective::AllToAll,
            Collective::SendRecv,
            Collective::Barrier,
        ] {
            assert_eq!(s.calls(kind), 1, "rank {r} {kind}");
        }
        assert_eq!(s.calls(Collective::AllReduce), 2, "rank {r}");
        assert_eq!(s.calls(Collective::Send), u64::from(r == 0));
        assert_eq!(s.calls(Collective::Recv), u64::from(r == 1));
        assert_eq!(s.calls(Collective::Split), 0);
        assert_eq!(s.total_calls(), 7 + u64::from(r <= 1), "rank {r}");
        // all_reduce: 2 (P-1)/P n s = 2 * 3/4 * 48 * 4 = 288 for the first; the second, n = 10 in chunks
        // 3,3,2,2 of 4 bytes: (n + (P-2) c_r) s = (10 + 2 * 3) * 4 = 64 for ranks 0,1 and 56 for ranks 2,3.
        let second = if r < 2 { 64 } else { 56 };
        assert_eq!(s.bytes_sent(Collective::AllReduce), 288 + second, "rank {r}");
        assert_eq!(all_reduce_bytes(48, 4, r, 4) + all_reduce_bytes(10, 4, r, 4), 288 + second, "rank {r}");
        assert_eq!(s.bytes_sent(Collective::AllGather), 3 * 12);
        assert_eq!(s.bytes_sent(Collective::ReduceScatter), 3 * 192 / 4);
        // all_to_all: (r + 1)(j + 2) f64s to each j != r.
        let a2a: u64 = (0..4).filter(|&j| j != r).map(|j| ((r + 1) * (j + 2) * 8) as u64).sum();
        assert_eq!(s.bytes_sent(Collective::AllToAll), a2a, "rank {r}");
        assert_eq!(s.bytes_sent(Collective::SendRecv), 40);
        assert_eq!(s.bytes_sent(Collective::Send), if r == 0 { 28 } else { 0 });
        assert_eq!(s.bytes_sent(Collective::Recv), 0);
        assert_eq!(s.bytes_sent(Collective::Barrier), 0);
        let total = 288 + second + 36 + 144 + a2a + 40 + if r == 0 { 28 } else { 0 };
        assert_eq!(s.total_bytes_sent(), total, "rank {r}");
        // split: the group list [2, 2, 0, 1, 2, 2, 3] as i64 to the 3 others: 3 * 7 * 8 = 168 bytes.
        assert_eq!(world.calls(Collective::Split), 1);
        assert_eq!(world.bytes_sent(Collective::Split), 168);
        assert_eq!(world.calls(Collective::AllGather), 1, "subgroup calls stay on the subgroup");
        assert_eq!((sub.calls(Collective::AllGather), sub.bytes_sent(Collective::AllGather)), (1, 16));
        assert_eq!(sub.total_calls(), 1);
        assert_eq!((reset.total_calls(), reset.total_bytes_sent()), (0, 0));
    }
}

#[test]
fn concurrent_candle_work_on_every_rank_does_not_deadlock() {
    // Each rank runs rayon-parallel candle kernels (matmul, softmax-like reductions) between collectives.
    let a = Tensor::arange(0f32, 96. * 96., &Device::Cpu).unwrap().reshape((96, 96)).unwrap().affine(1e-4, 0.).unwrap();
    let single: Vec<f32> = {
        let mut total = Tensor::zeros((96, 96), DType::F32, &Device::Cpu).unwrap();
        for r in 0..4 {
            let local = a.affine(1.0, r as f64).unwrap().matmul(&a).unwrap();
            total = total.add(&local).unwrap();
        }
        total.flatten_all().unwrap().to_vec1().unwrap()
    };
    let outs = run(4, GUARD, |pg| {
        let mut last = Vec::new();
        for _ in 0..5 {
            let local = a.affine(1.0, pg.rank() as f64)?.matmul(&a)?;
            let sum = pg.all_reduce(&local, ReduceOp::Sum)?;
            last = sum.flatten_all()?.to_vec1::<f32>()?;
        }
        Ok(last)
    });
    for (r, got) in outs.iter().enumerate() {
        assert_eq!(got, &single, "rank {r}");
    }
}

/// What one rank of a failure test returns: its call's result and how long the call took.
type RankOutcome = (Result<(), CommError>, Duration);

/// Runs `p` ranks with the short timeout; rank `odd` does `odd_one`, the others `others`; returns each
/// result with the time it took.
fn run_failure(
    p: usize,
    odd: usize,
    odd_one: impl Fn(&Arc<dyn ProcessGroup>) -> Result<(), CommError> + Sync,
    others: impl Fn(&Arc<dyn ProcessGroup>) -> Result<(), CommError> + Sync,
) -> Vec<Result<RankOutcome, CommError>> {
    run_ranks(p, SHORT, |pg| {
        let start = Instant::now();
        let r = if pg.rank() == odd { odd_one(&pg) } else { others(&pg) };
        (r, start.elapsed())
    })
}

fn all_reduce_once(pg: &Arc<dyn ProcessGroup>) -> Result<(), CommError> {
    pg.all_reduce(&Tensor::ones(4, DType::F32, &Device::Cpu).unwrap(), ReduceOp::Sum).map(|_| ())
}

#[test]
fn a_rank_that_returns_early_is_reported_at_once() {
    let outs = run_failure(4, 3, |_| Ok(()), all_reduce_once);
    for (r, out) in outs.into_iter().enumerate() {
        let (res, took) = out.unwrap();
        if r == 3 {
            assert!(res.is_ok());
            continue;
        }
        let err = res.unwrap_err();
        match &err {
            CommError::PeerGone { collective, group, peer, how, .. } => {
                assert_eq!((*collective, group.as_str(), *peer), (Collective::AllReduce, "world", 3));
                assert_eq!(*how, Departure::Returned);
            }
            other => panic!("rank {r}: expected PeerGone, got {other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("all_reduce") && msg.contains("`world`") && msg.contains("rank 3"), "{msg}");
        assert!(took < SHORT, "rank {r} noticed after {took:?}, not at once");
    }
}

#[test]
fn a_rank_that_panics_is_reported_as_panicked() {
    let outs = run_failure(3, 1, |_| panic!("rank 1 fails on purpose"), all_reduce_once);
    match &outs[1] {
        Err(CommError::RankPanicked { rank: 1, message }) => {
            assert!(message.contains("on purpose"), "{message}")
        }
        other => panic!("rank 1: expected RankPanicked, got {other:?}"),
    }
    for r in [0, 2] {
        let (res, took) = outs[r].as_ref().unwrap();
        match res {
            Err(CommError::PeerGone { peer: 1, how: Departure::Panicked, collective, .. }) => {
                assert_eq!(*collective, Collective::AllReduce)
            }
            other => panic!("rank {r}: expected PeerGone from a panic, got {other:?}"),
        }
        assert!(*took < SHORT + MARGIN, "rank {r} took {took:?}");
    }
}

#[test]
fn a_rank_that_arrives_too_late_gives_a_timeout_then_the_group_is_poisoned() {
    let outs = run_failure(
        3,
        2,
        |pg| {
            std::thread::sleep(SHORT * 2);
            pg.all_gather(&Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(), 0).map(|_| ())
        },
        |pg| pg.all_gather(&Tensor::ones(2, DType::F32, &Device::Cpu).unwrap(), 0).map(|_| ()),
    );
    for r in [0, 1] {
        let (res, took) = outs[r].as_ref().unwrap();
        let err = res.as_ref().unwrap_err();
        match err {
            CommError::Timeout { collective, group, missing, .. } => {
                assert_eq!((*collective, group.as_str()), (Collective::AllGather, "world"));
                assert_eq!(missing, &vec![2]);
            }
            other => panic!("rank {r}: expected Timeout, got {other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("all_gather") && msg.contains("`world`") && msg.contains("[2]"), "{msg}");
        assert!(*took < SHORT + MARGIN, "rank {r} gave up after {took:?}");
    }
    let (late, _) = outs[2].as_ref().unwrap();
    assert!(matches!(late, Err(CommError::Poisoned { collective: Collective::AllGather, .. })), "late rank: {late:?}");
}

#[test]
fn a_recv_from_a_silent_rank_times_out() {
    let outs = run_failure(
        2,
        0,
        |_| {
            std::thread::sleep(SHORT + SHORT / 2);
            Ok(())
        },
        |pg| pg.recv(0).map(|_| ()),
    );
    let (res, took) = outs[1].as_ref().unwrap();
    match res {
        Err(CommError::Timeout { collective: Collective::Recv, missing, .. }) => {
            assert_eq!(missing, &vec![0])
        }
        other => panic!("expected a recv timeout, got {other:?}"),
    }
    assert!(*took >= SHORT && *took < SHORT + MARGIN, "{took:?}");
}

#[test]
fn a_failure_in_a_subgroup_names_the_subgroup_and_spares_the_other() {
    let outs = run_ranks(4, SHORT, |pg| {
        let inner = pg.split(&contiguous_groups(4, 2).unwrap())?;
        if pg.rank() == 3 {
            return Ok(String::new());
        }
        let y = inner.all_reduce(&Tensor::ones(3, DType::F32, &Device::Cpu).unwrap(), ReduceOp::Sum)?;
        Ok::<_, CommError>(format!("{:?}", y.to_vec1::<f32>().unwrap()))
    });
    assert_eq!(outs[0].as_ref().unwrap().as_ref().unwrap(), "[2.0, 2.0, 2.0]");
    assert_eq!(outs[1].as_ref().unwrap().as_ref().unwrap(), "[2.0, 2.0, 2.0]");
    match outs[2].as_ref().unwrap() {
        Err(CommError::PeerGone { group, peer: 1, .. }) => {
            assert!(group.starts_with("world/split0") && group.contains("[2, 3]"), "{group}")
        }
        other => panic!("rank 2: expected PeerGone of subgroup rank 1, got {other:?}"),
    }
}

#[test]
fn bad_arguments_on_one_rank_fail_every_rank_promptly() {
    let start = Instant::now();
    let outs = run_ranks(3, GUARD, |pg| {
        let x = Tensor::ones((3, 6), DType::F32, &Device::Cpu).unwrap();
        // Rank 1 asks for a dimension that does not exist.
        let dim = if pg.rank() == 1 { 5 } else { 1 };
        pg.reduce_scatter(&x, dim, ReduceOp::Sum).map(|_| ())
    });
    assert!(start.elapsed() < GUARD / 4, "took {:?}", start.elapsed());
    match outs[1].as_ref().unwrap() {
        Err(CommError::InvalidArgument { detail, .. }) => {
            assert!(detail.contains("dim 5"), "{detail}")
        }
        other => panic!("rank 1: {other:?}"),
    }
    for r in [0, 2] {
        match outs[r].as_ref().unwrap() {
            Err(e @ CommError::Mismatch { .. }) => assert!(e.to_string().contains("rank 1"), "{e}"),
            other => panic!("rank {r}: {other:?}"),
        }
    }
    // Ranks that disagree on the subgroups all fail too.
    let outs = run_ranks(2, GUARD, |pg| {
        let groups = if pg.rank() == 0 { vec![vec![0], vec![1]] } else { vec![vec![1, 0]] };
        pg.split(&groups).map(|_| ())
    });
    for (r, out) in outs.iter().enumerate() {
        assert!(matches!(out, Ok(Err(CommError::Mismatch { .. }))), "rank {r}: {out:?}");
    }
    // Element counts that differ in an all_reduce: some rank sees a chunk of the wrong size, and every
    // rank fails.
    let outs = run_ranks(3, GUARD, |pg| {
        let x = Tensor::ones(6 + 3 * pg.rank(), DType::F32, &Device::Cpu).unwrap();
        pg.all_reduce(&x, ReduceOp::Sum).map(|_| ())
    });
    for (r, out) in outs.iter().enumerate() {
        assert!(matches!(out, Ok(Err(CommError::Mismatch { .. }))), "rank {r}: {out:?}");
    }
    // Shapes that do not fit together in an all_gather.
    let outs = run_ranks(2, GUARD, |pg| {
        let x = Tensor::ones((2, pg.rank() + 1), DType::F32, &Device::Cpu).unwrap();
        pg.all_gather(&x, 0).map(|_| ())
    });
    for (r, out) in outs.iter().enumerate() {
        assert!(matches!(out, Ok(Err(CommError::Mismatch { .. }))), "rank {r}: {out:?}");
    }
}

#[test]
fn a_rank_in_another_collective_puts_every_rank_out_of_step() {
    // Rank 1 calls all_gather where ranks 0 and 2 call all_to_all. Every rank sends [2]-tensors to every
    // other, so paired by call number alone both calls would "succeed" with the wrong data.
    let outs = run_ranks(3, GUARD, |pg| {
        let dev = &Device::Cpu;
        let first = pg.all_reduce(&Tensor::ones(2, DType::F32, dev).unwrap(), ReduceOp::Sum);
        assert!(first.is_ok(), "the matching call before the divergence: {first:?}");
        let x = Tensor::full(pg.rank() as f32, 2, dev).unwrap();
        let res = if pg.rank() == 1 {
            pg.all_gather(&x, 0).map(|_| ())
        } else {
            pg.all_to_all(vec![x.clone(), x.clone(), x]).map(|_| ())
        };
        (res, pg.barrier())
    });
    for (r, out) in outs.into_iter().enumerate() {
        let (res, after) = out.unwrap();
        let err = res.unwrap_err();
        let (mine, theirs) = if r == 1 {
            (Collective::AllGather, vec![(0, Collective::AllToAll), (2, Collective::AllToAll)])
        } else {
            (Collective::AllToAll, vec![(1, Collective::AllGather)])
        };
        match &err {
            CommError::OutOfStep { collective, group, rank, call, others } => {
                assert_eq!((*collective, group.as_str(), *rank, *call), (mine, "world", r, 1));
                let want: Vec<PeerCall> =
                    theirs.iter().map(|&(rank, collective)| PeerCall { rank, collective, call: 1 }).collect();
                assert_eq!(others, &want, "rank {r}");
            }
            other => panic!("rank {r}: expected OutOfStep, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("all_gather") && msg.contains("all_to_all") && msg.contains("call #1"), "{msg}");
        // The ranks are out of step: the group is unusable afterwards.
        assert!(matches!(after, Err(CommError::Poisoned { .. })), "rank {r} after: {after:?}");
    }
}

#[test]
fn a_rank_that_skips_a_collective_is_caught_at_the_next_one() {
    // Rank 2 skips the barrier: its all_reduce meets the others' barrier.
    let outs = run_ranks(3, GUARD, |pg| {
        if pg.rank() != 2 {
            pg.barrier()?;
        }
        pg.all_reduce(&Tensor::ones(3, DType::F32, &Device::Cpu).unwrap(), ReduceOp::Sum).map(|_| ())
    });
    for (r, out) in outs.iter().enumerate() {
        match out.as_ref().unwrap() {
            Err(CommError::OutOfStep { collective, call: 0, others, .. }) => {
                let want = if r == 2 { Collective::AllReduce } else { Collective::Barrier };
                assert_eq!(*collective, want, "rank {r}");
                assert!(others.iter().all(|o| o.collective != want), "rank {r}: {others:?}");
            }
            other => panic!("rank {r}: expected OutOfStep, got {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_fails_mid_step_stops_the_others_at_once() {
    // A long timeout: the others must stop because rank 1 told them, not because they gave up waiting.
    let timeout = Duration::from_secs(120);
    let start = Instant::now();
    let outs = run_ranks_fallible(3, timeout, |pg| -> Result<Duration, String> {
        let dev = &Device::Cpu;
        let x = Tensor::ones(8, DType::F32, dev).unwrap();
        pg.all_reduce(&x, ReduceOp::Sum).map_err(|e| e.to_string())?;
        if pg.rank() == 1 {
            // Rank 1 fails between two collectives of the step (and still holds its group handle).
            std::thread::sleep(Duration::from_millis(200));
            return Err("token id 70000 is outside the vocabulary (rank 1's shard)".to_string());
        }
        let t = Instant::now();
        match pg.all_reduce(&x, ReduceOp::Sum) {
            Err(CommError::PeerFailed { collective, group, rank, peer, message }) => {
                assert_eq!((collective, group.as_str(), rank, peer), (Collective::AllReduce, "world", pg.rank(), 1));
                assert!(message.contains("token id 70000"), "{message}");
            }
            other => panic!("rank {}: expected PeerFailed, got {other:?}", pg.rank()),
        }
        // Every later call, on any group of the world, fails the same way at once.
        let later = pg.barrier();
        assert!(matches!(later, Err(CommError::PeerFailed { peer: 1, .. })), "{later:?}");
        Ok(t.elapsed())
    });
    // Stated bound: 200 ms of rank 1's work plus thread wake-ups on 2 shared cores, far below the timeout.
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    for r in [0, 2] {
        let waited = outs[r].as_ref().unwrap().as_ref().unwrap();
        assert!(*waited < Duration::from_secs(3), "rank {r} waited {waited:?}");
    }
    assert!(outs[1].as_ref().unwrap().as_ref().unwrap_err().contains("70000"));
}
