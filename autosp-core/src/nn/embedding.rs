//! [`Embedding`]: token ids to vectors.

use crate::module::Module;
use crate::{ops, Param, Result, Tape, Value};

/// An embedding table `[vocab, hidden]`.
#[derive(Clone, Debug)]
pub struct Embedding {
    pub table: Param,
}

impl Embedding {
    /// `ids: [..]` -> `[.., hidden]`.
    ///
    /// A table sharded at `Gradients` or `Parameters` is looked up by [`ops::sharded_embedding`], whose
    /// gradient never exists whole.
    pub fn forward(&self, tape: &Tape, ids: &Value) -> Result<Value> {
        match ops::sharded_embedding(tape, ids, &self.table)? {
            Some(rows) => Ok(rows),
            None => ops::embedding(tape, ids, &tape.param(&self.table)?),
        }
    }
}

impl Module for Embedding {
    fn kind(&self) -> &'static str {
        "Embedding"
    }
    fn own_params(&self) -> Vec<Param> {
        vec![self.table.clone()]
    }
}
