//! In-process back end: P ranks are threads of one process (the tests' and one machine's back end).
//! Tensors pass between threads without copying (candle tensors are immutable and reference counted); the
//! statistics still count them as sent.
//!
//! All groups of one world share one mutex-protected state: the open exchange rounds (keyed by group and
//! call number), the point-to-point mailboxes, which ranks have left or failed, and which groups failed. A
//! rank leaves when its last group handle is dropped (its function returned or panicked); waiters notice at
//! once and fail with `PeerGone` instead of waiting for the timeout. A rank that calls `abort` (as
//! [`run_ranks_fallible`] does for a rank function that returns `Err`) fails every waiter of the world at
//! once with `PeerFailed` and its message. Every deposit and message carries its [`Stamp`]; a round whose
//! stamps differ fails on every rank with `OutOfStep`.
//!
//! Ranks run on plain OS threads, never on rayon's pool, so candle's rayon-parallel CPU kernels keep all of
//! the pool's workers even while some ranks block in a collective. Do not call collectives from inside rayon
//! tasks: a blocked worker could starve the other ranks' kernels.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

use super::collective::Collective;
use super::communicator::Communicator;
use super::error::{CommError, Departure, ErrCtx, Result};
use super::process_group::{nanos, PendingRecv, ProcessGroup};
use super::stamp::{check_message, check_round, PairCounter, Stamp};
use super::transport::Transport;

/// A rank's handle on an in-process group.
pub type ThreadGroup = Communicator<ThreadTransport>;

impl Communicator<ThreadTransport> {
    /// Handles for every rank of a new in-process world of `size` ranks named `world`; give handle r to the
    /// thread that plays rank r. Every call waits at most `timeout` for the other ranks.
    pub fn world(size: usize, timeout: Duration) -> Result<Vec<ThreadGroup>> {
        if size == 0 {
            return Err(CommError::Config { detail: "a world needs at least one rank, got size 0".to_string() });
        }
        let world = Arc::new(World {
            state: Mutex::new(WorldState {
                departed: vec![None; size],
                failed: Vec::new(),
                rounds: HashMap::new(),
                mail: HashMap::new(),
                failures: HashMap::new(),
            }),
            cv: Condvar::new(),
        });
        let members: Arc<[usize]> = (0..size).collect();
        Ok((0..size)
            .map(|rank| {
                Communicator::new(ThreadTransport {
                    life: Arc::new(RankLife { world: world.clone(), global: rank }),
                    world: world.clone(),
                    key: Arc::from("world"),
                    rank,
                    members: members.clone(),
                    timeout_ns: AtomicU64::new(nanos(timeout)),
                    seq: AtomicU64::new(0),
                    splits: AtomicU64::new(0),
                    sent: PairCounter::default(),
                    received: PairCounter::default(),
                })
            })
            .collect())
    }
}

/// Runs `f` as `size` ranks on `size` threads of this process; each call gets its rank's handle on a new
/// world (`timeout` per call). Returns each rank's result in rank order; a rank that panicked gives
/// `CommError::RankPanicked` with the panic message. `size == 0` gives a single `CommError::Config`.
pub fn run_ranks<R, F>(size: usize, timeout: Duration, f: F) -> Vec<Result<R>>
where
    R: Send,
    F: Fn(Arc<dyn ProcessGroup>) -> R + Sync,
{
    let groups = match ThreadGroup::world(size, timeout) {
        Ok(groups) => groups,
        Err(e) => return vec![Err(e)],
    };
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, group)| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("autosp-rank-{rank}"))
                    .spawn_scoped(scope, move || f(Arc::new(group)))
                    .map_err(|e| CommError::Config {
                        detail: format!("could not start the thread of rank {rank}: {e}"),
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, handle)| {
                handle?
                    .join()
                    .map_err(|payload| CommError::RankPanicked { rank, message: panic_message(payload.as_ref()) })
            })
            .collect()
    })
}

