//! [`Embedding`]: token ids to vectors.

use crate::module::Module;
use crate::{ops, Param, Result, Tape, Value};

/// An embedding table `[vocab, hidden]`.
#[derive(Clone, Debug)]
pub struct Embedding {
    pub table: Param,
    /// The row whose lookups give it no gradient (PyTorch's `padding_idx`, the checkpoint's `pad_token_id`);
    /// `None`: every row looked up gets its gradient.
    pub padding_idx: Option<usize>,
}

impl Embedding {
    /// The table `[vocab, hidden]` with no padding row.
    pub fn new(table: Param) -> Self {
        Self { table, padding_idx: None }
    }

    /// `ids: [..]` -> `[.., hidden]`.
    ///
    /// A table sharded at `Gradients` or `Parameters` is looked up by [`ops::sharded_embedding`], whose
    /// gradient never exists whole.
    pub fn forward(&self, tape: &Tape, ids: &Value) -> Result<Value> {
        match ops::sharded_embedding(tape, ids, &self.table, self.padding_idx)? {
            Some(rows) => Ok(rows),
            None => ops::embedding::embedding_padded(tape, ids, &tape.param(&self.table)?, self.padding_idx),
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
