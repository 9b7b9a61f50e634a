//! [`KvBlocks`]: one layer's part of a KV cache as one rank holds it, in blocks. A prefill hands over its
//! rows as one block (the tensors the layer computed, not copied); each decoded token's row is written in
//! place into a block of [`KvBlocks::block_rows`] rows, and a new block is allocated when the last one is full,
//! so that a token never copies the rows before it (no concatenation per token).
//!
//! The rows are a set, not a sequence: a rank of a sequence-parallel run holds the keys of its shard
//! (Ring's zigzag chunks, for instance) and of the decoded tokens given to it, at whatever positions; a
//! decode query sees every cached key at an earlier position, so their order never matters. Each row's
//! position is kept beside it, ascending within a block (a shard's positions ascend in every layout, and
//! decoded tokens come in order), so that a sliding window (keys at positions `>= first`) is a row offset per
//! block: [`KvBlocks::views_from`] narrows each block's view, nothing copied.
//! Keys are stored after RoPE, head-major (`[kv_heads, rows, head_dim]`), so that a decode query reads each
//! head's keys and values as one contiguous matrix (a matmul, no packing or copy per token).

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// Rows per block of decoded tokens unless asked otherwise ([`KvBlocks::with_block_rows`]).
pub const DEFAULT_BLOCK_ROWS: usize = 256;

/// One block: `k, v: [kv_heads, capacity, head_dim]`, rows `0..positions.len()` written, row `i` at
/// sequence position `positions[i]` (ascending).
#[derive(Clone, Debug)]
struct Block {
    k: Tensor,
    v: Tensor,
    positions: Vec<usize>,
}

impl Block {
    /// Rows written: one position each.
    fn filled(&self) -> usize {
        self.positions.len()
    }

    fn capacity(&self) -> usize {
        self.k.dim(1).unwrap_or(0)
    }
}

/// `[1, rows, kv_heads, head_dim]` -> `[kv_heads, rows, head_dim]`, contiguous.
fn head_major(x: &Tensor) -> Result<Tensor> {
    Ok(x.squeeze(0)?.transpose(0, 1)?.contiguous()?)
}

/// One layer's cached keys and values on one rank, in blocks (see the module doc). Batch 1.
#[derive(Clone, Debug)]
pub struct KvBlocks {
    blocks: Vec<Block>,
    block_rows: usize,
}

impl Default for KvBlocks {
    fn default() -> Self {
        Self::with_block_rows(DEFAULT_BLOCK_ROWS)
    }
}

/// The error of positions that do not fit the rows (`op` names the call).
fn positions_error(op: &'static str, msg: String) -> Error {
    autosp_core::Error::InvalidArgument { op, msg }.into()
}

/// `k` and `v` must both be `[1, rows, kv_heads, head_dim]`, alike in shape, dtype and device.
fn check_pair(op: &'static str, k: &Tensor, v: &Tensor) -> Result<()> {
    let ok = k.rank() == 4 && k.dim(0)? == 1 && k.dims() == v.dims();
    if !ok {
        return Err(Error::Shape { op, name: "v", got: v.dims().to_vec(), want: k.dims().to_vec(), q_shape: vec![] });
    }
    if k.dtype() != v.dtype() {
        return Err(Error::DTypeMismatch { op, name: "v", got: v.dtype(), want: k.dtype() });
    }
    Ok(())
}

impl KvBlocks {
    /// An empty part whose decode blocks hold `block_rows` rows each (at least 1).
    pub fn with_block_rows(block_rows: usize) -> Self {
        Self { blocks: Vec::new(), block_rows: block_rows.max(1) }
    }

    /// Rows per block of decoded tokens.
    pub fn block_rows(&self) -> usize {
        self.block_rows
    }

