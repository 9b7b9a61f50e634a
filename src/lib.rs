//! autosp
