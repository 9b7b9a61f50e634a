//! The vocabulary of the collectives: the kinds of call a group makes, counts and names in its errors
//! ([`Collective`]), and how a reduction combines the ranks' values ([`ReduceOp`]).

use std::fmt;

/// How `all_reduce` and `reduce_scatter` combine the ranks' values, element by element.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum in rank order 0, 1, ..., P-1 (bf16/f16 are accumulated in f32 and rounded once at the end).
    Sum,
    /// Element-wise maximum.
    Max,
}

/// The kinds of call a group counts and names in its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Send,
    Recv,
    SendRecv,
    Barrier,
    Split,
}

impl Collective {
    /// Every kind, in the order `CommStats` stores them.
    pub const ALL: [Collective; 9] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::Send,
        Collective::Recv,
        Collective::SendRecv,
        Collective::Barrier,
        Collective::Split,
    ];

    /// Position of this kind in `Collective::ALL`.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The method name, e.g. `"all_reduce"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "all_to_all",
            Collective::Send => "send",
            Collective::Recv => "recv",
            Collective::SendRecv => "send_recv",
            Collective::Barrier => "barrier",
            Collective::Split => "split",
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
