//! The typed shape error the doors of the row ops raise: autosp-core's [`ShapeMismatch`](autosp_core::ShapeMismatch),
//! naming both shapes and what would fit.

use autosp_core::Error;

/// A [`Error::ShapeMismatch`] of `op` naming both shapes, with `hint` saying what would fit.
pub(crate) fn mismatch(
    op: &'static str,
    lhs_name: &'static str,
    lhs: &[usize],
    rhs_name: &'static str,
    rhs: &[usize],
    hint: String,
) -> Error {
    Error::ShapeMismatch(Box::new(autosp_core::ShapeMismatch {
        op,
        lhs_name,
        lhs: lhs.to_vec(),
        rhs_name,
        rhs: rhs.to_vec(),
        hint,
    }))
}
