//! The embedding's backward kernel: the table's gradient as sums of gradient rows by token id, without
//! `index_add` and without a zero-filled accumulation table in f32.
//!
//! - CPU ([`Route::Cpu`]): the token positions sorted by id (stable, so each id keeps its tokens' order),
//!   each id's rows summed in the accumulation dtype in token order and rounded once into its row of the
//!   result, which is made in the gradient's dtype: only touched rows are written (an f32 result comes from
//!   zeroed pages the kernel never touches elsewhere; no f32 table beside a bf16 one). Bit for bit the old
//!   `index_add` into zeros (the same terms in the same order, from the same zero).
//! - Generic ([`Route::Generic`]: CUDA, Metal, or the CPU when forced): a one-hot GEMM tiled over the rows,
//!   `onehot[rows_tile, t] @ g[t, hidden]`, in the gradient's dtype (bf16 GEMMs with f32 accumulation on a
//!   GPU; 0 and 1 are exact in every dtype), tiles concatenated: no host read, no atomics, no loop over
//!   tokens in one thread block. It costs `2 t rows hidden` flops (about 4 TFLOP for 8K tokens and Llama 3's
//!   128K x 2048 table: milliseconds on tensor cores), in the GEMM's summation order.

use candle_core::{DType, Device, Storage, Tensor, WithDType};

use crate::dispatch::{select, Route};
use crate::precision::Precision;
use crate::{Error, Result};

/// Elements of the one-hot tile of the generic kernel at most (`rows_tile * t`): 16 Mi, 64 MiB in f32.
const ONEHOT_ELEMENTS: usize = 1 << 24;

/// `sum over i with ids[i] == r of g[i]` for every row `r` of `[rows, hidden]`: `ids: [t]` (u32), `g: [t,
/// hidden]` (f32, f64, bf16 or f16) -> `[rows, hidden]` in `out` (g's dtype or wider). Ids at or past `rows`
/// add nothing (a padding row mapped there, or tokens outside a shard's rows). The sums run in g's
/// accumulation dtype (f32 for bf16/f16) and are rounded once to `out`.
pub(crate) fn row_sums(ids: &Tensor, g: &Tensor, rows: usize, out: DType) -> Result<Tensor> {
    let (t, hidden) = g.dims2()?;
    if ids.dims() != [t] {
        return Err(Error::Internal(format!("row_sums: ids {:?} for {t} gradient rows", ids.dims())));
    }
    let acc = Precision::float(g.dtype()).accumulate();
    match select(g) {
        Route::Cpu => {
            let ids = ids.to_dtype(DType::U32)?.contiguous()?;
            let g = g.to_dtype(acc)?.contiguous()?;
            let ids = host::<u32>(&ids)?;
            match (acc, out) {
                (DType::F32, DType::F32) => cpu::<f32, f32>(&ids, &g, hidden, rows),
                (DType::F32, DType::BF16) => cpu::<f32, half::bf16>(&ids, &g, hidden, rows),
                (DType::F32, DType::F16) => cpu::<f32, half::f16>(&ids, &g, hidden, rows),
                (DType::F64, DType::F64) => cpu::<f64, f64>(&ids, &g, hidden, rows),
                (acc, out) => Err(Error::Internal(format!("row_sums: sums in {acc:?} rounded to {out:?}"))),
            }
        }
        Route::Generic => generic(ids, g, rows, out, ONEHOT_ELEMENTS),
    }
}

/// A contiguous CPU tensor's elements, copied out (for the small `[t]` ids).
fn host<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return Err(Error::Internal("row_sums: ids not on the CPU".into())) };
    let (a, b) = layout.contiguous_offsets().ok_or_else(|| Error::Internal("row_sums: non-contiguous ids".into()))?;
    Ok(cpu.as_slice::<T>()?[a..b].to_vec())
}

