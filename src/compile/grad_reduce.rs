//! The gradient reduction of a compiled step over the world, at `--shard none` (all-reduce) and `optimizer`
//! (reduce-scatter; at `gradients` and `parameters` the tape reduce-scatters each use's gradient itself).
//! Parameters are grouped into buckets of one reduction dtype and at most [`GradReduction::bucket_elems`]
//! elements, one collective per bucket (a gradient larger than a bucket, alone in its bucket, all-reduced in
//! bucket-sized pieces), sent in f32 or bf16 ([`GradReduction::dtype`]). Buckets are posted in
//! reverse model order (the order backward finishes them), the same on every rank: after backward
//! ([`Buckets::reduce_after`]), or, overlapped ([`overlapped`]), from a communication thread that reduces
//! each bucket on a second handle of the world as soon as backward handed over every gradient in it, while
//! backward goes on. A bucket waits for the ones before it, so every rank posts the same collectives in the
//! same order whatever order its backward finishes the parameters in.

use std::collections::HashMap;
use std::sync::mpsc;

use autosp_core::comm::{ProcessGroup, ReduceOp};
use autosp_core::handoff::HandOff;
use autosp_core::progress::{current_mark, with_mark, BackwardMark};
use autosp_core::shard::{wire_dtype, ShardLevel};
use autosp_core::{Gradients, Param, ParamId, Precision};
use candle_core::{DType, Tensor};

use super::config::GradReduction;
use super::CompileError;

/// `params` (in model order) split into reduction buckets: one reduction dtype per bucket, consecutive
/// parameters while the bucket stays within `limit` elements. Every rank builds the same buckets from the
/// same model, so the collectives match.
pub(crate) fn grad_buckets(params: &[Param], limit: usize) -> Vec<Vec<&Param>> {
    let dtype_of = |p: &Param| Precision::float(p.tensor().dtype()).reduce();
    let mut dtypes: Vec<DType> = params.iter().map(dtype_of).collect();
    dtypes.sort_by_key(|d| d.as_str());
    dtypes.dedup();
    let mut buckets = Vec::new();
    for dtype in dtypes {
        let mut bucket: Vec<&Param> = Vec::new();
        let mut elems = 0;
        for p in params.iter().filter(|p| dtype_of(p) == dtype) {
            let n = p.tensor().elem_count();
            if !bucket.is_empty() && elems + n > limit {
                buckets.push(std::mem::take(&mut bucket));
                elems = 0;
            }
            bucket.push(p);
            elems += n;
        }
        if !bucket.is_empty() {
            buckets.push(bucket);
        }
    }
    buckets
}

/// The buckets of a model's trainable parameters, in posting order, and how they are reduced.
pub(crate) struct Buckets<'a> {
    params: &'a [Param],
    /// Indices into `params`, bucket by bucket, in posting order (reverse model order).
    order: Vec<Vec<usize>>,
    /// The bucket of each parameter.
    of: HashMap<ParamId, usize>,
    /// Reduce-scattered (`Optimizer`: each rank keeps its slice of every parameter) rather than all-reduced.
    sharded: bool,
    /// The dtype f32 gradients travel in.
    wire: DType,
    /// The most elements one all-reduce carries (a bucket's): a larger gradient, a bucket alone, goes in pieces.
    piece: usize,
}

impl<'a> Buckets<'a> {
    /// The buckets of `params` (trainable, model order) at sharding `level` (`None` or `Optimizer`).
    pub(crate) fn new(params: &'a [Param], level: ShardLevel, reduction: GradReduction) -> Self {
        let index: HashMap<ParamId, usize> = params.iter().enumerate().map(|(i, p)| (p.id(), i)).collect();
        let mut order: Vec<Vec<usize>> = grad_buckets(params, reduction.bucket_elems())
            .into_iter()
            .map(|b| b.iter().map(|p| index[&p.id()]).collect())
            .collect();
        order.reverse();
        let of = order.iter().enumerate().flat_map(|(b, ps)| ps.iter().map(move |&i| (params[i].id(), b))).collect();
        let (sharded, wire, piece) = (level == ShardLevel::Optimizer, reduction.dtype, reduction.bucket_elems());
        Self { params, order, of, sharded, wire, piece }
    }

