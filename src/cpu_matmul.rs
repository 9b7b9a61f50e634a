//! Which micro-kernels candle's CPU matmuls (the gemm crate) run on this build and CPU, so that benchmark
//! figures can say it: gemm picks its kernels once, from the CPU and the build (`x86-v4`, the facade's default
//! feature `avx512-gemm`), and has no run-time switch. `AUTOSP_SIMD=avx2` moves autosp's own kernels only; an
//! AVX-512 machine standing in for an AVX2-only one needs a `--no-default-features` build as well, or its
//! matmuls stay on AVX-512 and flatter the figures.

use autosp_core::simd::{simd_path, SimdPath};

/// The kernels candle's f32 matmuls run here: `avx512` (an AVX-512 CPU and a build with `avx512-gemm`),
/// `avx2` (FMA), `neon`, or `scalar`.
pub fn kernels() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if cfg!(feature = "avx512-gemm") && std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512";
        }
        if std::arch::is_x86_feature_detected!("fma") {
            return "avx2";
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            return "neon";
        }
    }
    "scalar"
}

/// A warning when autosp's kernels are forced onto a narrower vector path than candle's matmuls run on (an
/// AVX2 stand-in whose matmuls still use AVX-512), saying how to build a faithful one; `None` otherwise.
pub fn stand_in_warning() -> Option<String> {
    let ours = simd_path();
    let narrower = matches!(ours, SimdPath::Avx2 | SimdPath::Scalar) && kernels() == "avx512";
    narrower.then(|| {
        format!(
            "autosp's kernels run on {} but candle's matmuls on AVX-512 (gemm's kernels are fixed at build time): \
             build with --no-default-features for an AVX2 stand-in whose matmuls run AVX2 too",
            ours.name()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_follow_the_cpu_and_the_build() {
        let k = kernels();
        assert!(["avx512", "avx2", "neon", "scalar"].contains(&k));
        #[cfg(target_arch = "x86_64")]
        if !std::arch::is_x86_feature_detected!("avx512f") {
            assert_ne!(k, "avx512", "no AVX-512 kernels on a CPU without AVX-512");
            assert!(stand_in_warning().is_none(), "nothing to warn about without AVX-512 matmuls");
        }
        if !cfg!(feature = "avx512-gemm") {
            assert_ne!(k, "avx512", "a build without avx512-gemm has no AVX-512 matmul kernels");
        }
    }
}
