//! The one seeded generator autosp uses, [`SplitMix64`], defined in `autosp-core` (whose dropout masks draw
//! from it too) and re-exported here for the models' random checkpoints and sampling.

pub use autosp_core::rng::SplitMix64;