/// [`run_ranks`] for a rank function that returns a `Result`: a rank whose function returns `Err(e)` first
/// tells the world ([`ProcessGroup::abort`] with `e`, printed with `{:#}`: anyhow's chain of causes), so the
/// other ranks' calls fail at once with `CommError::PeerFailed` carrying `e`'s message instead of waiting for
/// the timeout. For an error type whose causes `{:#}` does not print (a `thiserror` enum), return
/// [`abort_on_error`](super::abort_on_error)`(pg, result)` from `f`: the first notice is the one kept. Returns
/// each rank's result in rank order, as `run_ranks` does.
pub fn run_ranks_fallible<T, E, F>(size: usize, timeout: Duration, f: F) -> Vec<Result<std::result::Result<T, E>>>
where
    T: Send,
    E: Send + fmt::Display,
    F: Fn(Arc<dyn ProcessGroup>) -> std::result::Result<T, E> + Sync,
{
    run_ranks(size, timeout, |pg| {
        let out = f(pg.clone());
        if let Err(e) = &out {
            pg.abort(&format!("{e:#}"));
        }
        out
    })
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(panic payload is not a string)".to_string()
    }
}

struct World {
    state: Mutex<WorldState>,
    cv: Condvar,
}

impl World {
    fn lock(&self) -> MutexGuard<'_, WorldState> {
        // No user code runs under this lock, so a poisoned lock still holds consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Mailbox key: group, source rank, destination rank (ranks within the group).
type MailKey = (Arc<str>, usize, usize);

struct WorldState {
    /// Indexed by world rank: set once the rank's last handle is dropped.
    departed: Vec<Option<Departure>>,
    /// Ranks that called `abort`, in order: (world rank, message). The first is the one reported.
    failed: Vec<(usize, String)>,
    /// Open exchange rounds, by group and call number.
    rounds: HashMap<(Arc<str>, u64), Round>,
    mail: HashMap<MailKey, VecDeque<(Stamp, Tensor)>>,
    /// Groups that failed, and how.
    failures: HashMap<Arc<str>, Failure>,
}

/// One exchange: `deposits[i][j]` is what rank i sends to rank j.
struct Round {
    deposits: Vec<Option<Vec<Option<Tensor>>>>,
    /// `stamps[i]`: the call rank i deposited for.
    stamps: Vec<Option<Stamp>>,
    collected: usize,
}

#[derive(Clone)]
struct Failure {
    /// Call number of the failed exchange; `None` for a point-to-point failure.
    seq: Option<u64>,
    collective: Collective,
    by_rank: usize,
    kind: FailureKind,
}

#[derive(Clone)]
enum FailureKind {
    Timeout {
        missing: Vec<usize>,
    },
    PeerGone {
        peer: usize,
        how: Departure,
    },
    /// The ranks' stamps disagreed (every rank of the round reports its own `OutOfStep`).
    OutOfStep {
        detail: String,
    },
}

impl Failure {
    fn describe(&self) -> String {
        match &self.kind {
            FailureKind::Timeout { missing } => {
                format!("rank {} timed out in {} waiting for rank(s) {missing:?}", self.by_rank, self.collective)
            }
            FailureKind::PeerGone { peer, how } => {
                format!("rank {peer} {how} before joining {} (seen by rank {})", self.collective, self.by_rank)
            }
            FailureKind::OutOfStep { detail } => detail.clone(),
        }
    }
}

/// Marks its rank as departed when the rank's last group handle goes away.
struct RankLife {
    world: Arc<World>,
    global: usize,
}

impl Drop for RankLife {
    fn drop(&mut self) {
        let how = if std::thread::panicking() { Departure::Panicked } else { Departure::Returned };
        self.world.lock().departed[self.global] = Some(how);
        self.world.cv.notify_all();
    }
}

enum Poll<T> {
    Ready(T),
    Missing(Vec<usize>),
}

/// One rank's view of one in-process group.
pub struct ThreadTransport {
    world: Arc<World>,
    life: Arc<RankLife>,
    /// Group name, unique within the world.
    key: Arc<str>,
    rank: usize,
    /// World rank of each rank of this group.
    members: Arc<[usize]>,
    /// Timeout in nanoseconds.
    timeout_ns: AtomicU64,
    /// Exchange rounds this rank started on this group.
    seq: AtomicU64,
    /// Splits this rank made of this group (names the subgroups).
    splits: AtomicU64,
    /// Numbers of the point-to-point messages sent to / received from each rank.
    sent: PairCounter,
    received: PairCounter,
}

impl fmt::Debug for ThreadTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadTransport")
            .field("group", &self.key)
            .field("rank", &self.rank)
            .field("world_ranks", &self.members)
            .field("timeout", &self.timeout())
            .finish()
    }
}

