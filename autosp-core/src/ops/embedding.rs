//! Embedding lookup: rows of a table by token id; backward sums each id's gradient rows into its row of the
//! table's gradient (in f32 for bf16/f16 tables, so a token seen many times does not lose its later
//! contributions to bf16 rounding), with the kernel of [`super::embedding_grad`] (sorted segments on the
//! CPU, a one-hot GEMM on a GPU; no `index_add`, no zero-filled f32 table). A padding row (PyTorch's
//! `nn.Embedding(padding_idx=p)`) receives no gradient from the lookup.

use candle_core::{DType, Tensor};

use super::embedding_grad::row_sums;
use crate::precision::Precision;
use crate::{Error, NodeKind, Op, Result, SavedTensors, Saves, Tape, Value};

/// `table[ids]`: `ids: [..]` (u32 or i64), `table: [vocab, hidden]` -> `[.., hidden]`.
#[derive(Debug, Default)]
pub struct Embedding {
    /// The row whose lookups add nothing to the table's gradient (`nn.Embedding`'s `padding_idx`): the
    /// forward still reads it.
    pub padding_idx: Option<usize>,
}

impl Op for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Embedding
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        let (ids, table) = (i[0], i[1]);
        let (_, hidden) = table.dims2()?;
        let flat = ids.flatten_all()?;
        let mut dims = ids.dims().to_vec();
        dims.push(hidden);
        Ok(vec![table.index_select(&flat, 0)?.reshape(dims)?])
    }
    fn saves(&self) -> Saves {
        Saves::inputs(&[0])
    }
    fn backward(&self, s: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None, None]) };
        let vocab = s.input_shape(1).dims2()?.0;
        Ok(vec![None, Some(embedding_backward(s.input(0)?, g, vocab, self.padding_idx)?)])
    }
}

/// The embedding's backward without a tape: the table's gradient `[vocab, hidden]` in g's dtype from the
/// output's gradient `g: [.., hidden]` and `ids: [..]` (u32 or i64, each below `vocab`), each row the sum of
/// its ids' gradient rows (in the accumulation dtype, rounded once); the row `padding_idx` (when inside the
/// table) gets nothing.
pub fn embedding_backward(ids: &Tensor, g: &Tensor, vocab: usize, padding_idx: Option<usize>) -> Result<Tensor> {
    let ids = ids.flatten_all()?;
    let hidden = g.dim(candle_core::D::Minus1)?;
    let g2 = g.reshape((ids.elem_count(), hidden))?;
    // The padding row's lookups are sent past the table, where they add nothing.
    let ids = match padding_idx.filter(|&p| p < vocab) {
        None => ids,
        Some(p) => {
            let ids = ids.to_dtype(DType::U32)?;
            let past = Tensor::full(vocab as u32, ids.shape(), ids.device())?;
            ids.eq(p as u32)?.where_cond(&past, &ids)?
        }
    };
    row_sums(&ids, &g2, vocab, g.dtype())
}

/// The table's gradient as the old backward made it, kept as the reference the new one is held against
/// (tests and `bench_embedding`; [`embedding_backward`] is the new one): `index_add` of `g: [.., hidden]` (summed in the accumulation dtype) by
/// `ids: [..]` into a zero-filled `[vocab, hidden]` table (a spare row for `padding_idx`'s lookups), rounded
/// to g's dtype -> `[vocab, hidden]`.
pub fn index_add_reference(ids: &Tensor, g: &Tensor, vocab: usize, padding_idx: Option<usize>) -> Result<Tensor> {
    let ids = ids.flatten_all()?;
    let hidden = g.dim(candle_core::D::Minus1)?;
    let acc = Precision::float(g.dtype()).accumulate();
    let g2 = g.reshape((ids.elem_count(), hidden))?.to_dtype(acc)?.contiguous()?;
    let dt = match padding_idx.filter(|&p| p < vocab) {
        None => Tensor::zeros((vocab, hidden), acc, g.device())?.index_add(&ids, &g2, 0)?,
        Some(p) => {
            let ids = ids.to_dtype(DType::U32)?;
            let spare = Tensor::full(vocab as u32, ids.shape(), ids.device())?;
            let ids = ids.eq(p as u32)?.where_cond(&spare, &ids)?;
            Tensor::zeros((vocab + 1, hidden), acc, g.device())?.index_add(&ids, &g2, 0)?.narrow(0, 0, vocab)?
        }
    };
    Ok(dt.to_dtype(g.dtype())?)
}