    /// Bucket `b`'s gradients taken out of `grads` (zeros for a parameter without one), each in its reduction
    /// dtype, flattened (`Optimizer`: as `[W, chunk]` rows) and joined, in the dtype they travel in:
    /// `[Σ numel]` or `[W, Σ chunk]`.
    fn join(&self, b: usize, grads: &mut HashMap<ParamId, Tensor>) -> autosp_core::Result<Tensor> {
        let mut flat = Vec::with_capacity(self.order[b].len());
        let mut reduce = DType::F32;
        for &i in &self.order[b] {
            let p = &self.params[i];
            let t = p.tensor();
            reduce = Precision::float(t.dtype()).reduce();
            let g = match grads.remove(&p.id()) {
                Some(g) => g.to_dtype(reduce)?,
                None => Tensor::zeros(t.shape(), reduce, t.device())?,
            };
            flat.push(match p.shard() {
                // [W, chunk]: row r is rank r's slice.
                Some(s) => s.layout.padded_rows(&g)?,
                None => g.flatten_all()?,
            });
        }
        let joined = if flat.len() == 1 { flat.remove(0) } else { Tensor::cat(&flat, usize::from(self.sharded))? };
        Ok(joined.to_dtype(wire_dtype(reduce, self.wire))?)
    }

    /// Bucket `b`'s reduced gradients (`summed`, from [`reduce`]) back in their reduction dtype, one per
    /// parameter into `out`: whole (the parameter's shape) or this rank's slice `[chunk]`.
    fn split(&self, b: usize, summed: Tensor, out: &mut Gradients) -> autosp_core::Result<()> {
        let mut offset = 0;
        for &i in &self.order[b] {
            let p = &self.params[i];
            let t = p.tensor();
            let summed = summed.to_dtype(Precision::float(t.dtype()).reduce())?;
            match p.shard() {
                Some(s) if self.sharded => {
                    out.insert(p, summed.narrow(0, offset, s.layout.chunk)?);
                    offset += s.layout.chunk;
                }
                _ => {
                    let n = t.elem_count();
                    out.insert(p, summed.narrow(0, offset, n)?.reshape(t.shape())?);
                    offset += n;
                }
            }
        }
        Ok(())
    }

    /// Every bucket reduced over `group` after backward, one at a time (the reduction holds about one copy of
    /// the gradients plus one bucket's buffers): `grads` by parameter, in their own dtype or already in the
    /// reduction dtype.
    pub(crate) fn reduce_after(
        &self,
        group: &dyn ProcessGroup,
        mut grads: HashMap<ParamId, Tensor>,
    ) -> Result<Gradients, CompileError> {
        let mut out = Gradients::new();
        for b in 0..self.order.len() {
            let joined = self.join(b, &mut grads)?;
            let summed = reduce(group, &joined, self.sharded, self.piece)?;
            drop(joined);
            self.split(b, summed, &mut out)?;
        }
        Ok(out)
    }
}

/// One bucket's joined gradients reduced over `group`: all-reduced, or (`sharded`) reduce-scattered into this
/// rank's row, flattened. An all-reduce of more than `piece` elements (a gradient larger than a bucket, which
/// makes a bucket alone) goes in pieces of at most `piece` written into one result, so its buffers are a
/// bucket's, not the gradient's. The exchange-based all-reduce (thread ranks, MPI) sums each element in rank
/// order whatever the piece, so the bits are the same; NCCL's own all-reduce may order an element's sum by its
/// offset in the message, so on 3 or more GPUs pieces may differ from the whole in the last bits.
fn reduce(group: &dyn ProcessGroup, joined: &Tensor, sharded: bool, piece: usize) -> Result<Tensor, CompileError> {
    if sharded {
        return Ok(group.reduce_scatter(joined, 0, ReduceOp::Sum)?.flatten_all()?);
    }
    let n = joined.elem_count();
    if n <= piece {
        return Ok(group.all_reduce(joined, ReduceOp::Sum)?);
    }
    let out = Tensor::zeros(n, joined.dtype(), joined.device())?;
    for start in (0..n).step_by(piece) {
        let part = group.all_reduce(&joined.narrow(0, start, piece.min(n - start))?, ReduceOp::Sum)?;
        out.slice_set(&part.contiguous()?, 0, start)?;
    }
    Ok(out)
}

/// A bucket posted to the communication thread: its index, its joined gradients, where backward stood and the
/// work that made them ([`HandOff`]).
type Job = (usize, Tensor, Option<BackwardMark>, HandOff);

/// A bucket the communication thread reduced: its index, the reduced gradients and the work that made them.
type Reduced = (usize, Tensor, HandOff);

/// The main thread's side of an overlapped reduction: holds the gradients backward hands over until their
/// bucket is complete, then posts the bucket (and any complete ones after it) to the communication thread,
/// and takes the reduced buckets back as they come.
pub(crate) struct Posting<'b, 'a> {
    buckets: &'b Buckets<'a>,
    held: HashMap<ParamId, Tensor>,
    /// Gradients each bucket still waits for.
    remaining: Vec<usize>,
    /// The next bucket to post (every one before it is posted).
    next: usize,
    jobs: mpsc::Sender<Job>,
    outbox: mpsc::Receiver<Reduced>,
    /// The reduced gradients taken back so far.
    out: Gradients,
}