impl ThreadTransport {
    fn ctx(&self, collective: Collective) -> ErrCtx<'_> {
        ErrCtx { collective, group: &self.key, rank: self.rank }
    }

    /// The `PeerFailed` error of the first rank of the world that called `abort`, if any did.
    fn peer_failed(&self, collective: Collective, st: &WorldState) -> Option<CommError> {
        st.failed.first().map(|(peer, message)| self.ctx(collective).peer_failed(*peer, message.clone()))
    }

    /// Fails if a rank of the world failed or the group failed; `seq` is this call's exchange round, if it
    /// is one.
    fn check_healthy(&self, collective: Collective, st: &WorldState, seq: Option<u64>) -> Result<()> {
        if let Some(e) = self.peer_failed(collective, st) {
            return Err(e);
        }
        match st.failures.get(&self.key) {
            Some(f) => Err(self.failure_error(collective, f, seq, Duration::ZERO)),
            None => Ok(()),
        }
    }

    /// The error this rank reports for the group's failure `f`: the same cause when `f` failed this very
    /// exchange round and this rank is not the one missing, `Poisoned` otherwise.
    fn failure_error(&self, collective: Collective, f: &Failure, seq: Option<u64>, waited: Duration) -> CommError {
        let ctx = self.ctx(collective);
        let same_round = seq.is_some() && f.seq == seq;
        match &f.kind {
            FailureKind::Timeout { missing } if same_round && !missing.contains(&self.rank) => {
                ctx.timeout(self.members.len(), missing.clone(), waited, self.timeout())
            }
            FailureKind::PeerGone { peer, how } if same_round => ctx.peer_gone(*peer, *how, waited),
            _ => ctx.poisoned(f.describe()),
        }
    }

    /// Polls `poll` under the world lock until it is ready, a rank it misses has left, the group failed
    /// elsewhere, or the timeout passed (then this group is marked failed).
    fn wait<T>(
        &self,
        collective: Collective,
        seq: Option<u64>,
        mut poll: impl FnMut(&mut WorldState) -> Poll<T>,
    ) -> Result<T> {
        let ctx = self.ctx(collective);
        let start = Instant::now();
        let timeout = self.timeout();
        let deadline = start + timeout;
        let mut st = self.world.lock();
        loop {
            let missing = match poll(&mut st) {
                Poll::Ready(v) => return Ok(v),
                Poll::Missing(missing) => missing,
            };
            if let Some(e) = self.peer_failed(collective, &st) {
                return Err(e);
            }
            if let Some(f) = st.failures.get(&self.key) {
                return Err(self.failure_error(collective, f, seq, start.elapsed()));
            }
            let gone = missing.iter().find_map(|&m| st.departed[self.members[m]].map(|how| (m, how)));
            let now = Instant::now();
            let kind = if let Some((peer, how)) = gone {
                FailureKind::PeerGone { peer, how }
            } else if now >= deadline {
                FailureKind::Timeout { missing: missing.clone() }
            } else {
                st = self.world.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
                continue;
            };
            let failure = Failure { seq, collective, by_rank: self.rank, kind: kind.clone() };
            st.failures.insert(self.key.clone(), failure);
            self.world.cv.notify_all();
            return Err(match kind {
                FailureKind::PeerGone { peer, how } => ctx.peer_gone(peer, how, start.elapsed()),
                FailureKind::Timeout { missing } => ctx.timeout(self.members.len(), missing, start.elapsed(), timeout),
                FailureKind::OutOfStep { detail } => ctx.poisoned(detail),
            });
        }
    }

    fn send_as(&self, collective: Collective, x: &Tensor, dst: usize) -> Result<()> {
        let mut st = self.world.lock();
        self.check_healthy(collective, &st, None)?;
        if dst != self.rank {
            if let Some(how) = st.departed[self.members[dst]] {
                return Err(self.ctx(collective).peer_gone(dst, how, Duration::ZERO));
            }
        }
        let stamp = Stamp::new(collective, self.sent.next(dst));
        st.mail.entry((self.key.clone(), self.rank, dst)).or_default().push_back((stamp, x.clone()));
        self.world.cv.notify_all();
        Ok(())
    }

    fn recv_as(&self, collective: Collective, src: usize) -> Result<Tensor> {
        self.check_healthy(collective, &self.world.lock(), None)?;
        let key = (self.key.clone(), src, self.rank);
        let (stamp, t) = self.wait(collective, None, |st| match st.mail.get_mut(&key).and_then(|q| q.pop_front()) {
            Some(m) => Poll::Ready(m),
            None => Poll::Missing(vec![src]),
        })?;
        check_message(self.ctx(collective), src, stamp, self.received.next(src))?;
        Ok(t)
    }
}

