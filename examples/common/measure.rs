//! What the benches print beside their timings, written once: the median of a measure's rounds and the
//! machine's load average. Included by `bench_decode` and `bench_memory` (`#[path]`); not an example of its
//! own.

/// The median of `v` (the upper one of an even count); `v` not empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The load average, as /proc/loadavg gives it (empty where there is none).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.trim().to_string()).unwrap_or_default()
}
