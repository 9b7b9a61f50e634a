//! The evaluations' pictures, SVG files drawn with `plotters` (no font or image crates): the passkey grid as a
//! heatmap ([`passkey_heatmap`]: a cell per length × depth, coloured by accuracy, its hits written in it) and
//! the loss by position as curves ([`position_curves`]: loss against position on a log scale, a curve per
//! evaluation, the model's original window marked).

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::passkey::PasskeyScores;
use super::positions::{short_position, PositionScores};
use crate::train::error::{Result, TrainError};

/// A plotters error while drawing `path` (writing the file, in practice) as a [`TrainError::Io`].
fn drawing<E: std::fmt::Display>(path: &Path) -> impl FnOnce(E) -> TrainError + '_ {
    move |e| TrainError::io(format!("drawing {}", path.display()), std::io::Error::other(e.to_string()))
}

/// Red (0%) to green (100%) through yellow.
fn colour(accuracy: f64) -> RGBColor {
    let a = accuracy.clamp(0.0, 1.0);
    let lerp = |x: u8, y: u8, t: f64| (x as f64 + (y as f64 - x as f64) * t).round() as u8;
    if a < 0.5 {
        let t = a * 2.0;
        RGBColor(lerp(215, 254, t), lerp(48, 224, t), lerp(39, 139, t))
    } else {
        let t = (a - 0.5) * 2.0;
        RGBColor(lerp(254, 26, t), lerp(224, 152, t), lerp(139, 80, t))
    }
}

/// Writes the passkey grid as an SVG heatmap to `path`: depths across, lengths down, one filled rectangle per
/// cell (its accuracy's colour, `hits/samples` written in it), under `title`.
pub fn passkey_heatmap(path: &Path, title: &str, scores: &PasskeyScores) -> Result<()> {
    let (lengths, depths) = scores.axes();
    let root =
        SVGBackend::new(path, (160 + 90 * depths.len() as u32, 140 + 50 * lengths.len() as u32)).into_drawing_area();
    heatmap_on(&root, title, scores, &lengths, &depths).map_err(drawing(path))?;
    root.present().map_err(drawing(path))
}

fn heatmap_on(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    scores: &PasskeyScores,
    lengths: &[usize],
    depths: &[usize],
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let (nd, nl) = (depths.len(), lengths.len());
    let mut c = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((0..nd).into_segmented(), (0..nl).into_segmented())?;
    let at = |v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => *i,
        SegmentValue::Last => usize::MAX,
    };
    c.configure_mesh()
        .disable_mesh()
        .x_desc("needle depth (% of the filler)")
        .y_desc("prompt length (tokens)")
        .x_labels(nd)
        .y_labels(nl)
        .x_label_formatter(&|v| depths.get(at(v)).map(|d| format!("{d}%")).unwrap_or_default())
        .y_label_formatter(&|v| lengths.get(at(v)).map(|l| short_position(*l)).unwrap_or_default())
        .draw()?;
    for (y, &length) in lengths.iter().enumerate() {
        for (x, &depth) in depths.iter().enumerate() {
            let Some(cell) = scores.cell(length, depth) else { continue };
            let corners = [
                (SegmentValue::Exact(x), SegmentValue::Exact(y)),
                (SegmentValue::Exact(x + 1), SegmentValue::Exact(y + 1)),
            ];
            c.draw_series(std::iter::once(Rectangle::new(corners, colour(cell.accuracy()).filled())))?;
            c.draw_series(std::iter::once(Text::new(
                format!("{}/{}", cell.hits, cell.samples),
                (SegmentValue::CenterOf(x), SegmentValue::CenterOf(y)),
                ("sans-serif", 14).into_font().color(&BLACK),
            )))?;
        }
    }
    Ok(())
}

/// Writes the loss by position as an SVG chart to `path`: mean loss against position (log scale; each bucket a
/// point at its middle), a curve per `(label, scores)`, and a dashed vertical line at the model's original
/// window `window` (the axis reaches it when it is within 4x of the last position scored; one further out is
/// named in the legend only).
pub fn position_curves(path: &Path, title: &str, curves: &[(&str, &PositionScores)], window: usize) -> Result<()> {
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    curves_on(&root, title, curves, window).map_err(drawing(path))?;
    root.present().map_err(drawing(path))
}

/// The points of a curve: (bucket middle, mean loss) of the buckets with targets.
pub fn curve_points(scores: &PositionScores) -> Vec<(f64, f64)> {
    scores.buckets.iter().filter(|b| b.targets > 0).map(|b| ((b.from + b.to) as f64 / 2.0, b.loss)).collect()
}

fn curves_on(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    curves: &[(&str, &PositionScores)],
    window: usize,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let points: Vec<Vec<(f64, f64)>> = curves.iter().map(|(_, s)| curve_points(s)).collect();
    let all = points.iter().flatten();
    // The axis reaches the window when it is near the data (within 4x of the last position scored); a window
    // far past it is named in the legend only.
    let end = curves.iter().flat_map(|(_, s)| s.buckets.iter().map(|b| b.to)).max().unwrap_or(1) as f64;
    let marked = (window as f64) <= 4.0 * end;
    let x_max = if marked { end.max(window as f64) * 1.5 } else { end * 1.5 };
    let (lo, hi) = all.map(|p| p.1).fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)));
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.1).max(0.05);
    let mut c = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((0.5f64..x_max).log_scale(), (lo - pad)..(hi + pad))?;
    c.configure_mesh()
        .x_desc("token position (log scale)")
        .y_desc("mean next-token loss")
        .x_label_formatter(&|x| short_position(x.round() as usize))
        .draw()?;
    let palette = [BLUE, RED, GREEN, MAGENTA, CYAN];
    for (k, ((label, _), pts)) in curves.iter().zip(&points).enumerate() {
        let colour = palette[k % palette.len()];
        c.draw_series(LineSeries::new(pts.iter().copied(), colour.stroke_width(2)))?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        c.draw_series(pts.iter().map(|&p| Circle::new(p, 4, colour.filled())))?;
    }
    let grey = RGBColor(90, 90, 90);
    let line = if marked { vec![(window as f64, lo - pad), (window as f64, hi + pad)] } else { Vec::new() };
    c.draw_series(DashedLineSeries::new(line, 6, 4, grey.stroke_width(2)))?
        .label(if marked {
            format!("original window ({})", short_position(window))
        } else {
            format!("original window ({}, past the axis)", short_position(window))
        })
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(2)));
    c.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.85)).draw()?;
    Ok(())
}
