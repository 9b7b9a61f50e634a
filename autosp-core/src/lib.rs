//! autosp-core
