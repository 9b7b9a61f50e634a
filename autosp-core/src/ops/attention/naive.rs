//! The naive attention: scores materialised as `[b, h, nq, nk]`, masked by [`AttentionSpec::visible`], softmax,
//! product with V; the backward in FlashAttention-2's formulas, materialised. The reference every fast kernel
//! is tested against, and a tape op of kind attention ([`NaiveAttention`]); for tests and small shapes.

use candle_core::{Tensor, D};

use super::{apply_attention, heads_major, seq_major, AttentionSpec};
use crate::precision::Precision;
use crate::{NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// `x: [b, n, h_kv, d]` as `[b, h_kv * group, n, d]` in the accumulation dtype, each kv head repeated
/// `group` times (the naive reference materialises the repeats; the fast kernels never do).
fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor> {
    let (b, n, hkv, d) = x.dims4()?;
    let x = heads_major(x, Precision::float(x.dtype()).accumulate())?;
    if group == 1 {
        return Ok(x);
    }
    Ok(x.unsqueeze(2)?.expand((b, hkv, group, n, d))?.reshape((b, hkv * group, n, d))?)
}

/// The scaled, masked scores `[b, h, nq, nk]` (masked entries -inf) and the repeated q, k, v.
fn scores(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let dims = spec.dims("naive_attention", q, k, v)?;
    let qt = repeat_kv(q, 1)?;
    let kt = repeat_kv(k, dims.group())?;
    let vt = repeat_kv(v, dims.group())?;
    let s = (qt.matmul(&kt.t()?)? * spec.scale_for(dims.head_dim))?;
    let s = if spec.is_masked() {
        let mut mask = vec![0f64; dims.q_len * dims.k_len];
        for i in 0..dims.q_len {
            for j in 0..dims.k_len {
                if !spec.visible(i, j) {
                    mask[i * dims.k_len + j] = f64::NEG_INFINITY;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (dims.q_len, dims.k_len), q.device())?.to_dtype(s.dtype())?;
        s.broadcast_add(&mask)?
    } else {
        s
    };
    Ok((s, qt, kt, vt))
}

/// Replaces -inf (rows that see no key) by `fill`, so later arithmetic gives 0 rather than NaN.
fn finite_or(x: &Tensor, fill: f64) -> Result<Tensor> {
    let is_inf = x.eq(f64::NEG_INFINITY)?;
    Ok(is_inf.where_cond(&x.ones_like()?.affine(0.0, fill)?, x)?)
}

/// Naive attention forward. Returns `(o: [b, nq, h, d], lse: [b, h, nq])`; a row that sees no key has
/// `lse = -inf` and `o = 0`. Materialises the `[b, h, nq, nk]` scores: for tests and small shapes.
pub fn naive_attention_forward(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<(Tensor, Tensor)> {
    let (s, _, _, vt) = scores(q, k, v, spec)?;
    let m = finite_or(&s.max_keepdim(D::Minus1)?, 0.0)?;
    let p = s.broadcast_sub(&m)?.exp()?;
    let l = p.sum_keepdim(D::Minus1)?;
    let lse = (m + l.log()?)?.squeeze(D::Minus1)?;
    let l_safe = l.eq(0.0)?.where_cond(&l.ones_like()?, &l)?;
    let o = p.broadcast_div(&l_safe)?.matmul(&vt)?;
    Ok((seq_major(&o, q.dtype())?, lse))
}

/// Naive attention backward from the saved output and LSE (FlashAttention-2's formulas, materialised).
/// `d_o: [b, nq, h, d]` and `d_lse: [b, h, nq]` are the incoming gradients (either may be absent).
/// Returns `(dq, dk, dv)` shaped like `q, k, v`; the dk/dv of a kv head sum over its query-head group.
#[allow(clippy::too_many_arguments)]
pub fn naive_attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    d_o: Option<&Tensor>,
    d_lse: Option<&Tensor>,
    spec: &AttentionSpec,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dims = spec.dims("naive_attention_backward", q, k, v)?;
    let (s, qt, kt, vt) = scores(q, k, v, spec)?;
    let acc = s.dtype();
    let lse = finite_or(&lse.to_dtype(acc)?, 0.0)?.unsqueeze(D::Minus1)?;
    let p = s.broadcast_sub(&lse)?.exp()?;
    let mut ds_base = p.zeros_like()?;
    if let Some(d_o) = d_o {
        let dot = repeat_kv(d_o, 1)?;
        let ot = repeat_kv(o, 1)?;
        let delta = (&dot * &ot)?.sum_keepdim(D::Minus1)?;
        let dp = dot.matmul(&vt.t()?)?;
        ds_base = dp.broadcast_sub(&delta)?;
    }
    if let Some(d_lse) = d_lse {
        ds_base = ds_base.broadcast_add(&d_lse.to_dtype(acc)?.unsqueeze(D::Minus1)?)?;
    }
    let ds = (&p * ds_base)?;
    let scale = spec.scale_for(dims.head_dim);
    let dq = (ds.matmul(&kt)? * scale)?;
    let dk = (ds.t()?.matmul(&qt)? * scale)?;
    let dv = match d_o {
        Some(d_o) => p.t()?.matmul(&repeat_kv(d_o, 1)?)?,
        None => vt.zeros_like()?,
    };
    let group_sum = |x: Tensor| -> Result<Tensor> {
        let (b, _, n, d) = x.dims4()?;
        Ok(x.reshape((b, dims.kv_heads, dims.group(), n, d))?.sum(2)?)
    };
    Ok((seq_major(&dq, q.dtype())?, seq_major(&group_sum(dk)?, k.dtype())?, seq_major(&group_sum(dv)?, v.dtype())?))
}

/// The naive attention as a tape op (kind attention): inputs `q, k, v`; outputs `o, lse`.
#[derive(Debug)]
pub struct NaiveAttention {
    /// Mask, scale and offsets.
    pub spec: AttentionSpec,
}

impl Op for NaiveAttention {
    fn name(&self) -> &'static str {
        "naive_attention"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Attention
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (o, lse) = naive_attention_forward(i[0], i[1], i[2], &self.spec)?;
        Ok(vec![o, lse])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0, 1, 2]).and_outputs(&[0, 1])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let (q, k, v) = (s.input(0)?, s.input(1)?, s.input(2)?);
        let (dq, dk, dv) =
            naive_attention_backward(q, k, v, s.output(0)?, s.output(1)?, g[0].as_ref(), g[1].as_ref(), &self.spec)?;
        Ok(vec![Some(dq), Some(dk), Some(dv)])
    }
}

/// Naive attention on the tape: `q: [b, nq, h, d]`, `k, v: [b, nk, h_kv, d]` -> `(o: [b, nq, h, d],
/// lse: [b, h, nq])`.
pub fn naive_attention(tape: &Tape, q: &Value, k: &Value, v: &Value, spec: AttentionSpec) -> Result<(Value, Value)> {
    apply_attention(tape, std::sync::Arc::new(NaiveAttention { spec }), q, k, v)
}
