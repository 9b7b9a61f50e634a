//! Which implementation serves a kernel call: the fast CPU kernel (host slices, on the vector path of
//! [`crate::simd`]) for CPU tensors, the device-generic one (candle tensor ops only: CUDA, Metal, or the CPU
//! when forced) everywhere else. Every op of autosp-kernels, and AdamW's update here, asks [`select`] once,
//! in its door (the `mod.rs` of its folder); nothing above the kernels branches on the device.
//!
//! The switch, strongest first: [`with_kernels`] (this thread, for the length of a closure: tests and
//! benchmarks that hold one kernel against the other), [`set_kernels`] (the whole process), the environment
//! variable `AUTOSP_KERNELS` (`generic` forces the generic kernels on the CPU too, so the CPU test suite runs
//! them; `auto`, or unset, picks by device), read once at the first call.

use std::cell::Cell;
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

/// The implementation that serves one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The fast CPU kernel (host slices).
    Cpu,
    /// The device-generic kernel (candle tensor ops, any device).
    Generic,
}

const UNSET: u8 = 0;
const AUTO: u8 = 1;
const GENERIC: u8 = 2;

static CHOICE: AtomicU8 = AtomicU8::new(UNSET);
static GENERIC_CALLS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static OVERRIDE: Cell<Option<Kernels>> = const { Cell::new(None) };
}

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

/// Runs `f` with the kernel choice `k` on this thread only (over [`set_kernels`] and the environment), and
/// restores the previous choice after, also when `f` panics. The door of an op selects its kernel on the
/// thread that calls it, so everything `f` calls directly runs on `k`'s kernels; thread ranks started inside
/// `f` (`run_ranks`) do not inherit it (use [`set_kernels`] for those).
pub fn with_kernels<R>(k: Kernels, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Kernels>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(k))));
    f()
}

/// The kernel choice in force on this thread: [`with_kernels`]'s, else [`set_kernels`]'s, else
/// `AUTOSP_KERNELS`'s (an unknown value is an error from [`kernels_from_env`]; here it counts as `auto`),
/// else [`Kernels::Auto`].
pub fn kernels() -> Kernels {
    if let Some(k) = OVERRIDE.with(Cell::get) {
        return k;
    }
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

/// Selects the kernel for a call on `t` and counts the selection ([`generic_calls`]): [`Route::Cpu`] when
/// `t` is on the CPU and the generic kernels are not forced, else [`Route::Generic`].
pub fn select(t: &Tensor) -> Route {
    select_where(t, true)
}

/// [`select`] for an op whose CPU kernel takes only some calls: `cpu_takes_it` false (say, a head dimension
/// the CPU kernel has no tiles for) selects [`Route::Generic`] on the CPU too.
pub fn select_where(t: &Tensor, cpu_takes_it: bool) -> Route {
    let route = route(t.device().is_cpu() && cpu_takes_it, kernels());
    if route == Route::Generic {
        GENERIC_CALLS.fetch_add(1, Ordering::Relaxed);
    }
    route
}

/// The rule of [`select`] on its own: `on_cpu` says the tensor is on the CPU and the CPU kernel takes the call.
fn route(on_cpu: bool, k: Kernels) -> Route {
    if on_cpu && k == Kernels::Auto {
        Route::Cpu
    } else {
        Route::Generic
    }
}

/// How many calls [`select`] has sent to a generic kernel in this process (tests check that forcing took
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

    #[test]
    fn cpu_runs_the_cpu_kernel_unless_forced_or_declined() {
        assert_eq!(route(true, Kernels::Auto), Route::Cpu);
        assert_eq!(route(true, Kernels::Generic), Route::Generic);
        assert_eq!(route(false, Kernels::Auto), Route::Generic);
        assert_eq!(route(false, Kernels::Generic), Route::Generic);
    }

    /// The thread override wins and is undone after the closure, also on a panic; other threads never see it.
    #[test]
    fn the_thread_override_is_scoped() {
        let t = Tensor::zeros(1, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let outer = kernels();
        let inner = with_kernels(Kernels::Generic, || {
            let other = std::thread::spawn(kernels).join().unwrap();
            (select(&t), kernels(), other)
        });
        assert_eq!(inner.0, Route::Generic);
        assert_eq!(inner.1, Kernels::Generic);
        assert_eq!(inner.2, outer, "another thread must not see the override");
        assert_eq!(kernels(), outer);
        let caught = std::panic::catch_unwind(|| with_kernels(Kernels::Generic, || panic!("inside")));
        assert!(caught.is_err());
        assert_eq!(kernels(), outer, "a panic inside must not leave the override set");
    }
}
