//! Device-generic kernels: the same contracts as the fast CPU kernels (shapes, dtypes, outputs), written only
//! with candle tensor ops (no host reads, no CPU slices), so they run on the CPU, CUDA and Metal alike. Each
//! op's public function picks between its fast CPU kernel and the function here with
//! [`crate::dispatch::use_fast_cpu`]; bf16/f16 inputs compute in f32 (f64 stays f64), as on the CPU.

pub mod attention;
pub mod cross_entropy;
pub mod merge;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
