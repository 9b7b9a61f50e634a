//! Dropout with a mask addressed by coordinates: `y = x · m / (1 - p)`, `m` kept with probability `1 - p`.
//! Element `(token, feature)` of the mask is the `feature`-th output of a [`SplitMix64`] stream keyed by
//! `(seed, sequence, position)`: the token's sequence in the step's global batch and its position in the whole
//! sequence ([`TokenCoordinates`]), so every rank, replica and shard that holds a token draws the same mask
//! for it, whatever the mesh. A checkpoint region that replays the op draws the same mask, and backward
//! recomputes it instead of saving it. The mask is built on the host a token row at a time (one counter-based
//! stream per row), the rows split over the host's threads when there are many.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::rng::SplitMix64;
use crate::{Error, NodeKind, Op, Result, SavedTensors, Tape, TokenCoordinates, Value};

/// The op: `x: [.., columns, features]` -> `x · mask`, the mask scaled by `1 / (1 - p)`.
#[derive(Debug)]
pub struct Dropout {
    /// The probability of dropping an element, in `[0, 1)`.
    pub p: f32,
    /// The mask's seed (one per module and step).
    pub seed: u64,
    /// Added to every row's sequence index (the first sequence of this micro-batch in the step's batch).
    pub first_sequence: u64,
    /// Where `x`'s token rows sit: its tokens are `coordinates.sequences × coordinates.positions`, row-major.
    pub coordinates: Arc<TokenCoordinates>,
}

/// Token rows per thread below which the mask is built on one thread.
const ROWS_PER_THREAD: usize = 256;

impl Dropout {
    /// The seed of token `t`'s row of mask (row-major over sequences × positions).
    fn row_key(&self, t: usize) -> u64 {
        let c = &self.coordinates;
        let n = c.positions.len();
        let sequence = c.sequences[t / n].wrapping_add(self.first_sequence);
        SplitMix64::key(SplitMix64::key(self.seed, sequence), c.positions[t % n])
    }

    /// The scaled mask for a tensor like `x` (same shape, dtype and device): `1 / (1 - p)` computed in f64,
    /// rounded once to f64 or f32 (the narrower dtypes round the f32 mask).
    fn mask(&self, x: &Tensor) -> Result<Tensor> {
        let features = x.dims().last().copied().unwrap_or(1).max(1);
        let tokens = x.elem_count() / features;
        if tokens != self.coordinates.tokens() {
            return Err(Error::InvalidArgument {
                op: "dropout",
                msg: format!(
                    "the tape's token coordinates describe {} rows x {} positions but the input {:?} has {tokens} \
                     token rows: set coordinates matching the forward's ids (Tape::set_token_coordinates)",
                    self.coordinates.sequences.len(),
                    self.coordinates.positions.len(),
                    x.dims()
                ),
            });
        }
        let keep = 1.0 / (1.0 - f64::from(self.p));
        let cpu = &candle_core::Device::Cpu;
        let m = match x.dtype() {
            DType::F64 => Tensor::from_vec(self.fill(tokens, features, keep, 0.0), x.shape(), cpu)?,
            _ => Tensor::from_vec(self.fill(tokens, features, keep as f32, 0.0), x.shape(), cpu)?,
        };
        Ok(m.to_dtype(x.dtype())?.to_device(x.device())?)
    }

    /// `tokens × features` mask values, `kept` or `dropped`, row by row (rows split over threads).
    fn fill<T: Copy + Send + Sync>(&self, tokens: usize, features: usize, kept: T, dropped: T) -> Vec<T> {
        let threshold = (f64::from(self.p) * (1u64 << 53) as f64) as u64;
        let mut out = vec![dropped; tokens * features];
        let rows = |first: usize, chunk: &mut [T]| {
            for (i, row) in chunk.chunks_mut(features).enumerate() {
                // The row's stream walked in order: output f is `SplitMix64::at(key, f)`.
                let mut stream = SplitMix64::new(self.row_key(first + i));
                for e in row.iter_mut() {
                    *e = if stream.next_u64() >> 11 >= threshold { kept } else { dropped };
                }
            }
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(tokens / ROWS_PER_THREAD);
        if threads <= 1 {
            rows(0, &mut out);
            return out;
        }
        let per = tokens.div_ceil(threads);
        std::thread::scope(|s| {
            for (k, chunk) in out.chunks_mut(per * features).enumerate() {
                let rows = &rows;
                s.spawn(move || rows(k * per, chunk));
            }
        });
        out
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

/// Dropout of `x: [.., columns, features]` with probability `p`, the mask drawn from `seed` at the tape's
/// token coordinates ([`Tape::token_coordinates`]; without them, `x`'s own rows and columns from 0), every
/// row's sequence index shifted by `first_sequence`. Same seed and coordinates, same mask.
/// `p = 0` and a tape that does not record (inference) return `x` unchanged.
pub fn dropout(tape: &Tape, x: &Value, p: f32, seed: u64, first_sequence: u64) -> Result<Value> {
    if !(0.0..1.0).contains(&p) {
        return Err(Error::InvalidArgument {
            op: "dropout",
            msg: format!("dropout probability {p} is outside [0, 1): give a probability such as 0.05"),
        });
    }
    if p == 0.0 || !tape.is_recording() {
        return Ok(x.clone());
    }
    let coordinates = tape.token_coordinates().unwrap_or_else(|| {
        let dims = x.tensor().dims();
        let columns = if dims.len() >= 2 { dims[dims.len() - 2] } else { 1 };
        let tokens = x.tensor().elem_count() / dims.last().copied().unwrap_or(1).max(1);
        Arc::new(TokenCoordinates::local(tokens / columns.max(1), columns))
    });
    Ok(tape.apply(Dropout { p, seed, first_sequence, coordinates }, &[x])?.remove(0))
}
