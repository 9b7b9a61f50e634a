//! Context capacity at a memory budget: a least-squares line `peak = a + b * n` through measured per-rank
//! peaks at several sequence lengths, how well it fits, and the longest length whose predicted peak fits a
//! byte budget. Pure functions (no steps run here); `examples/bench_memory.rs --capacity` measures the
//! points and prints the result.

use crate::compile::LinearFit;

/// Why a capacity fit or prediction could not be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CapacityError {
    /// Fewer than two distinct lengths.
    #[error("a capacity fit needs peaks at two or more distinct lengths, got {distinct} distinct of {points} points: measure more lengths (e.g. --n 1024,2048,4096)")]
    TooFewLengths { points: usize, distinct: usize },
    /// The fitted peak does not grow with the length, so no budget bounds it.
    #[error("the fitted peak does not grow with n (slope {slope} bytes per token): the measured peaks are noise-dominated; measure longer lengths")]
    NoGrowth { slope: f64 },
    /// The budget is below the predicted peak at the smallest allowed length.
    #[error("budget {budget} bytes is below the predicted peak {at_min:.0} bytes at n = {min_n}: raise the budget or use a policy that holds less")]
    BudgetTooSmall { budget: u64, at_min: f64, min_n: usize },
}

/// A measurement: `(n, peak bytes)`.
pub type Point = (usize, u64);

/// A least-squares line through `(n, peak bytes)` points and its error.
#[derive(Clone, Debug, PartialEq)]
pub struct CapacityFit {
    /// `peak(n) = line.a + line.b * n` bytes.
    pub line: LinearFit,
    /// Root mean square of the residuals (bytes).
    pub rmse_bytes: f64,
    /// Largest `|measured / fitted - 1|` over the points.
    pub max_rel_error: f64,
    /// Coefficient of determination (1 when every point is on the line, or when all peaks are equal).
    pub r2: f64,
}

/// Fits `peak = a + b * n` by ordinary least squares.
/// `points`: `(n, peak_bytes)` pairs, at least two distinct `n`.
pub fn fit_peaks(points: &[(usize, u64)]) -> Result<CapacityFit, CapacityError> {
    let mut ns: Vec<usize> = points.iter().map(|p| p.0).collect();
    ns.sort_unstable();
    ns.dedup();
    if ns.len() < 2 {
        return Err(CapacityError::TooFewLengths { points: points.len(), distinct: ns.len() });
    }
    let k = points.len() as f64;
    let mx = points.iter().map(|p| p.0 as f64).sum::<f64>() / k;
    let my = points.iter().map(|p| p.1 as f64).sum::<f64>() / k;
    let sxx: f64 = points.iter().map(|p| (p.0 as f64 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 as f64 - mx) * (p.1 as f64 - my)).sum();
    let b = sxy / sxx;
    let line = LinearFit { a: my - b * mx, b };
    let resid: Vec<f64> = points.iter().map(|p| p.1 as f64 - line.at(p.0)).collect();
    let ss_res: f64 = resid.iter().map(|r| r * r).sum();
    let ss_tot: f64 = points.iter().map(|p| (p.1 as f64 - my).powi(2)).sum();
    let max_rel_error = points.iter().map(|p| (p.1 as f64 / line.at(p.0) - 1.0).abs()).fold(0.0, f64::max);
    Ok(CapacityFit {
        line,
        rmse_bytes: (ss_res / k).sqrt(),
        max_rel_error,
        r2: if ss_tot == 0.0 { 1.0 } else { 1.0 - ss_res / ss_tot },
    })
}

/// Splits off a floor: a process peak that does not grow with `n` at short lengths (the optimizer update's
/// transient, for example, is the peak until the activations outgrow it). The floor is recognised when two
/// or more points lie within `rel_tol` of the smallest peak; they are returned first, the points above the
/// floor (on the growing line) second. With one point at the smallest peak, no floor is assumed.
/// `points`: `(n, peak_bytes)` pairs.
pub fn split_floor(points: &[Point], rel_tol: f64) -> (Vec<Point>, Vec<Point>) {
    let Some(min) = points.iter().map(|p| p.1).min() else { return (Vec::new(), Vec::new()) };
    let on_floor = |p: &(usize, u64)| p.1 as f64 <= min as f64 * (1.0 + rel_tol);
    if points.iter().filter(|p| on_floor(p)).count() < 2 {
        return (Vec::new(), points.to_vec());
    }
    points.iter().partition(|p| on_floor(p))
}

