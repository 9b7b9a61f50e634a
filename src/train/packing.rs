//! `--packing`: how training windows relate to the documents of the data. [`Packing::Documents`] (the default
//! for text, JSONL and chat data) gives every window its document boundaries ([`Documents`]): each token attends
//! only to its own document, positions restart at every document, and no document's first token is trained on
//! the previous document's last. [`Packing::Stream`] is the document-blind packing: the window is one sequence.
//!
//! Documents are packed one after another and the token stream is cut into `seq_len` windows, so a document
//! that does not fit in the room left in a window is split: its first part ends the window, the rest starts
//! the next with its positions going on ([`Documents::first_position`]). Both packings see the same tokens in
//! the same windows; only what each token sees, its position and the boundary targets differ (see
//! docs/FINE_TUNING.md for why documents are split rather than moved to a fresh window).

use autosp_core::ops::{Documents, DocumentsError, IGNORE_INDEX};

/// How training windows are packed from documents (`--packing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// Each window carries its document boundaries: attention within a document, positions per document,
    /// no target across a boundary.
    Documents,
    /// Document-blind: every window is one sequence (positions `0..seq_len`, every token sees every earlier one).
    Stream,
}

impl Packing {
    /// How the option spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Packing::Documents => "documents",
            Packing::Stream => "stream",
        }
    }
}

impl std::fmt::Display for Packing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Packing {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "documents" => Ok(Packing::Documents),
            "stream" => Ok(Packing::Stream),
            _ => Err(format!("`{s}` is not a packing: use documents (attention within documents) or stream")),
        }
    }
}

/// The documents of the window of `len` tokens from token `from` of a token stream whose documents start at
/// `starts` (ascending token offsets; the slice must hold the last start at or before `from` and every start
/// before `from + len`; others are ignored). The window's first token goes on from position
/// `from - (its document's start)`; a stream without a start at or before `from` starts a document at `from`.
pub fn documents_in(starts: &[u64], from: u64, len: usize) -> std::result::Result<Documents, DocumentsError> {
    let at_or_before = starts.partition_point(|&s| s <= from);
    let first_position = at_or_before.checked_sub(1).map_or(0, |i| (from - starts[i]) as usize);
    let mut cu = vec![0];
    cu.extend(starts[at_or_before..].iter().take_while(|&&s| s < from + len as u64).map(|&s| (s - from) as usize));
    cu.push(len);
    Documents::new(len, cu, first_position)
}

/// Ignores (-100) the label of every document's first token but the window's first (`labels: [n]`, one
/// window's), so that no document is trained on the text of the one before it (the target at a boundary
/// predicts the next document's first token from the previous document's last).
pub fn ignore_boundary_labels(labels: &mut [i64], documents: &Documents) {
    for &b in &documents.cu_seqlens()[1..documents.count().max(1)] {
        labels[b] = IGNORE_INDEX;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_get_the_documents_they_cut_with_positions_going_on() {
        // Documents of 3, 5, 2 and 6 tokens: [0, 3, 8, 10], 16 tokens in windows of 4.
        let starts = [0u64, 3, 8, 10];
        let w = |k: u64| documents_in(&starts, 4 * k, 4).unwrap();
        // [0 1 2 | 3]: whole, then the second document's first token.
        assert_eq!((w(0).cu_seqlens().to_vec(), w(0).first_position()), (vec![0, 3, 4], 0));
        // [4 5 6 7]: the second document goes on from its position 1.
        assert_eq!((w(1).cu_seqlens().to_vec(), w(1).first_position()), (vec![0, 4], 1));
        // [8 9 | 10 11]: the third whole at the window's start, the fourth begins.
        assert_eq!((w(2).cu_seqlens().to_vec(), w(2).first_position()), (vec![0, 2, 4], 0));
        // [12 13 14 15]: the fourth goes on from its position 2.
        assert_eq!((w(3).cu_seqlens().to_vec(), w(3).first_position()), (vec![0, 4], 2));
        assert_eq!(w(3).positions(0..4), vec![2, 3, 4, 5]);
        // Only the relevant starts need be given; a stream without one before `from` starts there.
        assert_eq!(documents_in(&starts[2..], 8, 4).unwrap(), w(2));
        assert_eq!(documents_in(&[], 5, 3).unwrap(), Documents::whole(3));
        // Starts out of order are refused.
        assert!(documents_in(&[0, 6, 5], 4, 4).is_err());
    }

    #[test]
    fn a_documents_first_label_is_ignored_but_the_windows_first() {
        let d = Documents::new(6, vec![0, 2, 5, 6], 3).unwrap();
        let mut labels = vec![10i64, 11, 12, 13, 14, 15];
        ignore_boundary_labels(&mut labels, &d);
        assert_eq!(labels, vec![10, 11, -100, 13, 14, -100]);
        let mut one = vec![1i64, 2];
        ignore_boundary_labels(&mut one, &Documents::whole(2));
        assert_eq!(one, vec![1, 2]);
        assert_eq!("stream".parse::<Packing>(), Ok(Packing::Stream));
        assert!("neat".parse::<Packing>().unwrap_err().contains("documents"));
    }
}
