//! [`KvBlocks`]: one layer's part of a KV cache as one rank holds it, in blocks. A prefill hands over its
//! rows as one block (the tensors the layer computed, not copied); each decoded token's row is written in
//! place into a block of [`KvBlocks::block_rows`] rows, and a new block is allocated when the last one is full,
//! so that a token never copies the rows before it (no concatenation per token).
//!
//! The rows are a set, not a sequence: a rank of a sequence-parallel run holds the keys of its shard
//! (Ring's zigzag chunks, for instance) and of the decoded tokens given to it, at whatever positions; a
//! decode query sees every cached key (every one is at an earlier position), so their order never matters.
//! Keys are stored after RoPE, head-major (`[kv_heads, rows, head_dim]`), so that a decode query reads each
//! head's keys and values as one contiguous matrix (a matmul, no packing or copy per token).

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// Rows per block of decoded tokens unless asked otherwise ([`KvBlocks::with_block_rows`]).
pub const DEFAULT_BLOCK_ROWS: usize = 256;

/// One block: `k, v: [kv_heads, capacity, head_dim]`, rows `0..filled` written.
#[derive(Clone, Debug)]
struct Block {
    k: Tensor,
    v: Tensor,
    filled: usize,
}

impl Block {
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

    /// Adds `rows` rows at once (a prefill's shard): `k, v: [1, rows, kv_heads, head_dim]`, as one full block
    /// (copied once into the head-major layout). Zero rows add nothing.
    pub fn push_rows(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        check_pair("KvBlocks::push_rows", k, v)?;
        let rows = k.dim(1)?;
        if rows > 0 {
            self.blocks.push(Block { k: head_major(k)?, v: head_major(v)?, filled: rows });
        }
        Ok(())
    }

    /// Adds one token's row, `k, v: [1, 1, kv_heads, head_dim]`, written in place into the last block, or into
    /// a new block of [`block_rows`](Self::block_rows) rows when it is full (or was a prefill's).
    pub fn push_token(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        check_pair("KvBlocks::push_token", k, v)?;
        if k.dim(1)? != 1 {
            return Err(Error::Shape {
                op: "KvBlocks::push_token",
                name: "k",
                got: k.dims().to_vec(),
                want: vec![1, 1, k.dim(2)?, k.dim(3)?],
                q_shape: vec![],
            });
        }
        let full = self.blocks.last().is_none_or(|b| b.filled == b.capacity());
        if full {
            let (_, _, h, d) = k.dims4()?;
            let shape = (h, self.block_rows, d);
            let (kz, vz) = (Tensor::zeros(shape, k.dtype(), k.device())?, Tensor::zeros(shape, v.dtype(), v.device())?);
            self.blocks.push(Block { k: kz, v: vz, filled: 0 });
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
        b.k.slice_set(&head_major(k)?, 1, b.filled)?;
        b.v.slice_set(&head_major(v)?, 1, b.filled)?;
        b.filled += 1;
        Ok(())
    }

    /// The written rows of each block: `(k, v)`, each `[kv_heads, rows, head_dim]` (views, not copies).
    pub fn views(&self) -> Result<Vec<(Tensor, Tensor)>> {
        self.blocks
            .iter()
            .filter(|b| b.filled > 0)
            .map(|b| Ok((b.k.narrow(1, 0, b.filled)?, b.v.narrow(1, 0, b.filled)?)))
            .collect()
    }

    /// Rows held, read from the views' shapes.
    pub fn rows(&self) -> Result<usize> {
        Ok(self.views()?.iter().map(|(k, _)| k.dim(1).unwrap_or(0)).sum())
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.iter().all(|b| b.filled == 0)
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
    use candle_core::Device;

    #[test]
    fn tokens_fill_blocks_in_place_and_rows_read_back_in_order() -> Result<()> {
        let dev = Device::Cpu;
        let mut part = KvBlocks::with_block_rows(3);
        let pre = Tensor::arange(0f32, 2. * 2. * 4., &dev)?.reshape((1, 2, 2, 4))?;
        part.push_rows(&pre, &pre.neg()?)?;
        let mut want = vec![pre.clone()];
        for t in 0..5 {
            let row = Tensor::full(100f32 + t as f32, (1, 1, 2, 4), &dev)?;
            part.push_token(&row, &row.neg()?)?;
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
                &Tensor::zeros((1, 1, 3, 4), DType::F32, &dev)?
            )
            .is_err());
        Ok(())
    }
}
