//! Which implementation serves a kernel call: the fast CPU kernel (CPU slices; AVX-512, AVX2+FMA or NEON as
//! [`crate::simd`] picks) for CPU tensors, the device-generic one (candle tensor ops only, [`crate::generic`])
//! everywhere else. Every
//! op asks [`use_fast_cpu`] in exactly one place, its public function; nothing above this crate branches on
//! the device.
//!
//! The switch: [`set_kernels`] (an API) or the environment variable `AUTOSP_KERNELS` (`generic` forces the
//! generic path on the CPU too, so the CPU test suite runs it; `auto`, or unset, picks by device). The API
//! wins over the environment; the environment is read once, at the first call.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use candle_core::Tensor;

/// The name of the environment variable that forces the kernel choice.
pub const KERNELS_ENV: &str = "AUTOSP_KERNELS";

/// The kernel choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// The fast CPU kernels for CPU tensors, the generic ones on every other device (the default).
    Auto,
    /// The device-generic kernels everywhere, the CPU included (tests, and checking a device against the CPU).
    Generic,
}

impl std::str::FromStr for Kernels {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" | "fast" => Ok(Kernels::Auto),
            "generic" => Ok(Kernels::Generic),
            other => Err(format!("{KERNELS_ENV}={other:?} is not a kernel choice; use `auto` or `generic`")),
        }
    }
}

const UNSET: u8 = 0;
const AUTO: u8 = 1;
const GENERIC: u8 = 2;

static CHOICE: AtomicU8 = AtomicU8::new(UNSET);
static GENERIC_CALLS: AtomicU64 = AtomicU64::new(0);

fn encode(k: Kernels) -> u8 {
    match k {
        Kernels::Auto => AUTO,
        Kernels::Generic => GENERIC,
    }
}

/// Forces the kernel choice for the whole process (every thread, every rank in it), over `AUTOSP_KERNELS`.
pub fn set_kernels(k: Kernels) {
    CHOICE.store(encode(k), Ordering::SeqCst);
}

/// The kernel choice in force: [`set_kernels`]'s, else `AUTOSP_KERNELS`'s (an unknown value is an error
/// from [`kernels_from_env`]; here it counts as `auto`), else [`Kernels::Auto`].
pub fn kernels() -> Kernels {
    match CHOICE.load(Ordering::SeqCst) {
        AUTO => Kernels::Auto,
        GENERIC => Kernels::Generic,
        _ => {
            let k = kernels_from_env().unwrap_or(Kernels::Auto);
            // Only the first reader stores: a concurrent `set_kernels` is never overwritten.
            let _ = CHOICE.compare_exchange(UNSET, encode(k), Ordering::SeqCst, Ordering::SeqCst);
            kernels()
        }
    }
}

/// `AUTOSP_KERNELS` parsed: unset is `Auto`; a value that is neither `auto` nor `generic` is an error that
/// names it (binaries call this at start-up to refuse a typo rather than run the other path silently).
pub fn kernels_from_env() -> Result<Kernels, String> {
    match std::env::var(KERNELS_ENV) {
        Ok(v) => v.parse(),
        Err(std::env::VarError::NotPresent) => Ok(Kernels::Auto),
        Err(e) => Err(format!("{KERNELS_ENV}: {e}")),
    }
}

/// Whether a call on `t` runs the fast CPU kernel: `t` is on the CPU and the generic path is not forced.
/// Every `false` counts one call of a generic kernel ([`generic_calls`]).
pub fn use_fast_cpu(t: &Tensor) -> bool {
    let fast = t.device().is_cpu() && kernels() == Kernels::Auto;
    if !fast {
        GENERIC_CALLS.fetch_add(1, Ordering::Relaxed);
    }
    fast
}

/// How many kernel calls the generic path has served in this process (tests check that forcing it took
/// effect; a run can report it).
pub fn generic_calls() -> u64 {
    GENERIC_CALLS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_choices_and_names_a_typo() {
        assert_eq!("generic".parse::<Kernels>().unwrap(), Kernels::Generic);
        assert_eq!("AUTO".parse::<Kernels>().unwrap(), Kernels::Auto);
        let e = "genric".parse::<Kernels>().unwrap_err();
        assert!(e.contains("AUTOSP_KERNELS") && e.contains("genric"), "{e}");
    }
}
