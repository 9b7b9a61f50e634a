//! The tape's ops, one family per file, each with a hand-written backward.

pub mod attention;
