//! [`LoraAdapter`]: a low-rank update of a frozen linear layer (LoRA, Hu et al. 2021, as PEFT computes it):
//! `y = x Wᵀ + b + (α / r) · dropout(x) Aᵀ Bᵀ` with `A: [r, in]`, `B: [out, r]`. `B` starts at zero, so a
//! new adapter leaves the model's outputs as they were; `A` starts as PEFT's (Kaiming-uniform, bound
//! `1 / √in`). Merging adds `(α / r) · B A` to `W`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::{ops, Param, Result, Tape, Value};

/// A LoRA adapter of one linear layer: `a: [r, in]`, `b: [out, r]`, scaled by `alpha / r`, with dropout
/// `dropout` on its input while training. Clones share the parameters and the dropout counter.
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    /// `lora_A`: `[r, in]`.
    pub a: Param,
    /// `lora_B`: `[out, r]`.
    pub b: Param,
    /// `alpha / r`.
    pub scale: f64,
    /// Dropout probability on the adapter's input (training tapes only).
    pub dropout: f32,
    /// The dropout masks' seed (one per adapter: [`crate::lora::add_lora`] hashes the module's name into it).
    seed: u64,
    /// The step and the first sequence of the micro-batch the next forwards run ([`Self::seed_batch`]).
    batch: Arc<[AtomicU64; 2]>,
}

impl LoraAdapter {
    /// An adapter from its two matrices (`a: [r, in]`, `b: [out, r]`), `alpha`, dropout and the seed of its
    /// dropout masks.
    pub fn new(a: Param, b: Param, alpha: f64, dropout: f32, seed: u64) -> Self {
        let r = a.shape().dims().first().copied().unwrap_or(1).max(1);
        Self { a, b, scale: alpha / r as f64, dropout, seed, batch: Arc::new([AtomicU64::new(0), AtomicU64::new(0)]) }
    }

    /// A fresh adapter for a linear layer `[out, inp]` named `prefix` (e.g. `model.layers.0.self_attn.q_proj`):
    /// `{prefix}.lora_A.weight` Kaiming-uniform from `seed` (bound `1 / √inp`, PEFT's init), `{prefix}.lora_B.weight`
    /// zero, both in `dtype` on `device`.
    #[allow(clippy::too_many_arguments)]
    pub fn init(
        prefix: &str,
        out: usize,
        inp: usize,
        r: usize,
        alpha: f64,
        dropout: f32,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let bound = 1.0 / (inp as f64).sqrt();
        let mut state = seed;
        let a: Vec<f32> = (0..r * inp)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                ((2.0 * u - 1.0) * bound) as f32
            })
            .collect();
        let a = Tensor::from_vec(a, (r, inp), &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?;
        let b = Tensor::zeros((out, r), dtype, device)?;
        Ok(Self::new(
            Param::new(format!("{prefix}.lora_A.weight"), a),
            Param::new(format!("{prefix}.lora_B.weight"), b),
            alpha,
            dropout,
            seed,
        ))
    }

    /// Sets the optimizer step and the index of the micro-batch's first sequence in the step's batch that the
    /// next forwards' dropout masks are drawn for. A mask element is a function of (seed, step, sequence,
    /// position, feature), the sequence and position read from the tape's [`crate::TokenCoordinates`]: a run
    /// resumed at a step draws the masks an uninterrupted run drew there, on any mesh.
    pub fn seed_batch(&self, step: u64, first_sequence: u64) {
        self.batch[0].store(step, Ordering::Relaxed);
        self.batch[1].store(first_sequence, Ordering::Relaxed);
    }

    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.a.shape().dims()[0]
    }

    /// `alpha` (`scale · r`).
    pub fn alpha(&self) -> f64 {
        self.scale * self.rank() as f64
    }

    /// The adapter's output `x: [.., in]` -> `scale · dropout(x) Aᵀ Bᵀ: [.., out]`.
    pub fn forward(&self, tape: &Tape, x: &Value) -> Result<Value> {
        let x = if self.dropout > 0.0 && tape.is_recording() {
            let (step, first) = (self.batch[0].load(Ordering::Relaxed), self.batch[1].load(Ordering::Relaxed));
            ops::dropout(tape, x, self.dropout, crate::rng::SplitMix64::key(self.seed, step), first)?
        } else {
            x.clone()
        };
        let low = ops::linear(tape, &x, &tape.param(&self.a)?, None)?;
        ops::scale(tape, &ops::linear(tape, &low, &tape.param(&self.b)?, None)?, self.scale)
    }

    /// The update merging adds to the base weight: `scale · B A: [out, in]` in `dtype` (whole; collective when
    /// the adapter is sharded at `Parameters`).
    pub fn delta(&self, dtype: DType) -> Result<Tensor> {
        let (a, b) = (self.a.whole()?.to_dtype(dtype)?, self.b.whole()?.to_dtype(dtype)?);
        Ok((b.matmul(&a)? * self.scale)?)
    }
}
