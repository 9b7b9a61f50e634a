//! RMSNorm: `y = x / sqrt(mean(x^2) + eps) * w` over the last dim, accumulated in f32 (f64 for f64 inputs).

use candle_core::{Tensor, D};

use crate::precision::Precision;
use crate::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// RMSNorm with weight: `x: [.., d]`, `w: [d]`.
#[derive(Debug)]
pub struct RmsNorm {
    eps: f64,
}

/// `(x_hat, r)`: the normalised input and the reciprocal RMS per row, in the accumulation dtype.
fn normalise(x: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let xf = x.to_dtype(Precision::float(x.dtype()).accumulate())?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok((xf.broadcast_mul(&r)?, r))
}

impl Op for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Norm
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (x, w) = (i[0], i[1]);
        let d = x.dim(D::Minus1)?;
        if w.dims() != [d] {
            return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
                op: "rms_norm",
                lhs_name: "x",
                lhs: x.dims().to_vec(),
                rhs_name: "weight",
                rhs: w.dims().to_vec(),
                hint: format!("the weight must be [{d}], the last dim of x"),
            })));
        }
        let (xhat, _) = normalise(x, self.eps)?;
        Ok(vec![xhat.broadcast_mul(&w.to_dtype(xhat.dtype())?)?.to_dtype(x.dtype())?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let (x, w) = (s.input(0)?, s.input(1)?);
        let (xhat, r) = normalise(x, self.eps)?;
        let gf = g.to_dtype(xhat.dtype())?;
        let gw = gf.broadcast_mul(&w.to_dtype(xhat.dtype())?)?;
        let proj = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = gw.sub(&xhat.broadcast_mul(&proj)?)?.broadcast_mul(&r)?;
        let d = xhat.dim(D::Minus1)?;
        let dw = (&gf * &xhat)?.reshape(((), d))?.sum(0)?;
        Ok(vec![Some(dx.to_dtype(x.dtype())?), Some(dw.to_dtype(w.dtype())?)])
    }
}

/// RMSNorm over the last dim: `x: [.., d]`, `w: [d]` -> `[.., d]`.
pub fn rms_norm(tape: &Tape, x: &Value, w: &Value, eps: f64) -> Result<Value> {
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(Error::InvalidArgument { op: "rms_norm", msg: format!("eps must be finite and >= 0, got {eps}") });
    }
    Ok(tape.apply(RmsNorm { eps }, &[x, w])?.remove(0))
}
