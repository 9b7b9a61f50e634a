//! `llama_longctx --no-prefetch-gathers` (#41 item 5) on 2 thread ranks at `--shard parameters`: by default
//! the run gathers the next block's weights on a communication thread while a block computes (its
//! communication line says so, and its model states count two blocks' gathered weights); with the option it
//! gathers each weight at its use (one block counted); the losses are the same bit for bit either way. Needs
//! `cargo build --release --example llama_longctx` first (the harness refuses a stale binary).

mod longctx_cli;

use longctx_cli::{losses, run_ok, s};

/// The prefetch's and the inline gathers' phrases in the run's communication line.
const PREFETCHED: &str = "the next block's weights gathered on a communication thread while a block computes";
const AT_USE: &str = "each weight gathered at its use";

/// The MiB the run's model-states line counts for gathered weights.
fn gathered_mib(out: &str) -> f64 {
    let line = out.lines().find(|l| l.starts_with("model states")).unwrap_or_else(|| panic!("no model states: {out}"));
    let rest = line.split("gathered weights ").nth(1).unwrap_or_else(|| panic!("no gathered weights: {line}"));
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn no_prefetch_gathers_reaches_the_compiled_model_and_changes_only_the_gathering() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let train = |name: &str, extra: &[&str]| {
        let metrics = t.join(format!("{name}.jsonl"));
        let args = ["--quick", "--steps", "2", "--sp", "2", "--shard", "parameters", "--metrics", s(&metrics)];
        let out = run_ok(t, &[&args[..], extra].concat());
        (out, losses(&metrics))
    };
    let (on, on_losses) = train("on", &[]);
    let (off, off_losses) = train("off", &["--no-prefetch-gathers"]);
    assert!(on.contains(PREFETCHED) && !on.contains(AT_USE), "the default prefetches: {on}");
    assert!(off.contains(AT_USE) && !off.contains(PREFETCHED), "--no-prefetch-gathers gathers at each use: {off}");
    let (two, one) = (gathered_mib(&on), gathered_mib(&off));
    // Each figure is printed to 0.1 MiB: twice the rounded one is within 0.15 of the rounded two.
    assert!(
        one > 0.0 && (two - 2.0 * one).abs() <= 0.16,
        "two blocks counted with the prefetch, one without: {two} vs {one}"
    );
    assert_eq!(on_losses.len(), 2);
    for ((step, a), (_, b)) in on_losses.iter().zip(&off_losses) {
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}: loss {a} with the prefetch, {b} without");
    }
}
