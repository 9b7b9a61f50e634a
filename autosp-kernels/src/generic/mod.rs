//! Device-generic kernels: each op's implementation written only with candle tensor ops (no host reads, no
//! storage access), so it runs on CPU, CUDA and Metal alike. Each file mirrors one fast CPU kernel with the
//! same contract (shapes, dtypes, outputs); the op's public function picks between the two
//! ([`crate::dispatch::use_fast_cpu`]).

pub mod attention;
