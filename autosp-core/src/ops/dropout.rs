//! Dropout with a seeded mask: `y = x · m / (1 - p)`, `m` kept with probability `1 - p`. The mask is a pure
//! function of the op's seed and the element's index (splitmix64), so a checkpoint region that replays the op
//! draws the same mask, and backward recomputes it instead of saving it.

use candle_core::{DType, Tensor};

use crate::{Error, NodeKind, Op, Result, SavedTensors, Tape, Value};

/// The op: `x` (any shape) -> `x · mask`, the mask scaled by `1 / (1 - p)`.
#[derive(Debug)]
pub struct Dropout {
    /// The probability of dropping an element, in `[0, 1)`.
    pub p: f32,
    /// The mask's seed.
    pub seed: u64,
}

/// splitmix64: one well-mixed 64-bit value per input.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Dropout {
    /// The scaled mask for a tensor like `x` (same shape, dtype and device): `1 / (1 - p)` computed in f64,
    /// rounded once to f64 or f32 (the narrower dtypes round the f32 mask).
    fn mask(&self, x: &Tensor) -> Result<Tensor> {
        let keep = 1.0 / (1.0 - f64::from(self.p));
        let threshold = (f64::from(self.p) * (1u64 << 53) as f64) as u64;
        let base = mix(self.seed);
        let kept = (0..x.elem_count() as u64).map(|i| mix(base ^ i) >> 11 >= threshold);
        let cpu = &candle_core::Device::Cpu;
        let m = match x.dtype() {
            DType::F64 => Tensor::from_vec(kept.map(|k| if k { keep } else { 0.0 }).collect(), x.shape(), cpu)?,
            _ => Tensor::from_vec(kept.map(|k| if k { keep as f32 } else { 0.0 }).collect(), x.shape(), cpu)?,
        };
        Ok(m.to_dtype(x.dtype())?.to_device(x.device())?)
    }
}

impl Op for Dropout {
    fn name(&self) -> &'static str {
        "dropout"
    }
    fn kind(&self) -> NodeKind {
        NodeKind::Elementwise
    }
    fn forward(&self, i: &[&Tensor]) -> Result<Vec<Tensor>> {
        Ok(vec![(i[0] * self.mask(i[0])?)?])
    }
    fn backward(&self, _: &SavedTensors<'_>, g: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let Some(g) = &g[0] else { return Ok(vec![None]) };
        Ok(vec![Some((g * self.mask(g)?)?)])
    }
}

/// Dropout of `x` (any shape) with probability `p` and the mask drawn from `seed` (same seed, same mask).
/// `p = 0` and a tape that does not record (inference) return `x` unchanged.
pub fn dropout(tape: &Tape, x: &Value, p: f32, seed: u64) -> Result<Value> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::InvalidArgument {
            op: "dropout",
            msg: format!("dropout probability {p} is outside [0, 1): give a probability such as 0.05"),
        });
    }
    if p == 0.0 || !tape.is_recording() {
        return Ok(x.clone());
    }
    Ok(tape.apply(Dropout { p, seed }, &[x])?.remove(0))
}
