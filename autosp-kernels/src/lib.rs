//! autosp-kernels: autosp's heavy ops. Today: CPU flash attention forward and backward as plain functions on
//! candle tensors ([`flash`]).

pub mod error;
pub mod flash;

pub use error::{Error, Result};
pub use flash::{flash_attention_backward, flash_attention_forward, MAX_HEAD_DIM};