impl Posting<'_, '_> {
    /// Takes parameter `id`'s final gradient (in its reduction dtype); posts every bucket that is complete and
    /// has every bucket before it posted. A gradient of a parameter outside the buckets (not trainable) is
    /// ignored.
    pub(crate) fn ready(&mut self, id: ParamId, g: Tensor) -> autosp_core::Result<()> {
        let Some(&b) = self.buckets.of.get(&id) else { return Ok(()) };
        if self.held.insert(id, g).is_none() {
            self.remaining[b] -= 1;
        }
        while self.next < self.remaining.len() && self.remaining[self.next] == 0 {
            self.post()?;
        }
        while let Ok(reduced) = self.outbox.try_recv() {
            take_back(self.buckets, &mut self.out, reduced)?;
        }
        Ok(())
    }

    /// Posts the next bucket (zeros for the gradients backward never handed over).
    fn post(&mut self) -> autosp_core::Result<()> {
        let joined = self.buckets.join(self.next, &mut self.held)?;
        // A closed channel means the communication thread stopped on an error: backward stops here rather
        // than running to its end, and `overlapped` reports the thread's error.
        let made = HandOff::record(joined.device())?;
        self.jobs.send((self.next, joined, current_mark(), made)).map_err(|_| {
            autosp_core::Error::Internal("the gradient reduction thread stopped before backward ended".into())
        })?;
        self.next += 1;
        Ok(())
    }

    /// Posts every bucket not posted yet (after backward), closes the thread's inbox and takes back every
    /// reduced bucket until the thread ends.
    fn finish(mut self) -> autosp_core::Result<Gradients> {
        while self.next < self.remaining.len() {
            self.post()?;
        }
        let Posting { jobs, outbox, mut out, buckets, .. } = self;
        drop(jobs);
        for reduced in outbox.iter() {
            take_back(buckets, &mut out, reduced)?;
        }
        Ok(out)
    }
}

/// A reduced bucket split into `out`, copied into this (the step's) thread's memory: the communication
/// thread's copy goes back to that thread's allocator arena at once, where its next buffers reuse it (glibc
/// keeps a thread's freed memory for that thread: buckets kept there until the optimizer step would leave the
/// thread's temporaries unreusable beside them, resident memory no tensor holds).
fn take_back(buckets: &Buckets<'_>, out: &mut Gradients, (b, summed, made): Reduced) -> autosp_core::Result<()> {
    made.wait()?;
    buckets.split(b, summed.copy()?, out)
}

