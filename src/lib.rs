//! autosp: long-context training for Llama-family models on candle, with automatic sequence parallelism and
//! sequence-aware activation checkpointing. This facade re-exports the workspace's crates.
#![doc = include_str!("../README.md")]

pub use autosp_core as core;
pub use autosp_kernels as kernels;
pub use autosp_models as models;

pub mod capacity;
pub mod compile;
pub mod cpu_matmul;
pub mod device;
pub mod infer;
pub mod precision;
#[warn(missing_docs)]
pub mod train;

pub use autosp_core::ShardLevel;
pub use compile::{build_sharded, compile, Checkpointing, CompileConfig, CompileError, Compiled, Mesh, Strategy};
pub use device::{DeviceError, DeviceSpec};
pub use infer::{GenerateConfig, Generated, InferError};

/// The heap of the library's unit-test binary, counted (the checkpoint hash must stream, not read whole files).
#[cfg(test)]
mod test_alloc {
    #[global_allocator]
    pub static ALLOC: autosp_core::TrackingAllocator = autosp_core::TrackingAllocator::new();
}
