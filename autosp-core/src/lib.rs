//! autosp-core: the recompute-aware autograd tape (values, nodes, checkpoint regions and policies, memory
//! accounting), the ops with hand-written backward that models are built from, and the optimisers.

pub mod error;
pub mod ops;

pub use error::{Error, Result};
