//! Checking a backward against central finite differences: the test harness every op and kernel uses.
//! Inputs are f64; the function is projected to a scalar with fixed pseudo-random weights per output.

use candle_core::{DType, Tensor};

use crate::{CheckpointPolicy, Error, Result, Tape, Value};

/// The worst disagreement between the tape's gradients and finite differences.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradCheck {
    /// Largest `|analytic - numeric|` over all checked elements.
    pub max_abs_err: f64,
    /// Largest `|analytic - numeric| / max(|numeric|, 1)`.
    pub max_rel_err: f64,
    /// Elements compared.
    pub checked: usize,
}

/// Deterministic weights in [-1, 1) for projecting an output to a scalar.
pub fn probe(shape: &[usize], seed: u64, device: &candle_core::Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let data: Vec<f64> = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect();
    Ok(Tensor::from_vec(data, shape, device)?)
}

/// `sum_k sum(outputs[k] * probes[k])` in f64.
fn project(outputs: &[Value], probes: &[Tensor]) -> Result<f64> {
    let mut total = 0.0;
    for (o, p) in outputs.iter().zip(probes) {
        let o = o.tensor().to_dtype(DType::F64)?;
        let o = finite_or_zero(&o)?;
        total += (o * p)?.sum_all()?.to_scalar::<f64>()?;
    }
    Ok(total)
}

/// -inf entries (an LSE row that sees no key) contribute nothing.
fn finite_or_zero(t: &Tensor) -> Result<Tensor> {
    let inf = t.eq(f64::NEG_INFINITY)?;
    Ok(inf.where_cond(&t.zeros_like()?, t)?)
}

/// Compares the tape's gradient of `f` with central differences (step `eps`) for every element of every
/// input in `wrt` (indices into `inputs`, all f64). `f` may return several outputs. Fails with
/// [`Error::Internal`] naming the worst element when `|a - n| > atol + rtol * |n|`.
pub fn check_gradients<F>(f: F, inputs: &[Tensor], wrt: &[usize], eps: f64, atol: f64, rtol: f64) -> Result<GradCheck>
where
    F: Fn(&Tape, &[Value]) -> Result<Vec<Value>>,
{
    let tape = Tape::new(CheckpointPolicy::None);
    let values: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| if wrt.contains(&i) { tape.leaf(t.clone()) } else { tape.constant(t.clone()) })
        .collect();
    let outputs = f(&tape, &values)?;
    let mut probes = Vec::with_capacity(outputs.len());
    for (k, o) in outputs.iter().enumerate() {
        probes.push(probe(o.dims(), 1000 + k as u64, o.device())?.to_dtype(o.dtype())?);
    }
    // One backward with every output seeded by its probe: accumulate through a sum of seeded backwards.
    for (k, (o, p)) in outputs.iter().zip(&probes).enumerate() {
        if o.is_tracked() {
            tape.backward_with_grad(o, p, k + 1 < outputs.len())?;
        }
    }
    let probes_f64: Vec<Tensor> =
        probes.iter().map(|p| p.to_dtype(DType::F64)).collect::<std::result::Result<_, _>>()?;
    let mut report = GradCheck { max_abs_err: 0.0, max_rel_err: 0.0, checked: 0 };
    for &i in wrt {
        let analytic = match tape.grad(&values[i])? {
            Some(g) => g.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?,
            None => vec![0.0; inputs[i].elem_count()],
        };
        let base = inputs[i].to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        for (e, &a) in analytic.iter().enumerate() {
            let eval = |delta: f64| -> Result<f64> {
                let mut data = base.clone();
                data[e] += delta;
                let t = Tensor::from_vec(data, inputs[i].shape(), inputs[i].device())?.to_dtype(inputs[i].dtype())?;
                let inf = Tape::inference();
                let vals: Vec<Value> = inputs
                    .iter()
                    .enumerate()
                    .map(|(j, x)| Value::constant(if j == i { t.clone() } else { x.clone() }))
                    .collect();
                project(&f(&inf, &vals)?, &probes_f64)
            };
            let numeric = (eval(eps)? - eval(-eps)?) / (2.0 * eps);
            let abs = (a - numeric).abs();
            report.max_abs_err = report.max_abs_err.max(abs);
            report.max_rel_err = report.max_rel_err.max(abs / numeric.abs().max(1.0));
            report.checked += 1;
            if abs.is_nan() || abs > atol + rtol * numeric.abs() {
                return Err(Error::Internal(format!(
                    "gradient check failed for input {i} element {e}: analytic {a}, numeric {numeric} (|diff| {abs})"
                )));
            }
        }
    }
    Ok(report)
}
