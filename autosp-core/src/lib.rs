//! autosp-core
pub mod comm;
