//! Synthetic long-range retrieval tasks, for testing whether a model (and a sequence-parallel setup) really
//! uses long context: [`Needles`] (multi-needle retrieval whose evidence and questions sit on different
//! ranks; `llama_longctx`'s default) and [`Passkey`] (the standard passkey test). Both give [`Sample`]s with
//! the answer positions marked, so training can score the answers only and [`answer_accuracy`] can measure
//! retrieval; both have a random state that checkpoints save ([`super::Stream`]).
//!
//! [`Sample`]: super::Sample
//! [`answer_accuracy`]: super::answer_accuracy

mod needles;
mod passkey;

pub use needles::{copies, Needles, Vocab as NeedlesVocab, CLASSES, MIN_LEN, VALUES};
pub use passkey::{Passkey, PasskeyVocab};