    /// Adds `rows` rows at once (a prefill's shard): `k, v: [1, rows, kv_heads, head_dim]` at the ascending
    /// sequence positions `positions` (`rows` of them), as one full block (copied once into the head-major
    /// layout). Zero rows add nothing.
    pub fn push_rows(&mut self, k: &Tensor, v: &Tensor, positions: &[usize]) -> Result<()> {
        check_pair("KvBlocks::push_rows", k, v)?;
        let rows = k.dim(1)?;
        if positions.len() != rows || positions.windows(2).any(|w| w[0] >= w[1]) {
            return Err(positions_error(
                "KvBlocks::push_rows",
                format!("{rows} rows at positions {positions:?}: give one ascending position per row"),
            ));
        }
        if rows > 0 {
            let positions = positions.to_vec();
            self.blocks.push(Block { k: head_major(k)?, v: head_major(v)?, positions });
        }
        Ok(())
    }

    /// Adds one token's row, `k, v: [1, 1, kv_heads, head_dim]`, at sequence position `position` (past every
    /// position the last block holds), written in place into the last block, or into a new block of
    /// [`block_rows`](Self::block_rows) rows when it is full (or was a prefill's).
    pub fn push_token(&mut self, k: &Tensor, v: &Tensor, position: usize) -> Result<()> {
        check_pair("KvBlocks::push_token", k, v)?;
        if let Some(&last) = self.blocks.last().and_then(|b| b.positions.last()) {
            if position <= last {
                return Err(positions_error(
                    "KvBlocks::push_token",
                    format!("position {position} after a row at {last}: decode tokens in order of position"),
                ));
            }
        }
        if k.dim(1)? != 1 {
            return Err(Error::Shape {
                op: "KvBlocks::push_token",
                name: "k",
                got: k.dims().to_vec(),
                want: vec![1, 1, k.dim(2)?, k.dim(3)?],
                q_shape: vec![],
            });
        }
        let full = self.blocks.last().is_none_or(|b| b.filled() == b.capacity());
        if full {
            let (_, _, h, d) = k.dims4()?;
            let shape = (h, self.block_rows, d);
            let (kz, vz) = (Tensor::zeros(shape, k.dtype(), k.device())?, Tensor::zeros(shape, v.dtype(), v.device())?);
            self.blocks.push(Block { k: kz, v: vz, positions: Vec::with_capacity(self.block_rows) });
        }
        let b = self.blocks.last_mut().expect("a block with room was just ensured");
        if [b.k.dim(0)?, b.k.dim(2)?] != k.dims()[2..] || b.k.dtype() != k.dtype() {
            return Err(Error::Shape {
                op: "KvBlocks::push_token",
                name: "k",
                got: k.dims().to_vec(),
                want: vec![1, 1, b.k.dim(0)?, b.k.dim(2)?],
                q_shape: vec![],
            });
        }
        b.k.slice_set(&head_major(k)?, 1, b.filled())?;
        b.v.slice_set(&head_major(v)?, 1, b.filled())?;
        b.positions.push(position);
        Ok(())
    }

    /// The written rows of each block: `(k, v)`, each `[kv_heads, rows, head_dim]` (views, not copies).
    pub fn views(&self) -> Result<Vec<(Tensor, Tensor)>> {
        self.views_from(0)
    }