/// Runs `backward`, which hands each parameter's final gradient to [`Posting::ready`], while a communication
/// thread reduces the buckets it completes over `group` (a [`duplicate`](ProcessGroup::duplicate) of the
/// world, so that its calls never interleave with the main thread's); posts what backward left after it
/// returns, and returns every bucket's reduced gradients once the thread is done. The collectives the thread
/// makes carry the [`BackwardMark`] of their posting.
pub(crate) fn overlapped(
    buckets: &Buckets<'_>,
    group: &dyn ProcessGroup,
    backward: impl FnOnce(&mut Posting<'_, '_>) -> Result<(), CompileError>,
) -> Result<Gradients, CompileError> {
    let (sharded, piece) = (buckets.sharded, buckets.piece);
    std::thread::scope(|scope| {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (reduced, outbox) = mpsc::channel::<Reduced>();
        let worker = std::thread::Builder::new()
            .name("grad-reduce".into())
            .spawn_scoped(scope, move || -> Result<(), CompileError> {
                for (b, joined, mark, made) in inbox {
                    made.wait()?;
                    let summed = with_mark(mark, || reduce(group, &joined, sharded, piece))?;
                    let done = HandOff::record(summed.device())?;
                    if reduced.send((b, summed, done)).is_err() {
                        // The step stopped taking buckets back (backward failed): nothing more is wanted.
                        break;
                    }
                }
                Ok(())
            })
            .map_err(|e| CompileError::Input(format!("could not start the gradient reduction thread: {e}")))?;
        let remaining = buckets.order.iter().map(Vec::len).collect();
        let mut posting =
            Posting { buckets, held: HashMap::new(), remaining, next: 0, jobs, outbox, out: Gradients::new() };
        let ran = backward(&mut posting);
        // Whether backward ran or failed, the thread ends once the sender is gone: `finish` drops it after
        // posting the rest, and on an error it is dropped here (else joining the thread would wait forever).
        let out = match ran {
            Ok(()) => posting.finish().map_err(CompileError::from),
            Err(e) => {
                drop(posting);
                Err(e)
            }
        };
        let thread = worker.join().map_err(|panic| {
            let what = panic.downcast_ref::<String>().cloned().or(panic.downcast_ref::<&str>().map(|s| s.to_string()));
            CompileError::Input(format!("the gradient reduction thread panicked: {}", what.unwrap_or_default()))
        })?;
        // The thread's error first: a closed channel stopped backward because of it.
        thread?;
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn param(name: &str, n: usize, dtype: DType) -> Param {
        Param::new(name, Tensor::zeros(n, dtype, &Device::Cpu).unwrap())
    }

    #[test]
    fn buckets_keep_model_order_split_by_reduction_dtype_and_size() {
        let ps = [
            param("a", 3, DType::F32),
            param("b", 4, DType::F32),
            param("x", 2, DType::F64),
            param("c", 12, DType::F32),
            param("d", 1, DType::F32),
            param("e", 2, DType::F32),
        ];
        let names: Vec<Vec<&str>> = grad_buckets(&ps, 8).iter().map(|b| b.iter().map(|p| p.name()).collect()).collect();
        // f32 sorts before f64; a parameter over the limit is a bucket of its own.
        assert_eq!(names, vec![vec!["a", "b"], vec!["c"], vec!["d", "e"], vec!["x"]]);
        assert_eq!(grad_buckets(&ps, usize::MAX).len(), 2);
        // bf16 and f16 gradients are reduced in f32: they share the f32 buckets.
        let mixed = [param("a", 3, DType::BF16), param("b", 4, DType::F32), param("h", 1, DType::F16)];
        let names: Vec<Vec<&str>> =
            grad_buckets(&mixed, 8).iter().map(|b| b.iter().map(|p| p.name()).collect()).collect();
        assert_eq!(names, vec![vec!["a", "b", "h"]]);
    }

    #[test]
    fn buckets_post_in_reverse_model_order_and_wait_for_the_ones_before() {
        let ps = [param("a", 3, DType::F32), param("b", 4, DType::F32), param("c", 6, DType::F32)];
        let reduction = GradReduction { bucket_bytes: 8 * 4, ..GradReduction::default() };
        let buckets = Buckets::new(&ps, ShardLevel::None, reduction);
        let names: Vec<Vec<&str>> = buckets.order.iter().map(|b| b.iter().map(|&i| ps[i].name()).collect()).collect();
        assert_eq!(names, vec![vec!["c"], vec!["a", "b"]]);
        let (jobs, inbox) = mpsc::channel();
        let outbox = mpsc::channel().1;
        let (held, out) = (HashMap::new(), Gradients::new());
        let mut posting = Posting { buckets: &buckets, held, remaining: vec![1, 2], next: 0, jobs, outbox, out };
        let g = |n: usize| Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
        // `a` completes nothing; `b` completes bucket 1, which waits for bucket 0; `c` posts both, in order.
        posting.ready(ps[0].id(), g(3)).unwrap();
        posting.ready(ps[1].id(), g(4)).unwrap();
        assert!(inbox.try_recv().is_err(), "bucket 1 must wait for bucket 0");
        posting.ready(ps[2].id(), g(6)).unwrap();
        let posted: Vec<(usize, usize)> = inbox.try_iter().map(|(b, t, _, _)| (b, t.elem_count())).collect();
        assert_eq!(posted, vec![(0, 6), (1, 7)]);
    }

    /// Backward failing after it posted a bucket: the communication thread ends (the posting side is dropped)
    /// and the step gets backward's error, on every rank, instead of waiting for the thread forever.
    #[test]
    fn an_error_in_backward_ends_the_reduction_thread() {
        let out = autosp_core::comm::run_ranks(2, std::time::Duration::from_secs(20), |g| {
            let ps = [param("a", 3, DType::F32), param("b", 4, DType::F32)];
            let reduction = GradReduction { bucket_bytes: 4 * 4, ..GradReduction::default() };
            let buckets = Buckets::new(&ps, ShardLevel::None, reduction);
            let ran = overlapped(&buckets, g.duplicate().unwrap().as_ref(), |posting| {
                posting.ready(ps[1].id(), Tensor::ones(4, DType::F32, &Device::Cpu)?)?;
                Err(CompileError::Input("backward failed".into()))
            });
            ran.err().map(|e| e.to_string())
        });
        for r in out {
            let err = r.unwrap().expect("backward's error");
            assert!(err.contains("backward failed"), "{err}");
        }
    }

    #[test]
    fn bf16_travels_for_f32_gradients_only() {
        assert_eq!(wire_dtype(DType::F32, DType::BF16), DType::BF16);
        assert_eq!(wire_dtype(DType::F64, DType::BF16), DType::F64);
        assert_eq!(wire_dtype(DType::F32, DType::F32), DType::F32);
    }
}
