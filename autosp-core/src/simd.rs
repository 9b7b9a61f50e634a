//! Which vector instruction set the fast CPU kernels run on: AVX-512, AVX2+FMA, NEON or the portable scalar
//! loops (the reference every vector path is tested against). The kernels are written once over
//! [`pulp::Simd`] (the abstraction candle's gemm builds on), so AVX2+FMA and aarch64 NEON come from the same
//! source; the flash-attention micro-kernels keep a hand-tuned AVX-512 version beside it (see
//! `autosp-kernels/src/vector/avx512.rs`), and the other kernels run their 256-bit code under
//! [`SimdPath::Avx512`] (pulp's 512-bit `V4` needs its `x86-v4` feature, which would also change candle's
//! gemm through feature unification).
//!
//! The choice: the best path the CPU has ([`best_path`]), unless [`set_simd`] (an API) or the environment
//! variable `AUTOSP_SIMD` (`avx512`, `avx2`, `neon`, `scalar` or `auto`, read once at the first call)
//! forces one. The API wins over the environment. Tests compare the paths through the kernels' per-call
//! entry points (which take a [`SimdPath`]), not by switching this process-wide choice.

use std::sync::atomic::{AtomicU8, Ordering};

/// The name of the environment variable that forces the vector path.
pub const SIMD_ENV: &str = "AUTOSP_SIMD";

/// A vector instruction set the CPU kernels can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimdPath {
    /// x86-64 AVX-512F + FMA: the hand-written flash micro-kernels; the other kernels run their AVX2 code.
    Avx512,
    /// x86-64 AVX2 + FMA (pulp's `V3`).
    Avx2,
    /// aarch64 NEON (pulp's `Neon`).
    Neon,
    /// The portable scalar loops: the reference.
    Scalar,
}

/// A bad `AUTOSP_SIMD` value or a path this CPU cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimdError {
    /// Not one of the names.
    #[error("{SIMD_ENV}={0:?} is not a vector path; use `auto`, `avx512`, `avx2`, `neon` or `scalar`")]
    Unknown(String),
    /// The CPU lacks the instructions.
    #[error("this CPU cannot run the {path} path; it has {have}. Unset {SIMD_ENV} or pick one of those")]
    Unsupported {
        /// The path asked for.
        path: &'static str,
        /// The paths this CPU runs, best first.
        have: String,
    },
}

impl SimdPath {
    /// Every path, best first.
    pub const ALL: [SimdPath; 4] = [SimdPath::Avx512, SimdPath::Avx2, SimdPath::Neon, SimdPath::Scalar];