/// The longest `n`, a multiple of `multiple` (e.g. 2P for the zigzag layout) and at least `multiple`,
/// whose predicted peak `line.at(n)` is at most `budget` bytes.
pub fn longest_fitting(line: &LinearFit, budget: u64, multiple: usize) -> Result<usize, CapacityError> {
    let multiple = multiple.max(1);
    if line.b <= 0.0 {
        return Err(CapacityError::NoGrowth { slope: line.b });
    }
    let at_min = line.at(multiple);
    if at_min > budget as f64 {
        return Err(CapacityError::BudgetTooSmall { budget, at_min, min_n: multiple });
    }
    let raw = ((budget as f64 - line.a) / line.b).floor() as usize;
    let mut n = raw / multiple * multiple;
    // Guard the float rounding at the boundary: step down while the prediction is over, up while the next fits.
    while n > multiple && line.at(n) > budget as f64 {
        n -= multiple;
    }
    while line.at(n + multiple) <= budget as f64 {
        n += multiple;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_line_is_recovered_with_zero_error() {
        // Points on 5e8 + 70_000 n: the fit must return the line to float precision (1e-6 relative: the
        // sums are of ~1e17-sized squares, exact well beyond that).
        let pts: Vec<(usize, u64)> = [1024, 2048, 4096].iter().map(|&n| (n, 500_000_000 + 70_000 * n as u64)).collect();
        let f = fit_peaks(&pts).unwrap();
        assert!((f.line.a / 5e8 - 1.0).abs() < 1e-6, "a = {}", f.line.a);
        assert!((f.line.b / 7e4 - 1.0).abs() < 1e-6, "b = {}", f.line.b);
        assert!(f.max_rel_error < 1e-9 && (f.r2 - 1.0).abs() < 1e-9);
    }

    #[test]
    fn noisy_points_give_least_squares_line_and_error() {
        // y = 10 + 2n with residuals +1, -2, +1 at n = 0, 1, 2: they sum to 0 and are orthogonal to n, so
        // the least-squares line is exactly 10 + 2n; rmse = sqrt(6/3); max rel error = 2/12 at n = 1.
        let f = fit_peaks(&[(0, 11), (1, 10), (2, 15)]).unwrap();
        assert!((f.line.a - 10.0).abs() < 1e-12 && (f.line.b - 2.0).abs() < 1e-12, "{f:?}");
        assert!((f.rmse_bytes - 2f64.sqrt()).abs() < 1e-12);
        assert!((f.max_rel_error - 2.0 / 12.0).abs() < 1e-12);
        // r2 = 1 - 6 / ss_tot, ss_tot about mean 12: 1 + 4 + 9 = 14.
        assert!((f.r2 - (1.0 - 6.0 / 14.0)).abs() < 1e-12);
    }

    #[test]
    fn one_length_is_an_error() {
        assert_eq!(fit_peaks(&[(1024, 5), (1024, 6)]), Err(CapacityError::TooFewLengths { points: 2, distinct: 1 }));
    }

    #[test]
    fn longest_fitting_is_the_last_multiple_under_budget() {
        let line = LinearFit { a: 1000.0, b: 3.0 };
        // (4000 - 1000) / 3 = 1000 exactly: 1000 fits (at the budget), rounded down to a multiple of 64: 960.
        assert_eq!(longest_fitting(&line, 4000, 1).unwrap(), 1000);
        assert_eq!(longest_fitting(&line, 4000, 64).unwrap(), 960);
        assert_eq!(longest_fitting(&line, 3999, 1).unwrap(), 999);
        assert!(line.at(1024) > 4000.0, "the next multiple of 64 must be over the budget");
    }

    #[test]
    fn floor_points_are_split_off_only_when_two_share_it() {
        let pts = [(256, 1_000_000), (512, 1_000_500), (4096, 1_500_000), (8192, 2_000_000)];
        let (floor, line) = split_floor(&pts, 1e-3);
        assert_eq!(floor, vec![(256, 1_000_000), (512, 1_000_500)]);
        assert_eq!(line, vec![(4096, 1_500_000), (8192, 2_000_000)]);
        // All on a line: the smallest peak is alone, nothing is split off.
        let pts = [(1024, 1_000_000), (2048, 1_500_000), (4096, 2_500_000)];
        assert_eq!(split_floor(&pts, 1e-3), (vec![], pts.to_vec()));
    }

    #[test]
    fn impossible_budgets_are_errors() {
        let line = LinearFit { a: 1000.0, b: 3.0 };
        assert!(matches!(longest_fitting(&line, 1100, 64), Err(CapacityError::BudgetTooSmall { .. })));
        let flat = LinearFit { a: 1000.0, b: 0.0 };
        assert!(matches!(longest_fitting(&flat, 4000, 1), Err(CapacityError::NoGrowth { .. })));
    }
}
