//! Charts of the benchmark and training JSON lines: per-rank peak memory vs N per configuration (with each
//! capacity fit drawn out to its predicted longest N, and the budget), tokens/s vs N, and the loss curve of a
//! training run. Reads the lines printed by `bench_memory` (`"bench":"memory"` and `"bench":"capacity"`) and
//! `scripts/pytorch_bench.py` (`"bench":"pytorch"`), and the `--metrics` file of `llama_longctx` (a line
//! per step with `step` and `loss`, and `eval_loss` lines for the held-out loss); writes an SVG file per
//! chart that has data.
//!
//! `cargo run --release --example plot_benchmarks -- --out docs/plots docs/data/*.jsonl`
//! `cargo run --release --example plot_benchmarks -- --out runs/plots runs/smollm2/metrics.jsonl`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Parser;
use plotters::prelude::*;
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(about = "SVG charts of bench_memory / pytorch_bench JSON lines and llama_longctx --metrics files")]
struct Args {
    /// Output folder (created if missing).
    #[arg(long, default_value = "docs/plots")]
    out: PathBuf,
    /// JSON-lines files; lines that are neither JSON objects with a known `bench` nor llama_longctx metrics
    /// (`step` with `loss` or `eval_loss`) are skipped.
    files: Vec<PathBuf>,
}

/// One configuration's points: (N, value) sorted by N.
type Series = BTreeMap<String, Vec<(f64, f64)>>;

/// The points of every configuration: peak bytes and tokens/s vs N, capacity fits (a, b, max N, budget),
/// and loss vs step of every training run (`<file stem> training` and `<file stem> held-out`).
#[derive(Default)]
struct Data {
    peak: Series,
    tokens: Series,
    fits: Vec<(String, f64, f64, f64, f64)>,
    loss: Series,
}

fn label(j: &Value) -> String {
    format!("P={} {} {}", j["sp"], j["strategy"].as_str().unwrap_or("?"), j["checkpoint"].as_str().unwrap_or("?"))
}

fn read(files: &[PathBuf]) -> Result<Data> {
    let mut d = Data::default();
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let run = f.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| f.display().to_string());
        for j in text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()) {
            let n = j["n"].as_f64();
            match j["bench"].as_str() {
                None if j["step"].is_number() => {
                    let step = j["step"].as_f64().unwrap_or(0.0);
                    if let Some(l) = j["loss"].as_f64() {
                        d.loss.entry(format!("{run} training")).or_default().push((step, l));
                    }
                    if let Some(l) = j["eval_loss"].as_f64() {
                        d.loss.entry(format!("{run} held-out")).or_default().push((step, l));
                    }
                }
                Some("memory") if j["rank"].as_u64() == Some(0) => {
                    let (n, key) = (n.context("memory line without n")?, label(&j));
                    if let Some(p) = j["process_peak_bytes"].as_f64() {
                        d.peak.entry(key.clone()).or_default().push((n, p));
                    }
                    if let Some(t) = j["tokens_per_s"].as_f64() {
                        d.tokens.entry(key).or_default().push((n, t));
                    }
                }
                Some("pytorch") => {
                    let gc = j["gradient_checkpointing"].as_bool() == Some(true);
                    let key = format!("PyTorch {} (peak RSS)", if gc { "grad ckpt" } else { "eager" });
                    let n = n.context("pytorch line without n")?;
                    if let Some(p) = j["peak_rss_bytes"].as_f64() {
                        d.peak.entry(key.clone()).or_default().push((n, p));
                    }
                    if let Some(t) = j["tokens_per_s"].as_f64() {
                        d.tokens.entry(key).or_default().push((n, t));
                    }
                }
                Some("capacity") => {
                    let get = |k: &str| j[k].as_f64().with_context(|| format!("capacity line without {k}"));
                    d.fits.push((
                        format!("{} fit", label(&j)),
                        get("fit_a_bytes")?,
                        get("fit_b_bytes_per_token")?,
                        get("predicted_max_n")?,
                        get("budget_bytes")?,
                    ));
                }
                _ => {}
            }
        }
    }
    for s in d.peak.values_mut().chain(d.tokens.values_mut()).chain(d.loss.values_mut()) {
        s.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(d)
}

/// Draws `series` (points joined by lines) and `lines` (straight segments, e.g. fits) on one chart, `x_desc`
/// along x from 0.
fn chart(
    path: &Path,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    series: &Series,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let all = series.values().flatten().chain(lines.iter().flat_map(|l| l.1.iter()));
    let (xmax, ymax) = all.fold((1.0f64, 1e-9f64), |(x, y), p| (x.max(p.0), y.max(p.1)));
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax * 1.05, 0f64..ymax * 1.1)?;
    c.configure_mesh().x_desc(x_desc).y_desc(y_desc).x_label_formatter(&|x| format!("{x:.0}")).draw()?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        c.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        c.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    for (i, (name, pts)) in lines.iter().enumerate() {
        let color = Palette99::pick(series.len() + i).to_rgba();
        c.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(1)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1)));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

