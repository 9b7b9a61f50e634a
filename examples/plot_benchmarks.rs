//! Charts of the benchmark JSON lines: per-rank peak memory vs N per configuration (with each capacity
//! fit drawn out to its predicted longest N, and the budget), and tokens/s vs N. Reads the lines printed by
//! `bench_memory` (`"bench":"memory"` and `"bench":"capacity"`) and `scripts/pytorch_bench.py`
//! (`"bench":"pytorch"`); writes SVG files.
//!
//! `cargo run --release --example plot_benchmarks -- --out docs/plots docs/data/*.jsonl`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Parser;
use plotters::prelude::*;
use serde_json::Value;

#[derive(Parser, Debug)]
#[command(about = "SVG charts of bench_memory / pytorch_bench JSON lines")]
struct Args {
    /// Output folder (created if missing).
    #[arg(long, default_value = "docs/plots")]
    out: PathBuf,
    /// JSON-lines files; lines that are not JSON objects with a known `bench` are skipped.
    files: Vec<PathBuf>,
}

/// One configuration's points: (N, value) sorted by N.
type Series = BTreeMap<String, Vec<(f64, f64)>>;

/// The points of every configuration: peak bytes and tokens/s vs N, and capacity fits (a, b, max N, budget).
#[derive(Default)]
struct Data {
    peak: Series,
    tokens: Series,
    fits: Vec<(String, f64, f64, f64, f64)>,
}

fn label(j: &Value) -> String {
    format!("P={} {} {}", j["sp"], j["strategy"].as_str().unwrap_or("?"), j["checkpoint"].as_str().unwrap_or("?"))
}

fn read(files: &[PathBuf]) -> Result<Data> {
    let mut d = Data::default();
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        for j in text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()) {
            let n = j["n"].as_f64();
            match j["bench"].as_str() {
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
    for s in d.peak.values_mut().chain(d.tokens.values_mut()) {
        s.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(d)
}

/// Draws `series` (points joined by lines) and `lines` (straight segments, e.g. fits) on one chart.
fn chart(path: &Path, title: &str, y_desc: &str, series: &Series, lines: &[(String, Vec<(f64, f64)>)]) -> Result<()> {
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
    c.configure_mesh().x_desc("N (tokens)").y_desc(y_desc).x_label_formatter(&|x| format!("{x:.0}")).draw()?;
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
    let peak = args.out.join("peak_memory_vs_n.svg");
    chart(&peak, "Per-rank peak memory vs N (bench preset)", "peak (GiB)", &gib(&d.peak), &lines)?;
    let tps = args.out.join("tokens_per_s_vs_n.svg");
    chart(&tps, "Training throughput vs N (bench preset)", "tokens/s", &d.tokens, &[])?;
    println!("wrote {} and {}", peak.display(), tps.display());
    Ok(())
}
