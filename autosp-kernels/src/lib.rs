//! autosp-kernels