/// Rows of `table: [vocab, hidden]` for `ids: [..]` -> `[.., hidden]`.
/// Unless the caller checked the ids on the host ([`Tape::inputs_checked`]), refuses an id past the table
/// (one host read of the largest id).
pub fn embedding(tape: &Tape, ids: &Value, table: &Value) -> Result<Value> {
    embedding_padded(tape, ids, table, None)
}

/// [`embedding`] whose row `padding_idx` (when given and inside the table) gets no gradient from the lookup,
/// as `nn.Embedding(vocab, hidden, padding_idx)`: `ids: [..]`, `table: [vocab, hidden]` -> `[.., hidden]`.
/// The row still gets what other uses of the table give it (a tied LM head's gradient).
pub fn embedding_padded(tape: &Tape, ids: &Value, table: &Value, padding_idx: Option<usize>) -> Result<Value> {
    if !tape.inputs_checked() {
        check_ids(ids.tensor(), table.tensor().dim(0)?)?;
    }
    Ok(tape.apply(Embedding { padding_idx }, &[ids, table])?.remove(0))
}

/// Refuses an id of `ids` (any shape, integer) at or past `vocab` rows, reading back only the largest id.
pub(crate) fn check_ids(ids: &Tensor, vocab: usize) -> Result<()> {
    if ids.elem_count() == 0 {
        return Ok(());
    }
    let max = crate::host_read::read_f64(&ids.flatten_all()?.max_keepdim(0)?)?;
    if max >= vocab as f64 {
        return Err(Error::InvalidArgument {
            op: "embedding",
            msg: format!("token id {max} is out of range for a table of {vocab} rows"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CheckpointPolicy;
    use candle_core::Device;

    /// 300 lookups of one token with gradient 1 each: the table's gradient row is 300 (exact in bf16), where
    /// a bf16 running sum would stop at 256 (256 + 1 rounds back to 256).
    #[test]
    fn repeated_ids_sum_in_f32_for_bf16_tables() {
        let tape = Tape::new(CheckpointPolicy::None);
        let table = tape.leaf(Tensor::zeros((4, 2), DType::BF16, &Device::Cpu).unwrap());
        let ids = tape.constant(Tensor::from_vec(vec![3u32; 300], 300, &Device::Cpu).unwrap());
        let y = embedding(&tape, &ids, &table).unwrap();
        let loss = crate::ops::sum_all(&tape, &y).unwrap();
        tape.backward(&loss).unwrap();
        let g = tape.grad(&table).unwrap().unwrap();
        assert_eq!(g.dtype(), DType::BF16);
        let rows = g.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(rows, vec![vec![0.0, 0.0], vec![0.0, 0.0], vec![0.0, 0.0], vec![300.0, 300.0]]);
    }

    /// Ids `[1, 3, 1, 0, 3, 3]` (i64 and u32) with padding row 3: the table's gradient is the plain op's with
    /// row 3 zero (every other row exactly equal), the forward unchanged; a padding id past the table (as
    /// Phi-3's default 32000 on a small vocabulary) changes nothing.
    #[test]
    fn the_padding_row_gets_no_gradient() {
        let dev = Device::Cpu;
        let table = Tensor::from_vec((0..20).map(|i| (i as f64 * 0.3).sin()).collect(), (5, 4), &dev).unwrap();
        let dy = Tensor::from_vec((0..24).map(|i| (i as f64 * 0.7).cos()).collect(), (6, 4), &dev).unwrap();
        let run = |ids: Tensor, padding_idx: Option<usize>| {
            let tape = Tape::new(CheckpointPolicy::None);
            let t = tape.leaf(table.clone());
            let y = embedding_padded(&tape, &tape.constant(ids), &t, padding_idx).unwrap();
            let loss =
                crate::ops::sum_all(&tape, &crate::ops::mul(&tape, &y, &tape.constant(dy.clone())).unwrap()).unwrap();
            tape.backward(&loss).unwrap();
            (y.tensor().to_vec2::<f64>().unwrap(), tape.grad(&t).unwrap().unwrap().to_vec2::<f64>().unwrap())
        };
        let ids = [1i64, 3, 1, 0, 3, 3];
        let (y0, g0) = run(Tensor::new(&ids, &dev).unwrap(), None);
        assert!(g0[3].iter().any(|&v| v != 0.0), "the plain op gives row 3 a gradient");
        let u32_ids = Tensor::new(&ids.map(|i| i as u32), &dev).unwrap();
        for ids in [Tensor::new(&ids, &dev).unwrap(), u32_ids] {
            let (y, g) = run(ids, Some(3));
            assert_eq!(y, y0);
            for (row, (a, b)) in g.iter().zip(&g0).enumerate() {
                if row == 3 {
                    assert_eq!(a, &vec![0.0; 4]);
                } else {
                    assert_eq!(a, b, "row {row}");
                }
            }
        }
        assert_eq!(run(Tensor::new(&ids, &dev).unwrap(), Some(32000)).1, g0);
    }
    /// The backward against the old `index_add` into zeros ([`index_add_reference`]), 300 tokens over 37 rows
    /// (ids repeat up to 16 times; rows 0 and 36 never seen), with and without a padding row: bit for bit on
    /// the CPU kernel (the same terms in the same order) in f32, f64, bf16 and f16; the generic kernel (a
    /// one-hot GEMM, the GEMM's summation order) within 1e-6 of the largest element in f32, 1e-15 in f64 and
    /// one rounding (2^-8 of the largest element) in bf16 and f16.
    #[test]
    fn row_sums_equal_the_old_index_add() {
        use crate::dispatch::{with_kernels, Kernels};
        let dev = Device::Cpu;
        let (vocab, hidden, t) = (37, 5, 300);
        let ids: Vec<u32> = (0..t as u32).map(|i| 1 + (i * 7 + i * i / 11) % 35).collect();
        let ids = Tensor::from_vec(ids, (3, t / 3), &dev).unwrap();
        let g64 =
            Tensor::from_vec((0..t * hidden).map(|i| (i as f64 * 0.37).sin()).collect(), (3, t / 3, hidden), &dev)
                .unwrap();
        let backward = |ids: &Tensor, g: &Tensor, padding_idx: Option<usize>| {
            let op = Embedding { padding_idx };
            let tape = Tape::new(CheckpointPolicy::None);
            let table = tape.leaf(Tensor::zeros((vocab, hidden), g.dtype(), &dev).unwrap());
            let y = tape.apply(op, &[&tape.constant(ids.clone()), &table]).unwrap().remove(0);
            let loss =
                crate::ops::sum_all(&tape, &crate::ops::mul(&tape, &y, &tape.constant(g.clone())).unwrap()).unwrap();
            tape.backward(&loss).unwrap();
            tape.grad(&table).unwrap().unwrap()
        };
        let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let rel = |a: &Tensor, b: &Tensor| {
            let (a, b) = (bits(a), bits(b));
            let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
            a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale
        };
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let g = g64.to_dtype(dtype).unwrap();
            for padding_idx in [None, Some(3), Some(36)] {
                let want = index_add_reference(&ids, &g, vocab, padding_idx).unwrap();
                let got = with_kernels(Kernels::Auto, || backward(&ids, &g, padding_idx));
                assert_eq!(got.dtype(), dtype);
                let same = bits(&got).iter().zip(bits(&want)).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype:?} {padding_idx:?}: the CPU kernel differs from index_add");
                let generic = with_kernels(Kernels::Generic, || backward(&ids, &g, padding_idx));
                let tol = match dtype {
                    DType::F64 => 1e-15,
                    DType::F32 => 1e-6,
                    _ => 1.0 / 256.0,
                };
                let err = rel(&generic, &want);
                assert!(err <= tol, "{dtype:?} {padding_idx:?}: generic kernel {err:e} from index_add");
                if let Some(p) = padding_idx {
                    assert!(bits(&got.narrow(0, p, 1).unwrap()).iter().all(|&v| v == 0.0));
                    assert!(bits(&generic.narrow(0, p, 1).unwrap()).iter().all(|&v| v == 0.0));
                }
            }
        }
    }
}