/// The receive half of a ring step on the thread back end.
struct ThreadRecv<'a> {
    transport: &'a ThreadTransport,
    src: usize,
}

impl PendingRecv for ThreadRecv<'_> {
    fn wait(self: Box<Self>) -> Result<Tensor> {
        self.transport.recv_as(Collective::SendRecv, self.src)
    }
}

impl Transport for ThreadTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    /// Rounds are keyed by group and call number in one shared state, and a waiting call holds no lock.
    fn concurrent_handles(&self) -> bool {
        true
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn name(&self) -> &str {
        &self.key
    }

    fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    fn set_timeout(&self, timeout: Duration) {
        self.timeout_ns.store(nanos(timeout), Ordering::Relaxed)
    }

    fn shares_memory(&self) -> bool {
        true
    }

    fn exchange(&self, stamp: Stamp, outgoing: Vec<Option<Tensor>>, _device: &Device) -> Result<Vec<Option<Tensor>>> {
        let (size, collective) = (self.members.len(), stamp.collective);
        debug_assert_eq!(outgoing.len(), size);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let key = (self.key.clone(), seq);
        {
            let mut st = self.world.lock();
            self.check_healthy(collective, &st, Some(seq))?;
            let round = st.rounds.entry(key.clone()).or_insert_with(|| Round {
                deposits: vec![None; size],
                stamps: vec![None; size],
                collected: 0,
            });
            round.deposits[self.rank] = Some(outgoing);
            round.stamps[self.rank] = Some(stamp);
            self.world.cv.notify_all();
        }
        let rank = self.rank;
        let (column, stamps) = self.wait(collective, Some(seq), |st| {
            let round = st.rounds.get_mut(&key).expect("a round stays open until every rank collected its part");
            let missing: Vec<usize> = (0..size).filter(|&i| round.deposits[i].is_none()).collect();
            if !missing.is_empty() {
                return Poll::Missing(missing);
            }
            let column: Vec<Option<Tensor>> =
                round.deposits.iter_mut().map(|d| d.as_mut().and_then(|d| d[rank].take())).collect();
            let stamps: Vec<(usize, Stamp)> =
                round.stamps.iter().enumerate().filter_map(|(i, s)| s.filter(|_| i != rank).map(|s| (i, s))).collect();
            round.collected += 1;
            if round.collected == size {
                st.rounds.remove(&key);
            }
            Poll::Ready((column, stamps))
        })?;
        if let Err(e) = check_round(self.ctx(collective), stamp, &stamps) {
            let kind = FailureKind::OutOfStep { detail: e.to_string() };
            let mut st = self.world.lock();
            st.failures.entry(self.key.clone()).or_insert(Failure { seq: Some(seq), collective, by_rank: rank, kind });
            self.world.cv.notify_all();
            return Err(e);
        }
        Ok(column)
    }

    fn send(&self, x: &Tensor, dst: usize) -> Result<()> {
        self.send_as(Collective::Send, x, dst)
    }

    fn recv(&self, src: usize) -> Result<Tensor> {
        self.recv_as(Collective::Recv, src)
    }

    fn start_send_recv(&self, x: &Tensor, dst: usize, src: usize) -> Result<Box<dyn PendingRecv + '_>> {
        // Sends are buffered here, so sending first cannot deadlock.
        self.send_as(Collective::SendRecv, x, dst)?;
        Ok(Box::new(ThreadRecv { transport: self, src }))
    }

    fn abort(&self, message: &str) {
        let global = self.members[self.rank];
        let mut st = self.world.lock();
        if !st.failed.iter().any(|(r, _)| *r == global) {
            st.failed.push((global, message.to_string()));
        }
        self.world.cv.notify_all();
    }

    fn split(&self, groups: &[Vec<usize>], group: usize, index: usize) -> Result<Self> {
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let members: Arc<[usize]> = groups[group].iter().map(|&r| self.members[r]).collect();
        Ok(ThreadTransport {
            world: self.world.clone(),
            life: self.life.clone(),
            key: Arc::from(format!("{}/split{n}:{:?}", self.key, members).as_str()),
            rank: index,
            members,
            timeout_ns: AtomicU64::new(nanos(self.timeout())),
            seq: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            sent: PairCounter::default(),
            received: PairCounter::default(),
        })
    }
}
