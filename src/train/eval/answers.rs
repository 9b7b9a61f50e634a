//! [`answer_accuracy`]: teacher-forced retrieval accuracy on samples with marked answers (the synthetic
//! tasks' probes and the passkey grid), scored from the logits of the answer rows only. Forward only and
//! collective (every rank calls it).

use autosp_models::LlamaModel;
use candle_core::{Device, Tensor};

use crate::train::error::Result;
use crate::train::stream::Sample;
use crate::Compiled;

/// Right answers of a probe set ([`answer_accuracy`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Answers {
    /// Answer tokens predicted right.
    pub right: usize,
    /// Answer tokens.
    pub total: usize,
    /// Samples with every answer token right.
    pub whole: usize,
}

/// Teacher-forced answer accuracy: for every answer token of every probe, whether the argmax of the logits
/// at the token before it is that token (earlier answer tokens are given, not generated). Collective: every
/// rank calls it with the same probes; only the scored rows travel between the ranks.
pub fn answer_accuracy(c: &Compiled<LlamaModel>, probes: &[Sample]) -> Result<Answers> {
    let mut a = Answers::default();
    for s in probes {
        let n = s.ids.len();
        let ids = Tensor::from_vec(s.ids.clone(), (1, n), &Device::Cpu)?;
        let k = s.answers.len();
        let scored: Vec<usize> = s.answers.iter().map(|&a| a - 1).collect();
        let logits = c.logits_at(&ids, &scored)?;
        let rows = logits.argmax(2)?.flatten_all()?.to_vec1::<u32>()?;
        let ok = rows.iter().zip(s.answers.iter().map(|&a| s.ids[a])).filter(|(a, b)| **a == *b).count();
        a.right += ok;
        a.total += k;
        a.whole += usize::from(ok == k);
    }
    Ok(a)
}
