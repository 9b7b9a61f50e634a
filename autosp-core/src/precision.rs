//! The precision policy: from the dtype a model's tensors are stored in, which dtype each part of the work
//! runs in. One rule, asked by every op, kernel, optimiser and collective:
//!
//! | role | f32 | bf16 / f16 | f64 |
//! |---|---|---|---|
//! | storage (activations, parameters, what the caller passes) | f32 | bf16 / f16 | f64 |
//! | compute (what a kernel's arithmetic runs in) | f32 | f32 | f64 |
//! | accumulate (softmax statistics, the LSE, row sums, the loss) | f32 | f32 | f64 |
//! | master (optimiser master weights and moments) | f32 | f32 | f64 |
//! | reduce (gradient all-reduce, what the optimiser receives) | f32 | f32 | f64 |
//!
//! bf16 and f16 thus store and move half the bytes while every sum, statistic and update keeps f32's
//! precision; a bf16/f16 parameter gets an f32 master copy ([`Precision::needs_master`]). f64 is the
//! finite-difference-grade path of the tests and keeps f64 throughout.

use candle_core::DType;

use crate::{Error, Result};

/// The precision policy of tensors stored in one dtype (see the module doc for the table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Precision {
    storage: DType,
}

impl Precision {
    /// The policy of tensors stored in `dtype` (f32, f64, bf16 or f16); any other dtype is
    /// [`Error::UnsupportedDType`] naming `op`.
    pub fn of(op: &'static str, dtype: DType) -> Result<Self> {
        match dtype {
            DType::F32 | DType::F64 | DType::BF16 | DType::F16 => Ok(Self { storage: dtype }),
            dtype => Err(Error::UnsupportedDType { op, dtype }),
        }
    }

    /// The policy of a float dtype; for an integer dtype (which never holds activations or weights) the
    /// f32 rules apply. For callers that have already checked the dtype, or that only need
    /// [`accumulate`](Self::accumulate) of whatever they hold.
    pub fn float(dtype: DType) -> Self {
        Self { storage: dtype }
    }

    /// The dtype the tensors are stored in.
    pub fn storage(self) -> DType {
        self.storage
    }

    /// The dtype kernels compute in: f64 for f64, f32 otherwise (bf16/f16 inputs are widened once and the
    /// results rounded back to the storage dtype).
    pub fn compute(self) -> DType {
        self.wide()
    }

    /// The dtype sums and statistics accumulate in (softmax max and sum, the LSE, the loss, row norms).
    pub fn accumulate(self) -> DType {
        self.wide()
    }

    /// The dtype of an optimiser's master weights and moments.
    pub fn master(self) -> DType {
        self.wide()
    }

    /// Whether a parameter stored in this dtype gets a master copy in [`master`](Self::master) (bf16 and f16
    /// do; f32 and f64 are their own master).
    pub fn needs_master(self) -> bool {
        self.master() != self.storage
    }

    /// The dtype gradients are all-reduced in and handed to the optimiser.
    pub fn reduce(self) -> DType {
        self.wide()
    }

    fn wide(self) -> DType {
        if self.storage == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_dtypes_widen_to_f32_and_f64_stays_f64() {
        for (dtype, wide, master) in [
            (DType::F32, DType::F32, false),
            (DType::BF16, DType::F32, true),
            (DType::F16, DType::F32, true),
            (DType::F64, DType::F64, false),
        ] {
            let p = Precision::of("test", dtype).unwrap();
            assert_eq!(p.storage(), dtype);
            for role in [p.compute(), p.accumulate(), p.master(), p.reduce()] {
                assert_eq!(role, wide, "{dtype:?}");
            }
            assert_eq!(p.needs_master(), master, "{dtype:?}");
        }
        let e = Precision::of("rope", DType::U32).unwrap_err().to_string();
        assert!(e.contains("rope") && e.contains("U32") && e.contains("bf16"), "{e}");
    }
}