    /// The written rows at positions `first` or later of each block that has any: `(k, v)`, each `[kv_heads,
    /// rows, head_dim]` (views narrowed past the earlier rows, not copies). A sliding window's keys.
    pub fn views_from(&self, first: usize) -> Result<Vec<(Tensor, Tensor)>> {
        let mut out = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            let skip = b.positions.partition_point(|&p| p < first);
            if skip < b.filled() {
                let rows = b.filled() - skip;
                out.push((b.k.narrow(1, skip, rows)?, b.v.narrow(1, skip, rows)?));
            }
        }
        Ok(out)
    }

    /// Rows held, read from the views' shapes.
    pub fn rows(&self) -> Result<usize> {
        Ok(self.views()?.iter().map(|(k, _)| k.dim(1).unwrap_or(0)).sum())
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.iter().all(|b| b.filled() == 0)
    }

    /// Bytes allocated for keys and values (whole blocks, the unwritten rows of the last one included).
    pub fn bytes(&self) -> usize {
        self.blocks.iter().map(|b| 2 * b.k.elem_count() * b.k.dtype().size_in_bytes()).sum()
    }

    /// The blocks' dtype (`None` while empty).
    pub fn dtype(&self) -> Option<DType> {
        self.blocks.first().map(|b| b.k.dtype())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, IndexOp};

    #[test]
    fn tokens_fill_blocks_in_place_and_rows_read_back_in_order() -> Result<()> {
        let dev = Device::Cpu;
        let mut part = KvBlocks::with_block_rows(3);
        let pre = Tensor::arange(0f32, 2. * 2. * 4., &dev)?.reshape((1, 2, 2, 4))?;
        part.push_rows(&pre, &pre.neg()?, &[0, 3])?;
        let mut want = vec![pre.clone()];
        for t in 0..5 {
            let row = Tensor::full(100f32 + t as f32, (1, 1, 2, 4), &dev)?;
            part.push_token(&row, &row.neg()?, 4 + t)?;
            want.push(row);
        }
        // The prefill block, one full decode block of 3 and one of 2 written rows.
        let views = part.views()?;
        assert_eq!(views.iter().map(|(k, _)| k.dim(1).unwrap()).collect::<Vec<_>>(), vec![2, 3, 2]);
        assert_eq!(part.rows()?, 7);
        assert_eq!(part.bytes(), 2 * 4 * (2 * 2 * 4 + 2 * 3 * 2 * 4));
        // Read back in the model's layout, `[1, rows, kv_heads, head_dim]`, in the order written.
        let back = |x: &Tensor| x.transpose(0, 1).and_then(|t| t.unsqueeze(0));
        let ks: Vec<Tensor> = views.iter().map(|(k, _)| back(k)).collect::<candle_core::Result<_>>()?;
        let got = Tensor::cat(&ks, 1)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(got, Tensor::cat(&want, 1)?.flatten_all()?.to_vec1::<f32>()?);
        let vs: Vec<Tensor> = views.iter().map(|(_, v)| back(v)).collect::<candle_core::Result<_>>()?;
        assert_eq!(Tensor::cat(&vs, 1)?.flatten_all()?.to_vec1::<f32>()?, got.iter().map(|x| -x).collect::<Vec<_>>());
        // A row of another head layout is refused.
        assert!(part
            .push_token(
                &Tensor::zeros((1, 1, 3, 4), DType::F32, &dev)?,
                &Tensor::zeros((1, 1, 3, 4), DType::F32, &dev)?,
                9
            )
            .is_err());
        // The positions kept (0 and 3, then 4..=8) as the rows at or past each position.
        let past = |p| -> Result<usize> { Ok(part.views_from(p)?.iter().map(|(k, _)| k.dim(1).unwrap()).sum()) };
        assert_eq!((0..=9).map(past).collect::<Result<Vec<_>>>()?, vec![7, 6, 6, 6, 5, 4, 3, 2, 1, 0]);
        // A window from position 5 narrows each block past its earlier rows: none of the prefill's (0, 3),
        // the decode block's 4 left out, the last block whole.
        let from5: Vec<Vec<f32>> = part
            .views_from(5)?
            .iter()
            .map(|(k, _)| k.i((0, .., 0)))
            .map(|k| k?.to_vec1())
            .collect::<candle_core::Result<_>>()?;
        assert_eq!(from5, vec![vec![101., 102.], vec![103., 104.]]);
        assert_eq!(part.views_from(3)?.iter().map(|(k, _)| k.dim(1).unwrap()).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert!(part.views_from(9)?.is_empty());
        // Positions out of order are refused, in a shard and after the last token.
        let row = Tensor::zeros((1, 1, 2, 4), DType::F32, &dev)?;
        assert!(part.push_token(&row, &row, 8).is_err());
        assert!(KvBlocks::default().push_rows(&pre, &pre, &[3, 3]).is_err());
        assert!(KvBlocks::default().push_rows(&pre, &pre, &[3]).is_err());
        Ok(())
    }
}
