//! Forward only, the loss of every next-token target of a sequence, gathered into sequence order on every
//! rank: what loss-by-position evaluation needs (`autosp::train::PositionLoss`). The model's own hidden states
//! and LM head, run in row chunks so that no `[n, vocab]` logits tensor exists (as the training loss avoids it).

use autosp_core::ops::cross_entropy::row_lse;
use autosp_core::ops::Documents;
use autosp_core::{Precision, Tape};
use autosp_kernels::sp::layout::gather_unshard;
use autosp_models::LlamaModel;
use candle_core::{DType, Device, Tensor};

use super::row_groups::{self, per_group, row_groups};
use super::step::{check_batch, shift_and_pad};
use super::{CompileError, Compiled};

/// Logit bytes per row chunk (about 32 MiB of f32 at a time, as the model's chunked loss).
const CHUNK_ELEMS: usize = 8 << 20;

impl Compiled<LlamaModel> {
    /// Forward only: the loss of each next-token target of `ids: [b, n]` (u32; every rank passes the whole
    /// batch) against `labels` (`[b, n]`, -100 ignored; default: the ids), shifted, sharded and padded as
    /// [`eval_loss`](Self::eval_loss) does. Returns `[b, n]` in f32 (f64 for an f64 model), the same on every
    /// rank: entry `t` is `-log p(labels[t + 1] | tokens 0..=t)`, and 0 where there is no target (the last
    /// position, an ignored label). Collective over the sequence-parallel group: each rank scores the rows
    /// of its shard, `chunk` rows of logits at a time, and one gather brings the `[b, n / P]` losses home.
    /// Every replica scores the whole batch.
    pub fn token_losses(&self, ids: &Tensor, labels: Option<&Tensor>) -> Result<Tensor, CompileError> {
        self.token_losses_with(ids, labels, None)
    }

    /// [`token_losses`](Self::token_losses), with one [`Documents`] per row when `documents` is given.
    pub(crate) fn token_losses_with(
        &self,
        ids: &Tensor,
        labels: Option<&Tensor>,
        documents: Option<&[Documents]>,
    ) -> Result<Tensor, CompileError> {
        let vocab = self.model.config.vocab_size;
        check_batch(ids, labels, vocab, 2)?;
        let (b, n) = ids.dims2()?;
        self.check_documents(documents, b, n)?;
        let n_pad = self.padded_len(n);
        let host = Device::Cpu;
        let (ids, labels) = (ids.to_device(&host)?, labels.map(|l| l.to_device(&host)).transpose()?);
        let (ids, targets) = shift_and_pad(&ids, labels.as_ref(), n_pad)?;
        let targets = match documents {
            Some(d) => row_groups::ignore_boundary_targets(&targets, d)?,
            None => targets,
        };
        let positions = self.positions(n_pad, self.sp.rank())?;
        let index = Tensor::from_vec(positions.iter().map(|&p| p as u32).collect(), positions.len(), &host)?;
        let device = self.device();
        let ids_local = ids.index_select(&index, 1)?.to_device(&device)?;
        let tape = Tape::inference();
        tape.set_inputs_checked();
        tape.set_sequence_length(row_groups::sequence_length(documents, n));
        let groups = row_groups(documents, 0..b);
        let parts = per_group(&tape, &groups, &ids_local, |_, ids| {
            Ok(self.model.hidden_states(&tape, &ids, &positions).map_err(autosp_core::Error::from)?.into_tensor())
        })?;
        let hidden = row_groups::in_row_order(parts, &groups)?;
        let targets_local = targets.index_select(&index, 1)?.flatten_all()?.to_device(&device)?;
        let rows = b * positions.len();
        let hidden = hidden.reshape((rows, self.model.config.hidden_size))?;
        let dtype = Precision::float(hidden.dtype()).accumulate();
        let chunk = (CHUNK_ELEMS / vocab.max(1)).clamp(16, 4096);
        let mut parts = Vec::with_capacity(rows.div_ceil(chunk));
        for start in (0..rows).step_by(chunk) {
            let len = chunk.min(rows - start);
            let h = tape.constant(hidden.narrow(0, start, len)?);
            let logits = self.model.head(&tape, &h).map_err(autosp_core::Error::from)?.tensor().to_dtype(dtype)?;
            let t = targets_local.narrow(0, start, len)?;
            let valid = t.ge(0i64)?;
            let picked =
                logits.gather(&valid.where_cond(&t, &t.zeros_like()?)?.to_dtype(DType::U32)?.unsqueeze(1)?, 1)?;
            parts.push(((row_lse(&logits)? - picked)?.squeeze(1)? * valid.to_dtype(dtype)?)?);
        }
        let local = Tensor::cat(&parts, 0)?.reshape((b, positions.len()))?;
        let whole = gather_unshard(self.sp.as_ref(), &local.contiguous()?, 1, self.layout())?;
        Ok(whole.narrow(1, 0, n)?)
    }
}
