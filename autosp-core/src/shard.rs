//! Model states sharded over ranks, ZeRO-style: how much of a parameter's state each rank keeps
//! ([`ShardLevel`]), and the flat slicing of one parameter over a group ([`ShardLayout`]): rank r owns elements
//! `r·chunk .. (r+1)·chunk` of the flattened parameter, `chunk = ceil(numel / size)`, the last slices padded
//! with zeros. A sharded [`Param`](crate::Param) carries its [`ParamShard`]; the tape, the optimisers and the
//! compile step read it.
//!
//! | level | parameters | gradients handed to the optimiser | optimiser state (moments, f32 masters) |
//! |---|---|---|---|
//! | `None` | whole, every rank | whole, all-reduced | whole |
//! | `Optimizer` | whole | this rank's slice (reduce-scattered after backward) | the slice; parameters all-gathered after the update |
//! | `Gradients` | whole | the slice, reduce-scattered in backward as each use's gradient completes | the slice; all-gathered after the update |
//! | `Parameters` | this rank's slice; gathered for each use, freed after | the slice, as `Gradients` | the slice; no gather after the update |

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Shape, Tensor};

use crate::comm::{ProcessGroup, ReduceOp};
use crate::precision::Precision;
use crate::Result;

/// How much of the model state each rank keeps (see the module doc for the table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ShardLevel {
    /// Every rank keeps everything.
    #[default]
    None,
    /// Optimizer state (moments, f32 masters) sharded; gradients reduce-scattered after backward.
    Optimizer,
    /// Also gradients: reduce-scattered during backward, never whole after their reduction.
    Gradients,
    /// Also parameters: each rank stores a slice; the whole weight exists only while an op uses it.
    Parameters,
}

impl ShardLevel {
    /// Every level, least sharded first.
    pub const ALL: [ShardLevel; 4] =
        [ShardLevel::None, ShardLevel::Optimizer, ShardLevel::Gradients, ShardLevel::Parameters];

    /// The lower-case name (`none`, `optimizer`, `gradients`, `parameters`), as `--shard` takes it.
    pub fn name(self) -> &'static str {
        match self {
            ShardLevel::None => "none",
            ShardLevel::Optimizer => "optimizer",
            ShardLevel::Gradients => "gradients",
            ShardLevel::Parameters => "parameters",
        }
    }
}

impl std::fmt::Display for ShardLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ShardLevel {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim().to_ascii_lowercase();
        ShardLevel::ALL.into_iter().find(|l| l.name() == s).ok_or_else(|| {
            format!("--shard {s:?} is not a sharding level: use none, optimizer, gradients or parameters")
        })
    }
}

/// The flat slicing of one parameter of `numel` elements over `size` ranks: rank `rank` owns
/// `rank·chunk .. (rank+1)·chunk` of the flattened parameter padded to `size·chunk` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    /// Elements of the whole parameter.
    pub numel: usize,
    /// Elements of each slice, `ceil(numel / size)`.
    pub chunk: usize,
    /// This rank.
    pub rank: usize,
    /// Ranks the parameter is sliced over.
    pub size: usize,
}

impl ShardLayout {
    /// The layout of a parameter of `numel` elements on `rank` of `size` ranks.
    pub fn new(numel: usize, rank: usize, size: usize) -> Self {
        let size = size.max(1);
        Self { numel, chunk: numel.div_ceil(size), rank, size }
    }

    /// The real (not padding) elements of the flattened parameter this rank owns.
    pub fn owned(&self) -> Range<usize> {
        let start = (self.rank * self.chunk).min(self.numel);
        start..((self.rank + 1) * self.chunk).min(self.numel)
    }

    /// `x` (any shape, `numel` elements) flattened and padded with zeros to `size·chunk` elements, as
    /// `[size, chunk]`: row r is rank r's slice.
    pub fn padded_rows(&self, x: &Tensor) -> Result<Tensor> {
        let flat = x.flatten_all()?;
        let pad = self.size * self.chunk - self.numel;
        let flat = if pad > 0 { flat.pad_with_zeros(0, 0, pad)? } else { flat };
        Ok(flat.reshape((self.size, self.chunk))?)
    }

