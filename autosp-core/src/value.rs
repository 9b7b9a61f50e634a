//! [`Value`]: what the ops take and return. A plain candle tensor plus, when a tape recorded it, the id of
//! its entry on that tape. Cloning a value clones the tensor handle, never its data.

use candle_core::{DType, Device, Shape, Tensor};

/// Where a value lives on a tape: the tape's id and the value's index on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ValueRef {
    pub(crate) tape: u64,
    pub(crate) index: usize,
}

/// A tensor flowing through model code. `id` is set when a recording tape tracks it (it depends on a leaf);
/// constants and everything computed by an inference tape carry no id.
#[derive(Clone, Debug)]
pub struct Value {
    pub(crate) tensor: Tensor,
    pub(crate) id: Option<ValueRef>,
}

impl Value {
    /// An untracked value: a constant for every tape.
    pub fn constant(tensor: Tensor) -> Self {
        Self { tensor, id: None }
    }

    /// The tensor this value holds.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The tensor this value holds, by value.
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }

    /// The value's index on its tape, if a tape tracks it.
    pub fn id(&self) -> Option<usize> {
        self.id.map(|r| r.index)
    }

    /// Whether a recording tape tracks this value (gradients can flow through it).
    pub fn is_tracked(&self) -> bool {
        self.id.is_some()
    }

    /// The tensor's dimensions.
    pub fn dims(&self) -> &[usize] {
        self.tensor.dims()
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &Shape {
        self.tensor.shape()
    }

    /// The tensor's dtype.
    pub fn dtype(&self) -> DType {
        self.tensor.dtype()
    }

    /// The tensor's device.
    pub fn device(&self) -> &Device {
        self.tensor.device()
    }
}
