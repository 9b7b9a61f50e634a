//! autosp-models