    /// This rank's slice of a whole tensor `x` (any shape, `numel` elements): `[chunk]`, zero-padded, a copy
    /// in its own storage (a row of the padded `[size, chunk]` view is contiguous already, and keeping it as
    /// a view would keep the whole tensor alive behind every rank's slice).
    pub fn slice(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.padded_rows(x)?.get(self.rank)?.force_contiguous()?)
    }

    /// The whole tensor of `shape` from every rank's slice (`slice: [chunk]`; collective over `group`, whose
    /// size and rank are this layout's). Thread ranks get one tensor they all hold
    /// ([`all_gather_once`](crate::comm::all_gather_once)), not a copy each. Noted by [`note_gathered`].
    pub fn gather(&self, group: &dyn ProcessGroup, slice: &Tensor, shape: &Shape) -> Result<Tensor> {
        let all = crate::comm::all_gather_once(group, &slice.reshape((1, self.chunk))?, 0)?;
        note_gathered(&all);
        Ok(all.flatten_all()?.narrow(0, 0, self.numel)?.reshape(shape)?)
    }

    /// The sum over `group` of every rank's whole gradient `g` (any shape, `numel` elements), of which this rank
    /// keeps its slice `[chunk]`, in the reduction dtype ([`Precision::reduce`]: f32 for bf16/f16/f32, f64 for
    /// f64). Collective.
    pub fn reduce_scatter(&self, group: &dyn ProcessGroup, g: &Tensor) -> Result<Tensor> {
        self.reduce_scatter_as(group, g, Precision::float(g.dtype()).reduce())
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with f32 gradients sent in `wire` ([`wire_dtype`]: bf16
    /// halves the bytes; the back ends sum bf16 in f32 and round each reduced chunk once); the slice comes
    /// back in the reduction dtype.
    pub fn reduce_scatter_as(&self, group: &dyn ProcessGroup, g: &Tensor, wire: DType) -> Result<Tensor> {
        let reduce = Precision::float(g.dtype()).reduce();
        let rows = self.padded_rows(&g.to_dtype(reduce)?)?.to_dtype(wire_dtype(reduce, wire))?;
        let mine = group.reduce_scatter(&rows, 0, ReduceOp::Sum)?;
        Ok(mine.reshape(self.chunk)?.to_dtype(reduce)?)
    }
}

/// The dtype a gradient of reduction dtype `reduce` travels in when `wire` is asked for: `wire` for f32
/// gradients, f64 as it is (f64 gradients are checks, never rounded).
pub fn wire_dtype(reduce: DType, wire: DType) -> DType {
    if reduce == DType::F32 {
        wire
    } else {
        reduce
    }
}

thread_local! {
    /// The bytes of the largest tensor of weights this thread gathered since [`take_largest_gathered`].
    static LARGEST_GATHERED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Notes a tensor of weights gathered from slices (a whole parameter, a vocabulary tile of the LM head), for
/// [`take_largest_gathered`]: every gather of sharded weights calls it. Per thread, so per thread rank.
pub fn note_gathered(t: &Tensor) {
    let bytes = crate::memory::storage_bytes(t);
    LARGEST_GATHERED.with(|c| c.set(c.get().max(bytes)));
}

/// The bytes of the largest weight tensor this thread gathered ([`note_gathered`]) since the last call, and a
/// fresh start: what a test or a benchmark compares with one block's weights.
pub fn take_largest_gathered() -> usize {
    LARGEST_GATHERED.with(|c| c.replace(0))
}

/// The sharding of one parameter: the level, the group its state is sliced over, its layout there and its
/// whole shape.
#[derive(Clone, Debug)]
pub struct ParamShard {
    /// How much of the state is sliced.
    pub level: ShardLevel,
    /// The ranks the state is sliced over (the whole world of a compiled model).
    pub group: Arc<dyn ProcessGroup>,
    /// This rank's slice.
    pub layout: ShardLayout,
    /// The whole parameter's shape.
    pub shape: Shape,
}

impl ParamShard {
    /// The sharding of a parameter of `shape` over `group` at `level`.
    pub fn new(level: ShardLevel, group: Arc<dyn ProcessGroup>, shape: Shape) -> Self {
        let layout = ShardLayout::new(shape.elem_count(), group.rank(), group.size());
        Self { level, group, layout, shape }
    }

    /// This rank's slice of a whole tensor of the parameter's shape (see [`ShardLayout::slice`]).
    pub fn slice(&self, whole: &Tensor) -> Result<Tensor> {
        self.layout.slice(whole)
    }

    /// The whole tensor from every rank's slice (collective; see [`ShardLayout::gather`]).
    pub fn gather(&self, slice: &Tensor) -> Result<Tensor> {
        self.layout.gather(self.group.as_ref(), slice, &self.shape)
    }

    /// The reduced gradient slice of every rank's whole gradient (collective; see
    /// [`ShardLayout::reduce_scatter`]).
    pub fn reduce_scatter(&self, g: &Tensor) -> Result<Tensor> {
        self.layout.reduce_scatter(self.group.as_ref(), g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn slices_cover_the_parameter_and_pad_the_tail() {
        let x = Tensor::arange(0f32, 10., &Device::Cpu).unwrap().reshape((2, 5)).unwrap();
        let mut seen = Vec::new();
        for r in 0..4 {
            let l = ShardLayout::new(10, r, 4);
            assert_eq!(l.chunk, 3);
            let s = l.slice(&x).unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(s.len(), 3);
            // Its own storage: a view would keep the whole tensor alive (12 bytes, not 40).
            assert_eq!(crate::memory::storage_bytes(&l.slice(&x).unwrap()), 12, "rank {r}");
            let owned = l.owned();
            assert_eq!(&s[..owned.len()], &(owned.start..owned.end).map(|i| i as f32).collect::<Vec<_>>()[..]);
            assert!(s[owned.len()..].iter().all(|&v| v == 0.0), "padding is zero: {s:?}");
            seen.extend(owned);
        }
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        // Fewer elements than ranks: the last ranks own nothing.
        let l = ShardLayout::new(2, 3, 4);
        assert_eq!((l.chunk, l.owned()), (1, 2..2));
    }

    #[test]
    fn gather_and_reduce_scatter_over_thread_ranks() {
        use std::time::Duration;
        let shape = Shape::from((3, 3));
        let out = crate::comm::run_ranks(2, Duration::from_secs(10), |g| -> Result<(Vec<f32>, Vec<f32>)> {
            let shard = ParamShard::new(ShardLevel::Parameters, g.clone(), shape.clone());
            let whole = Tensor::arange(0f32, 9., &Device::Cpu)?.reshape((3, 3))?;
            let back = shard.gather(&shard.slice(&whole)?)?;
            // Every rank's gradient is the whole tensor times (rank + 1): the sum is 3× it.
            let g_local = (whole.to_dtype(DType::BF16)? * (g.rank() + 1) as f64)?;
            let mine = shard.reduce_scatter(&g_local)?;
            assert_eq!(mine.dtype(), DType::F32, "bf16 gradients are reduced in f32");
            Ok((back.flatten_all()?.to_vec1()?, mine.to_vec1()?))
        });
        let out: Vec<_> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
        for (back, _) in &out {
            assert_eq!(back, &(0..9).map(|i| i as f32).collect::<Vec<_>>());
        }
        assert_eq!(out[0].1, vec![0., 3., 6., 9., 12.]);
        assert_eq!(out[1].1, vec![15., 18., 21., 24., 0.]);
    }

    #[test]
    fn levels_parse_and_order() {
        assert_eq!("Parameters".parse::<ShardLevel>().unwrap(), ShardLevel::Parameters);
        assert!(ShardLevel::Optimizer < ShardLevel::Gradients);
        assert!("zero3".parse::<ShardLevel>().unwrap_err().contains("none, optimizer"));
    }
}