    /// The lower-case name (`"avx512"`, `"avx2"`, `"neon"`, `"scalar"`), as `AUTOSP_SIMD` takes it.
    pub fn name(self) -> &'static str {
        match self {
            SimdPath::Avx512 => "avx512",
            SimdPath::Avx2 => "avx2",
            SimdPath::Neon => "neon",
            SimdPath::Scalar => "scalar",
        }
    }

    /// Whether this CPU can run the path (checked at run time, once per path; the kernels ask per call).
    #[inline]
    pub fn is_supported(self) -> bool {
        match self {
            SimdPath::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => {
                static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
                *HAS.get_or_init(|| {
                    pulp::x86::V3::try_new().is_some()
                        && std::arch::is_x86_feature_detected!("avx512f")
                        && std::arch::is_x86_feature_detected!("fma")
                })
            }
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => pulp::x86::V3::try_new().is_some(),
            #[cfg(target_arch = "aarch64")]
            SimdPath::Neon => pulp::aarch64::Neon::try_new().is_some(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// `path` if this CPU runs it, else the typed error that names what it has.
    pub fn supported(self) -> Result<SimdPath, SimdError> {
        if self.is_supported() {
            Ok(self)
        } else {
            let have: Vec<&str> = supported_paths().iter().map(|p| p.name()).collect();
            Err(SimdError::Unsupported { path: self.name(), have: have.join(", ") })
        }
    }
}

impl std::fmt::Display for SimdPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SimdPath {
    type Err = SimdError;

    /// One path's name (case-insensitive). `auto` is not a path: see [`simd_from_env`].
    fn from_str(s: &str) -> Result<Self, SimdError> {
        let s = s.trim().to_ascii_lowercase();
        SimdPath::ALL.into_iter().find(|p| p.name() == s).ok_or(SimdError::Unknown(s))
    }
}

/// The paths this CPU runs, best first; [`SimdPath::Scalar`] always, last.
pub fn supported_paths() -> Vec<SimdPath> {
    SimdPath::ALL.into_iter().filter(|p| p.is_supported()).collect()
}

/// The best path this CPU runs.
pub fn best_path() -> SimdPath {
    supported_paths()[0]
}

const UNSET: u8 = 0;

static CHOICE: AtomicU8 = AtomicU8::new(UNSET);

fn encode(p: SimdPath) -> u8 {
    1 + SimdPath::ALL.iter().position(|&q| q == p).unwrap_or(3) as u8
}

/// Forces the vector path for the whole process (every thread, every rank in it), over `AUTOSP_SIMD`;
/// `None` goes back to the best path. Fails, changing nothing, when the CPU cannot run the path.
pub fn set_simd(path: Option<SimdPath>) -> Result<(), SimdError> {
    let p = match path {
        Some(p) => p.supported()?,
        None => best_path(),
    };
    CHOICE.store(encode(p), Ordering::SeqCst);
    Ok(())
}

/// `AUTOSP_SIMD` parsed and checked: `None` when unset, empty or `auto`; an unknown name or a path this CPU
/// cannot run is an error (binaries call this at start-up to refuse it rather than run another path).
pub fn simd_from_env() -> Result<Option<SimdPath>, SimdError> {
    match std::env::var(SIMD_ENV) {
        Ok(v) if matches!(v.trim().to_ascii_lowercase().as_str(), "" | "auto") => Ok(None),
        Ok(v) => Ok(Some(v.parse::<SimdPath>()?.supported()?)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(SimdError::Unknown(e.to_string())),
    }
}

/// The path in force: [`set_simd`]'s, else `AUTOSP_SIMD`'s (a bad value counts as unset here; see
/// [`simd_from_env`]), else [`best_path`]. One atomic load after the first call.
#[inline]
pub fn simd_path() -> SimdPath {
    match CHOICE.load(Ordering::Relaxed) {
        1 => SimdPath::Avx512,
        2 => SimdPath::Avx2,
        3 => SimdPath::Neon,
        4 => SimdPath::Scalar,
        _ => {
            let p = simd_from_env().ok().flatten().unwrap_or_else(best_path);
            // Only the first reader stores: a concurrent `set_simd` is never overwritten.
            let _ = CHOICE.compare_exchange(UNSET, encode(p), Ordering::SeqCst, Ordering::SeqCst);
            simd_path()
        }
    }
}

/// Runs `op` on pulp's instruction set for `path`: `V3` (AVX2+FMA) for [`SimdPath::Avx2`] and
/// [`SimdPath::Avx512`], `Neon` for [`SimdPath::Neon`]. `None` (without running `op`) for
/// [`SimdPath::Scalar`] or a path this CPU or build lacks: the caller then runs its scalar loop.
#[inline]
pub fn vectorize<Op: pulp::WithSimd>(path: SimdPath, op: Op) -> Option<Op::Output> {
    match path {
        #[cfg(target_arch = "x86_64")]
        SimdPath::Avx2 | SimdPath::Avx512 => pulp::x86::V3::try_new().map(|s| pulp::Simd::vectorize(s, op)),
        #[cfg(target_arch = "aarch64")]
        SimdPath::Neon => pulp::aarch64::Neon::try_new().map(|s| pulp::Simd::vectorize(s, op)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_and_refuses_typos() {
        assert_eq!("AVX2".parse::<SimdPath>().unwrap(), SimdPath::Avx2);
        assert_eq!(" scalar ".parse::<SimdPath>().unwrap(), SimdPath::Scalar);
        for p in SimdPath::ALL {
            assert_eq!(p.name().parse::<SimdPath>().unwrap(), p);
        }
        let e = "avx3".parse::<SimdPath>().unwrap_err().to_string();
        assert!(e.contains("AUTOSP_SIMD") && e.contains("avx3"), "{e}");
    }

    #[test]
    fn scalar_is_always_supported_and_last() {
        let have = supported_paths();
        assert_eq!(have.last(), Some(&SimdPath::Scalar));
        assert!(have.contains(&best_path()));
        #[cfg(target_arch = "x86_64")]
        assert!(!SimdPath::Neon.is_supported());
        #[cfg(target_arch = "x86_64")]
        assert!(matches!(SimdPath::Neon.supported(), Err(SimdError::Unsupported { path: "neon", .. })));
    }

    #[test]
    fn vectorize_runs_only_on_vector_paths() {
        struct Lanes;
        impl pulp::WithSimd for Lanes {
            type Output = usize;
            fn with_simd<S: pulp::Simd>(self, _: S) -> usize {
                S::F32_LANES
            }
        }
        assert_eq!(vectorize(SimdPath::Scalar, Lanes), None);
        for p in supported_paths() {
            match p {
                SimdPath::Avx2 | SimdPath::Avx512 => assert_eq!(vectorize(p, Lanes), Some(8)),
                SimdPath::Neon => assert_eq!(vectorize(p, Lanes), Some(4)),
                SimdPath::Scalar => {}
            }
        }
    }
}