/// The CPU kernel: `g` contiguous in the accumulation dtype `A`, the result in `O`.
fn cpu<A: WithDType, O: WithDType>(ids: &[u32], g: &Tensor, hidden: usize, rows: usize) -> Result<Tensor> {
    let mut order: Vec<u32> = (0..ids.len() as u32).filter(|&i| (ids[i as usize] as usize) < rows).collect();
    // Stable: the tokens of one id stay in their order, so each sum adds its terms as index_add did.
    order.sort_by_key(|&i| ids[i as usize]);
    let mut out = vec![O::zero(); rows * hidden];
    {
        let (storage, layout) = g.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else { return Err(Error::Internal("row_sums: g not on the CPU".into())) };
        let (a, b) = layout.contiguous_offsets().ok_or_else(|| Error::Internal("row_sums: non-contiguous".into()))?;
        let g = &cpu.as_slice::<A>()?[a..b];
        let mut sum = vec![A::zero(); hidden];
        for segment in order.chunk_by(|&a, &b| ids[a as usize] == ids[b as usize]) {
            // From zero, as the old accumulation table started (0 + -0.0 is +0.0 there too).
            sum.fill(A::zero());
            for &i in segment {
                for (s, &v) in sum.iter_mut().zip(&g[i as usize * hidden..][..hidden]) {
                    *s += v;
                }
            }
            let row = ids[segment[0] as usize] as usize;
            for (o, s) in out[row * hidden..][..hidden].iter_mut().zip(&sum) {
                *o = O::from_f64(s.to_f64());
            }
        }
    }
    Ok(Tensor::from_vec(out, (rows, hidden), &Device::Cpu)?)
}

/// The generic kernel: one-hot GEMMs over tiles of rows (`onehot_elements` at most per tile), in g's dtype,
/// rounded to `out`.
fn generic(ids: &Tensor, g: &Tensor, rows: usize, out: DType, onehot_elements: usize) -> Result<Tensor> {
    let (t, hidden) = g.dims2()?;
    if t == 0 || rows == 0 {
        return Ok(Tensor::zeros((rows, hidden), out, g.device())?);
    }
    let ids = ids.to_dtype(DType::U32)?.reshape((1, t))?;
    let g = g.contiguous()?;
    let tile = (onehot_elements / t).clamp(1, rows);
    let mut parts = Vec::with_capacity(rows.div_ceil(tile));
    let mut start = 0;
    while start < rows {
        let n = tile.min(rows - start);
        let row_ids = Tensor::arange(start as u32, (start + n) as u32, g.device())?.reshape((n, 1))?;
        let onehot = row_ids.broadcast_eq(&ids)?.to_dtype(g.dtype())?;
        parts.push(onehot.matmul(&g)?.to_dtype(out)?);
        start += n;
    }
    Ok(if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 0)? })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiles of rows (here 4 of 37 rows a tile, the last one short) give the one-tile result bit for bit: each
    /// row's sum is one GEMM row, whatever tile it falls in.
    #[test]
    fn the_generic_kernels_tiles_cover_every_row_once() {
        let dev = Device::Cpu;
        let (rows, hidden, t) = (37, 5, 60);
        let ids = Tensor::from_vec((0..t as u32).map(|i| (i * 7) % 40).collect::<Vec<u32>>(), t, &dev).unwrap();
        let g =
            Tensor::from_vec((0..t * hidden).map(|i| (i as f32 * 0.37).sin()).collect(), (t, hidden), &dev).unwrap();
        let whole = generic(&ids, &g, rows, DType::F32, usize::MAX).unwrap();
        let tiled = generic(&ids, &g, rows, DType::F32, 4 * t).unwrap();
        assert_eq!(tiled.dims(), [rows, hidden]);
        let (a, b) = (
            whole.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            tiled.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(a, b);
        let cpu = row_sums(&ids, &g, rows, DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let worst = a.iter().zip(&cpu).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 1e-5, "tiled generic kernel {worst} from the CPU kernel");
    }
}