fn gib(s: &Series) -> Series {
    s.iter().map(|(k, v)| (k.clone(), v.iter().map(|&(n, b)| (n, b / (1u64 << 30) as f64)).collect())).collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let d = read(&args.files)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let g = (1u64 << 30) as f64;
    // Each fit from its first measured N's neighbourhood (N = 0) to its predicted longest N, and the budgets.
    let mut lines: Vec<(String, Vec<(f64, f64)>)> = d
        .fits
        .iter()
        .map(|(name, a, b, max_n, _)| (name.clone(), vec![(0.0, a / g), (*max_n, (a + b * max_n) / g)]))
        .collect();
    let xmax = d.fits.iter().map(|f| f.3).chain(d.peak.values().flatten().map(|p| p.0)).fold(1.0, f64::max);
    let mut budgets: Vec<f64> = d.fits.iter().map(|f| f.4).collect();
    budgets.dedup();
    for b in budgets {
        lines.push((format!("budget {:.2} GiB", b / g), vec![(0.0, b / g), (xmax, b / g)]));
    }
    let mut wrote = Vec::new();
    if !d.peak.is_empty() || !lines.is_empty() {
        let peak = args.out.join("peak_memory_vs_n.svg");
        let title = "Per-rank peak memory vs N (bench preset)";
        chart(&peak, title, ("N (tokens)", "peak (GiB)"), &gib(&d.peak), &lines)?;
        wrote.push(peak);
    }
    if !d.tokens.is_empty() {
        let tps = args.out.join("tokens_per_s_vs_n.svg");
        chart(&tps, "Training throughput vs N (bench preset)", ("N (tokens)", "tokens/s"), &d.tokens, &[])?;
        wrote.push(tps);
    }
    if !d.loss.is_empty() {
        let loss = args.out.join("loss_vs_step.svg");
        chart(&loss, "Loss per step (llama_longctx --metrics)", ("step", "mean token loss"), &d.loss, &[])?;
        wrote.push(loss);
    }
    if wrote.is_empty() {
        anyhow::bail!(
            "no chartable lines in {:?}: give bench_memory / pytorch_bench output or a --metrics file",
            args.files
        );
    }
    let names: Vec<String> = wrote.iter().map(|p| p.display().to_string()).collect();
    println!("wrote {}", names.join(", "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_metrics_file_gives_training_and_held_out_loss_curves() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("run1.jsonl");
        std::fs::write(
            &f,
            [
                r#"{"step":0,"eval_loss":3.5}"#,
                r#"{"step":2,"loss":3.0,"lr":0.001}"#,
                r#"{"step":1,"loss":3.25,"lr":0.001}"#,
                r#"{"step":2,"skipped":"loss is not finite"}"#,
                "not json",
                r#"{"step":2,"eval_loss":2.75}"#,
                r#"{"summary":{"loss_first":3.25}}"#,
            ]
            .join("\n"),
        )
        .unwrap();
        let d = read(&[f]).unwrap();
        assert_eq!(d.loss["run1 training"], vec![(1.0, 3.25), (2.0, 3.0)]);
        assert_eq!(d.loss["run1 held-out"], vec![(0.0, 3.5), (2.0, 2.75)]);
        assert!(d.peak.is_empty() && d.tokens.is_empty() && d.fits.is_empty());

        let svg = dir.path().join("loss.svg");
        chart(&svg, "loss", ("step", "loss"), &d.loss, &[]).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.starts_with("<svg") && text.contains("run1 training") && text.contains("run1 held-out"));
        // Each series is a 2-pixel polyline through its points (and a 2-pixel legend mark; the axes and ticks
        // are 1-pixel polylines), with a circle at every point.
        let thick = text.lines().filter(|l| l.starts_with("<polyline") && l.contains(r#"stroke-width="2""#)).count();
        assert_eq!(thick, 2 + 2, "two curves and two legend marks:\n{text}");
        assert_eq!(text.matches("<circle").count(), 2 + 2, "one circle per point:\n{text}");
    }

    #[test]
    fn bench_lines_still_go_to_the_memory_and_throughput_series() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("b.jsonl");
        let line = r#"{"bench":"memory","rank":0,"n":1024,"sp":2,"strategy":"ulysses","checkpoint":"full","process_peak_bytes":2048,"tokens_per_s":10.0}"#;
        std::fs::write(&f, line).unwrap();
        let d = read(&[f]).unwrap();
        assert_eq!(d.peak["P=2 ulysses full"], vec![(1024.0, 2048.0)]);
        assert_eq!(d.tokens["P=2 ulysses full"], vec![(1024.0, 10.0)]);
        assert!(d.loss.is_empty());
    }
}
