//! Rotary position embedding (rotate-half, as Llama in HF transformers), with an explicit position per token
//! so that a shard of a sequence can start at any position.

use candle_core::{DType, Device, Tensor};

use crate::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// The default inverse frequencies `theta^(-2i/d)` for `i < d/2`.
pub fn default_inv_freq(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2).map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64)).collect()
}

/// `(cos, sin)`, each `[n, d/2]` in `dtype`, for `positions: [n]` and `inv_freq: [d/2]`. Angles are computed
/// in f64, then rounded once.
pub fn rope_tables(positions: &[usize], inv_freq: &[f64], dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    rope_tables_scaled(positions, inv_freq, 1.0, dtype, device)
}

/// [`rope_tables`] with cos and sin multiplied by `attention_factor` (YaRN's and LongRoPE's attention
/// scaling, as transformers' rotary embeddings apply it: `cos(angle) * factor`, in f64 before the one
/// rounding to `dtype`). Returns `(cos, sin)`, each `[n, d/2]`.
pub fn rope_tables_scaled(
    positions: &[usize],
    inv_freq: &[f64],
    attention_factor: f64,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for &f in inv_freq {
            let a = p as f64 * f;
            cos.push(a.cos() * attention_factor);
            sin.push(a.sin() * attention_factor);
        }
    }
    let shape = (positions.len(), half);
    Ok((Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?, Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?))
}

/// Rotary embedding of `x: [b, n, h, d]` with `cos, sin: [n, d/2]` (or `[b, n, d/2]`).
#[derive(Debug)]
pub struct Rope;

/// `cos`/`sin` as `[1 or b, n, 1, d/2]` so they broadcast over heads.
fn table(t: &Tensor, x: &Tensor) -> Result<Tensor> {
    let (b, n, _, d) = x.dims4()?;
    let ok = match t.dims() {
        [tn, th] => *tn == n && *th * 2 == d,
        [tb, tn, th] => *tb == b && *tn == n && *th * 2 == d,
        _ => false,
    };
    if !ok || d % 2 != 0 {
        return Err(Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
            op: "rope",
            lhs_name: "x",
            lhs: x.dims().to_vec(),
            rhs_name: "cos/sin",
            rhs: t.dims().to_vec(),
            hint: "rope takes x [b, n, h, d] (d even) and cos/sin [n, d/2] or [b, n, d/2]".into(),
        })));
    }
    let t = if t.rank() == 2 { t.unsqueeze(0)? } else { t.clone() };
    Ok(t.unsqueeze(2)?.to_dtype(x.dtype())?)
}

/// `(y1, y2) = (x1 c - x2 s, x2 c + x1 s)`; with `(c, -s)` it is the inverse rotation (the backward).
fn rotate(x: &Tensor, c: &Tensor, s: &Tensor) -> Result<Tensor> {
    let half = x.dim(3)? / 2;
    let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
    let y1 = (x1.broadcast_mul(c)? - x2.broadcast_mul(s)?)?;
    let y2 = (x2.broadcast_mul(c)? + x1.broadcast_mul(s)?)?;
    Ok(Tensor::cat(&[y1, y2], 3)?)
}

impl Op for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let x = i[0];
        if x.rank() != 4 {
            return Err(Error::InvalidArgument {
                op: "rope",
                msg: format!("x has shape {:?}; rope takes [batch, seq, heads, head_dim]", x.dims()),
            });
        }
        Ok(vec![rotate(x, &table(i[1], x)?, &table(i[2], x)?)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[1, 2])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None; 3]) };
        let dx = rotate(g, &table(s.input(1)?, g)?, &table(s.input(2)?, g)?.neg()?)?;
        Ok(vec![Some(dx), None, None])
    }
}

/// Rotary embedding: `x: [b, n, h, d]`, `cos, sin: [n, d/2]` or `[b, n, d/2]` (from [`rope_tables`]).
pub fn rope(tape: &Tape, x: &Value, cos: &Value, sin: &Value) -> Result<Value> {
    Ok(tape.apply(Rope, &[x, cos, sin])?.remove(0))
}
