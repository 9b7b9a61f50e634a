//! The float types the CPU kernels compute in, f32 and f64, as one trait: candle's element trait, the
//! arithmetic, and the scalar functions the kernels' reference loops use.

use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

use candle_core::WithDType;

/// A float a CPU kernel computes in (f32; f64, the finite-difference-grade test path). Conversions from and
/// to f64 are candle's `WithDType::from_f64` / `to_f64`.
pub(crate) trait Float:
    WithDType
    + Copy
    + Send
    + Sync
    + PartialOrd
    + std::fmt::Debug
    + Default
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + 'static
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// -inf.
    const NEG_INF: Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// e^self.
    fn exp(self) -> Self;
    /// 2^self.
    fn exp2(self) -> Self;
    /// Natural log.
    fn ln(self) -> Self;
    /// ln(1 + self), accurate near 0.
    fn ln_1p(self) -> Self;
    /// Base-2 log.
    fn log2(self) -> Self;
    /// Whether this is NaN.
    fn is_nan(self) -> bool;
}

macro_rules! impl_float {
    ($t:ident) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INF: Self = $t::NEG_INFINITY;
            fn sqrt(self) -> Self {
                $t::sqrt(self)
            }
            fn exp(self) -> Self {
                $t::exp(self)
            }
            fn exp2(self) -> Self {
                $t::exp2(self)
            }
            fn ln(self) -> Self {
                $t::ln(self)
            }
            fn ln_1p(self) -> Self {
                $t::ln_1p(self)
            }
            fn log2(self) -> Self {
                $t::log2(self)
            }
            fn is_nan(self) -> bool {
                $t::is_nan(self)
            }
        }
    };
}
impl_float!(f32);
impl_float!(f64);
