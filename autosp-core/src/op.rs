//! The [`Op`] trait: how an operation runs forward, which of its tensors its backward reads, and its
//! hand-written backward (a vector-Jacobian product). Kernels in other crates implement it too.

use candle_core::{DType, Shape, Tensor};

use crate::{Error, NodeKind, Result};

/// Which inputs and outputs an op's backward reads (bit i set: index i is read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Saves {
    inputs: u32,
    outputs: u32,
}

impl Saves {
    /// Backward reads nothing but shapes.
    pub const NONE: Saves = Saves { inputs: 0, outputs: 0 };

    /// Backward reads these inputs.
    pub const fn inputs(idx: &[usize]) -> Saves {
        Saves { inputs: mask(idx), outputs: 0 }
    }

    /// Backward reads these outputs.
    pub const fn outputs(idx: &[usize]) -> Saves {
        Saves { inputs: 0, outputs: mask(idx) }
    }

    /// Backward also reads these outputs.
    pub const fn and_outputs(self, idx: &[usize]) -> Saves {
        Saves { inputs: self.inputs, outputs: self.outputs | mask(idx) }
    }

    /// Whether input `i` is read.
    pub fn input(&self, i: usize) -> bool {
        i < 32 && self.inputs & (1 << i) != 0
    }

    /// Whether output `i` is read.
    pub fn output(&self, i: usize) -> bool {
        i < 32 && self.outputs & (1 << i) != 0
    }
}

const fn mask(idx: &[usize]) -> u32 {
    let mut m = 0u32;
    let mut i = 0;
    while i < idx.len() {
        m |= 1 << idx[i];
        i += 1;
    }
    m
}

/// What a backward gets: the tensors its op saved, and the shape and dtype of every input.
#[derive(Debug)]
pub struct SavedTensors<'a> {
    pub(crate) op: &'static str,
    pub(crate) inputs: Vec<Option<Tensor>>,
    pub(crate) outputs: Vec<Option<Tensor>>,
    pub(crate) input_meta: Vec<(&'a Shape, DType)>,
    /// Whether input `i` takes a gradient (`None`: every input does).
    pub(crate) needs_grad: Option<Vec<bool>>,
}

impl<'a> SavedTensors<'a> {
    /// Every input and output saved, for running one op's backward from inside another op's (a wrapper such as
    /// Ulysses that holds an inner attention op). Shapes and dtypes come from `inputs`.
    pub fn all(op: &'static str, inputs: &'a [Tensor], outputs: &[Tensor]) -> Self {
        Self {
            op,
            inputs: inputs.iter().cloned().map(Some).collect(),
            outputs: outputs.iter().cloned().map(Some).collect(),
            input_meta: inputs.iter().map(|t| (t.shape(), t.dtype())).collect(),
            needs_grad: None,
        }
    }

    /// Whether input `i` takes a gradient: a backward may return `None` for one that does not (a frozen
    /// weight, a constant) and skip the work of computing it.
    pub fn needs_grad(&self, i: usize) -> bool {
        self.needs_grad.as_ref().is_none_or(|n| n.get(i).copied().unwrap_or(true))
    }

    /// Saved input `i`.
    pub fn input(&self, i: usize) -> Result<&Tensor> {
        self.inputs.get(i).and_then(|t| t.as_ref()).ok_or_else(|| {
            Error::Internal(format!("{}: backward read input {i}, which its `saves()` does not list", self.op))
        })
    }

    /// Saved output `i`.
    pub fn output(&self, i: usize) -> Result<&Tensor> {
        self.outputs.get(i).and_then(|t| t.as_ref()).ok_or_else(|| {
            Error::Internal(format!("{}: backward read output {i}, which its `saves()` does not list", self.op))
        })
    }

    /// The shape of input `i` (always available).
    pub fn input_shape(&self, i: usize) -> &Shape {
        self.input_meta[i].0
    }

    /// The dtype of input `i` (always available).
    pub fn input_dtype(&self, i: usize) -> DType {
        self.input_meta[i].1
    }
}

/// An operation the tape can record, replay and differentiate.
///
/// `forward` must be deterministic (same inputs, same bits): checkpoint policies recompute values with it and
/// promise gradients bit-identical to keeping them.
pub trait Op: std::fmt::Debug + Send + Sync {
    /// A short name for errors and `explain()`.
    fn name(&self) -> &'static str;

    /// The kind of work, which checkpoint policies decide by.
    fn kind(&self) -> NodeKind;

    /// Runs the op.
    fn forward(&self, inputs: &[&Tensor]) -> Result<Vec<Tensor>>;

    /// The inputs and outputs the backward reads; the tape holds exactly these (and regenerates them when a
    /// checkpoint policy dropped them).
    fn saves(&self) -> Saves {
        Saves::NONE
    }

    /// The gradient of each input given the gradient of each output (`None`: zero / not needed). Return one
    /// entry per input; `None` for inputs that take no gradient.
    fn backward(&self, saved: &SavedTensors<'_>, grads: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>>;
}
