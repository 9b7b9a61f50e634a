//! `Stamp`: what every message carries besides its tensor, on every back end: the kind of call that sent it
//! and a sequence number. Collective rounds are paired by their position in each rank's sequence of rounds,
//! so without the stamp a rank that skipped or added a collective would pair its later calls with other
//! operations, silently when the shapes happen to agree. With it, every rank of a round compares the stamps
//! it received with its own and fails with [`CommError::OutOfStep`] naming both operations and call numbers.
//!
//! - Collective rounds: `call` is the rank's collective call number on the group (0 for its first call;
//!   every collective counts one, whatever the number of rounds it takes), so the two rounds of one
//!   `all_reduce` carry the same stamp and a round of one call never pairs with a round of the next.
//! - Point-to-point messages: the kind is `send` or `send_recv` and `call` numbers the messages from one rank
//!   to one other rank (0, 1, ...), which the receiver checks against its own count ([`PairCounter`]).

use std::collections::HashMap;
use std::sync::Mutex;

use super::collective::Collective;
use super::error::{CommError, ErrCtx, PeerCall, Result};

/// The operation and sequence number a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stamp {
    /// The call that sent the message.
    pub collective: Collective,
    /// The sender's collective call number on the group (collective rounds), or the message's number among
    /// those from its sender to its receiver (point-to-point).
    pub call: u64,
}

impl Stamp {
    /// The stamp of `collective` as call number `call`.
    pub fn new(collective: Collective, call: u64) -> Self {
        Self { collective, call }
    }

    /// The one-byte code of the kind on the wire (`Collective::index() + 1`; 0 is never a kind).
    pub(crate) fn kind_code(self) -> u8 {
        self.collective.index() as u8 + 1
    }

    /// The kind a wire code names, if any.
    pub(crate) fn kind_from_code(code: u64) -> Option<Collective> {
        let i = usize::try_from(code).ok()?.checked_sub(1)?;
        Collective::ALL.get(i).copied()
    }
}

/// Checks one collective round: `theirs` holds, for each other rank of the round, the stamp it sent. Every
/// rank of a round receives every other rank's stamp, so when they disagree every rank fails with
/// `OutOfStep` (each naming this rank's call and the calls that differ from it).
pub(crate) fn check_round(ctx: ErrCtx<'_>, mine: Stamp, theirs: &[(usize, Stamp)]) -> Result<()> {
    let others: Vec<PeerCall> = theirs
        .iter()
        .filter(|(_, s)| *s != mine)
        .map(|&(rank, s)| PeerCall { rank, collective: s.collective, call: s.call })
        .collect();
    if others.is_empty() {
        Ok(())
    } else {
        Err(ctx.out_of_step(mine.call, others))
    }
}

/// Numbers the point-to-point messages of one rank per peer: the sender stamps each message to `peer` with
/// `next(peer)`, the receiver checks each message from `peer` against its own `next(peer)`.
#[derive(Debug, Default)]
pub(crate) struct PairCounter(Mutex<HashMap<usize, u64>>);

impl PairCounter {
    /// The number of the next message to or from `peer` (0 for the first), counting it.
    pub fn next(&self, peer: usize) -> u64 {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(peer).or_insert(0);
        *n += 1;
        *n - 1
    }
}

/// Checks a point-to-point message from `src` stamped `got` against the number this rank expected from
/// `src`: a mismatch means messages were lost or mixed up between the two ranks.
pub(crate) fn check_message(ctx: ErrCtx<'_>, src: usize, got: Stamp, expected: u64) -> Result<()> {
    let sending = matches!(got.collective, Collective::Send | Collective::SendRecv);
    if sending && got.call == expected {
        return Ok(());
    }
    Err(CommError::Mismatch {
        collective: ctx.collective,
        group: ctx.group.to_string(),
        rank: ctx.rank,
        detail: format!(
            "the message from rank {src} is its {} message #{} to this rank, but this rank expected message \
             #{expected} from a send or send_recv; the two ranks' point-to-point calls are out of step",
            got.collective, got.call
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> ErrCtx<'static> {
        ErrCtx { collective: Collective::Barrier, group: "world", rank: 0 }
    }

    #[test]
    fn kinds_round_trip_through_their_wire_codes() {
        for c in Collective::ALL {
            assert_eq!(Stamp::kind_from_code(Stamp::new(c, 0).kind_code() as u64), Some(c));
        }
        assert_eq!(Stamp::kind_from_code(0), None);
        assert_eq!(Stamp::kind_from_code(Collective::ALL.len() as u64 + 1), None);
    }

    #[test]
    fn a_round_with_another_operation_or_call_is_out_of_step() {
        let mine = Stamp::new(Collective::Barrier, 4);
        assert!(check_round(ctx(), mine, &[(1, mine), (2, mine)]).is_ok());
        let err = check_round(ctx(), mine, &[(1, mine), (2, Stamp::new(Collective::AllReduce, 4))]).unwrap_err();
        match &err {
            CommError::OutOfStep { call: 4, others, .. } => {
                assert_eq!(others, &[PeerCall { rank: 2, collective: Collective::AllReduce, call: 4 }])
            }
            other => panic!("{other:?}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("call #4 (barrier)") && msg.contains("rank 2 is in its call #4 (all_reduce)"), "{msg}");
        // The same kind one call later (a rank that skipped a call) is out of step too.
        assert!(check_round(ctx(), mine, &[(1, Stamp::new(Collective::Barrier, 5))]).is_err());
    }

    #[test]
    fn point_to_point_numbers_count_per_peer() {
        let c = PairCounter::default();
        assert_eq!((c.next(1), c.next(1), c.next(2), c.next(1)), (0, 1, 0, 2));
        assert!(check_message(ctx(), 1, Stamp::new(Collective::Send, 3), 3).is_ok());
        assert!(check_message(ctx(), 1, Stamp::new(Collective::Send, 2), 3).is_err());
        assert!(check_message(ctx(), 1, Stamp::new(Collective::AllGather, 3), 3).is_err());
    }
}
