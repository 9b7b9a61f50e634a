//! Attention's contract and its naive reference: the [`AttentionSpec`] every attention kernel takes (mask,
//! scale, position offsets), the shape checks they all share, and a naive attention that materialises the
//! scores. The naive attention is the test reference for every fast kernel (flash, Ulysses, Ring), and a
//! tape op of kind attention.
//!
//! Layout everywhere: `q: [batch, q_len, heads, head_dim]`, `k, v: [batch, k_len, kv_heads, head_dim]`,
//! output `o: [batch, q_len, heads, head_dim]`, `lse: [batch, heads, q_len]` (f32, or f64 for f64 inputs).
//! Query head `h` reads kv head `h / (heads / kv_heads)` (GQA/MQA).

use candle_core::{DType, Tensor, D};

use crate::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// How attention is computed. Positions are absolute positions in the whole sequence: query row `i` sits at
/// `q_offset + i`, key row `j` at `k_offset + j`; causal attention hides keys after the query.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Hide key position > query position.
    pub causal: bool,
    /// Softmax scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// Absolute position of the first query row.
    pub q_offset: usize,
    /// Absolute position of the first key row.
    pub k_offset: usize,
    /// A sliding window: when `Some(w)`, query position `p` sees only keys at positions `p'` with
    /// `|p - p'| <= w` (and, when causal, `p' <= p`). `None` sees every key the mask allows. Used as the
    /// control that proves a task needs long range (`llama_longctx --max-attention-distance`).
    pub max_distance: Option<usize>,
}

impl AttentionSpec {
    /// Causal attention of a block against itself at position 0, default scale.
    pub fn causal() -> Self {
        Self { causal: true, scale: None, q_offset: 0, k_offset: 0, max_distance: None }
    }

    /// Full (unmasked) attention, default scale.
    pub fn full() -> Self {
        Self { causal: false, scale: None, q_offset: 0, k_offset: 0, max_distance: None }
    }

    /// The softmax scale for this head dimension.
    pub fn scale_for(&self, head_dim: usize) -> f64 {
        self.scale.unwrap_or(1.0 / (head_dim as f64).sqrt())
    }

    /// The same spec with keys further than `distance` positions from the query hidden.
    pub fn with_max_distance(self, distance: usize) -> Self {
        Self { max_distance: Some(distance), ..self }
    }

    /// Whether this spec hides any (query, key) pair: causal or windowed.
    pub fn is_masked(&self) -> bool {
        self.causal || self.max_distance.is_some()
    }

    /// Whether query row `i` may see key row `j` under this spec.
    #[inline]
    pub fn visible(&self, i: usize, j: usize) -> bool {
        let (qp, kp) = (self.q_offset + i, self.k_offset + j);
        (!self.causal || kp <= qp) && self.max_distance.is_none_or(|w| qp.abs_diff(kp) <= w)
    }

    /// Checks `q: [b, nq, h, d]`, `k, v: [b, nk, h_kv, d]` and returns their dimensions.
    pub fn dims(&self, op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttentionDims> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            if t.rank() != 4 {
                return Err(Error::InvalidArgument {
                    op,
                    msg: format!(
                        "{name} has shape {:?}; attention takes rank-4 [batch, seq, heads, head_dim]",
                        t.dims()
                    ),
                });
            }
        }
        let (b, nq, h, d) = q.dims4()?;
        let (bk, nk, hkv, dk) = k.dims4()?;
        if k.dims() != v.dims() {
            return Err(shape_err(op, "k", k, "v", v, "k and v must have the same shape"));
        }
        if bk != b || dk != d {
            return Err(shape_err(op, "q", q, "k", k, "batch and head_dim of q and k must agree"));
        }
        if hkv == 0 || h % hkv != 0 {
            return Err(shape_err(
                op,
                "q",
                q,
                "k",
                k,
                &format!("query heads ({h}) must be a multiple of kv heads ({hkv})"),
            ));
        }
        if let Some(s) = self.scale {
            if !s.is_finite() || s <= 0.0 {
                return Err(Error::InvalidArgument { op, msg: format!("scale must be finite and > 0, got {s}") });
            }
        }
        Ok(AttentionDims { batch: b, q_len: nq, k_len: nk, heads: h, kv_heads: hkv, head_dim: d })
    }
}

/// The dimensions of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    pub batch: usize,
    pub q_len: usize,
    pub k_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionDims {
    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

fn shape_err(op: &'static str, ln: &'static str, l: &Tensor, rn: &'static str, r: &Tensor, hint: &str) -> Error {
    Error::ShapeMismatch(Box::new(crate::error::ShapeMismatch {
        op,
        lhs_name: ln,
        lhs: l.dims().to_vec(),
        rhs_name: rn,
        rhs: r.dims().to_vec(),
        hint: hint.to_string(),
    }))
}

/// The dtype attention accumulates in: f64 for f64 inputs, f32 otherwise.
pub fn accum_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// `[b, n, h_kv, d]` -> `[b, h_kv * group, n, d]` in the accumulation dtype, each kv head repeated `group` times.
fn heads_major(x: &Tensor, group: usize) -> Result<Tensor> {
    let (b, n, hkv, d) = x.dims4()?;
    let x = x.to_dtype(accum_dtype(x.dtype()))?.transpose(1, 2)?;
    if group == 1 {
        return Ok(x.contiguous()?);
    }
    Ok(x.unsqueeze(2)?.expand((b, hkv, group, n, d))?.reshape((b, hkv * group, n, d))?)
}

/// The scaled, masked scores `[b, h, nq, nk]` (masked entries -inf) and the repeated q, k, v.
fn scores(q: &Tensor, k: &Tensor, v: &Tensor, spec: &AttentionSpec) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let dims = spec.dims("naive_attention", q, k, v)?;
    let qt = heads_major(q, 1)?;
    let kt = heads_major(k, dims.group())?;
    let vt = heads_major(v, dims.group())?;
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

/// `[b, h, n, d]` back to `[b, n, h, d]` in `dtype`.
fn seq_major(x: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(x.transpose(1, 2)?.contiguous()?.to_dtype(dtype)?)
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
        let dot = heads_major(d_o, 1)?;
        let ot = heads_major(o, 1)?;
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
        Some(d_o) => p.t()?.matmul(&heads_major(d_o, 1)?)?,
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

/// Records an attention op (inputs `q, k, v`; outputs `o, lse`, as every attention kernel's) on `tape` and
/// returns `(o, lse)`.
pub fn apply_attention(
    tape: &Tape,
    op: std::sync::Arc<dyn Op>,
    q: &Value,
    k: &Value,
    v: &Value,
) -> Result<(Value, Value)> {
    let mut out = tape.apply_arc(op, &[q, k, v])?;
    let lse = out.pop().expect("two outputs");
    Ok((out.pop().expect("two outputs"), lse))
}
