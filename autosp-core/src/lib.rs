//! autosp-core: the recompute-aware autograd tape (values, nodes, checkpoint regions and policies, memory
//! accounting), the ops with hand-written backward that models are built from, and the optimisers.
//!
//! ```
//! use autosp_core::{ops, CheckpointPolicy, Param, Tape};
//! use candle_core::{Device, Tensor};
//!
//! let w = Param::new("w", Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?);
//! let tape = Tape::new(CheckpointPolicy::SequenceAware);
//! let x = tape.constant(Tensor::new(&[[1f32, 1.]], &Device::Cpu)?);
//! let y = ops::linear(&tape, &x, &tape.param(&w)?, None)?; // [1, 2]
//! let loss = ops::sum_all(&tape, &y)?;
//! tape.backward(&loss)?;
//! let g = tape.param_grads();
//! assert_eq!(g.get(&w).unwrap().to_vec2::<f32>()?, vec![vec![1., 1.], vec![1., 1.]]);
//! # Ok::<(), autosp_core::Error>(())
//! ```

pub mod alloc;
mod backward;
pub mod checkpoint;
pub mod comm;
pub mod coordinates;
pub mod dispatch;
pub mod error;
pub mod gather_prefetch;
pub mod grad_scatter;
pub mod gradcheck;
pub mod handoff;
pub mod host_read;
pub mod lora;
pub mod memory;
pub mod module;
pub mod nn;
pub mod node;
pub mod op;
pub mod ops;
pub mod optim;
pub mod param;
pub mod precision;
pub mod profile;
pub mod progress;
pub mod rng;
pub mod shard;
pub mod simd;
pub mod tape;
pub mod value;

pub use alloc::TrackingAllocator;
pub use checkpoint::CheckpointPolicy;
pub use coordinates::TokenCoordinates;
pub use error::{Error, Result, ShapeMismatch};
pub use memory::MemoryStats;
pub use module::{Attention, AttentionSlot, CausalLm, LmDims, Module, RegionSlot};
pub use node::NodeKind;
pub use op::{Op, SavedTensors, Saves};
pub use param::{Gradients, Param, ParamId};
pub use precision::Precision;
pub use shard::{ParamShard, ShardLayout, ShardLevel};
pub use tape::{HeldValue, Tape};
pub use value::Value;
