//! The documents of one packed sequence: [`Documents`] holds the boundaries of the documents a window of `n`
//! tokens is packed from, as varlen attention APIs take them (`cu_seqlens`: cumulative lengths from 0 to `n`),
//! and the RoPE position of the window's first token (0, or where a document split across windows goes on).
//! The attention spec's document mask asks it which document a position belongs to, the model asks it the
//! RoPE position of each token (positions restart at every document, as transformers' packed `position_ids`),
//! and the loss asks it which targets cross a boundary.
//!
//! Positions here are positions in the window, `0..n`. Positions at or past `n` (padding a layout adds to make
//! the sequence divide among ranks) belong to no real document: they form one trailing pseudo-document
//! starting at `n`, which no real token sees.

use std::ops::Range;

/// Why document boundaries were refused ([`Documents::new`], [`Documents::from_lengths`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DocumentsError {
    /// `cu_seqlens` is empty.
    #[error("document boundaries (cu_seqlens) are empty; they start at 0 and end at the window length {window} (one document: [0, {window}], `Documents::whole`)")]
    Empty {
        /// The window length the boundaries were checked against.
        window: usize,
    },
    /// `cu_seqlens` does not start at 0.
    #[error("document boundaries (cu_seqlens) start at {first}, not 0; the first document starts at the window's first token: prepend 0")]
    NotFromZero {
        /// The first boundary given.
        first: usize,
    },
    /// Two consecutive boundaries do not increase (an empty document, or boundaries out of order).
    #[error("document boundaries (cu_seqlens) are not strictly increasing: cu_seqlens[{index}] = {value} after cu_seqlens[{prev_index}] = {previous}; every document holds at least one token, so boundaries are cumulative sums of positive lengths", prev_index = index - 1)]
    NotIncreasing {
        /// The index of the boundary that does not increase.
        index: usize,
        /// The boundary before it.
        previous: usize,
        /// The boundary itself.
        value: usize,
    },
    /// The boundaries do not add up to the window.
    #[error("document boundaries (cu_seqlens) end at {end} but the window holds {window} tokens; the last boundary is the window length (the documents' lengths add up to it)")]
    WrongTotal {
        /// The last boundary given.
        end: usize,
        /// The window length.
        window: usize,
    },
}

impl From<DocumentsError> for crate::Error {
    fn from(e: DocumentsError) -> Self {
        crate::Error::External(Box::new(e))
    }
}

/// The document boundaries of one packed window of `n` tokens: `cu_seqlens` (`[0, l0, l0 + l1, ..., n]`, strictly
/// increasing) and the RoPE position of the window's first token.
///
/// A window of one document starting at position 0 is [`Documents::whole`]; attention with it sees what
/// attention without documents sees.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Documents {
    cu_seqlens: Vec<usize>,
    first_position: usize,
}

impl Documents {
    /// The documents of a window of `window` tokens with boundaries `cu_seqlens` (starting at 0, strictly
    /// increasing, ending at `window`) whose first token sits at RoPE position `first_position` (0 unless the
    /// window's first document goes on from the previous window).
    pub fn new(window: usize, cu_seqlens: Vec<usize>, first_position: usize) -> Result<Self, DocumentsError> {
        let Some(&first) = cu_seqlens.first() else { return Err(DocumentsError::Empty { window }) };
        if first != 0 {
            return Err(DocumentsError::NotFromZero { first });
        }
        for (index, w) in cu_seqlens.windows(2).enumerate() {
            if w[1] <= w[0] {
                return Err(DocumentsError::NotIncreasing { index: index + 1, previous: w[0], value: w[1] });
            }
        }
        let end = *cu_seqlens.last().expect("not empty");
        if end != window {
            return Err(DocumentsError::WrongTotal { end, window });
        }
        Ok(Self { cu_seqlens, first_position })
    }

    /// The documents of lengths `lengths` (each at least one token), in order, the first starting at RoPE
    /// position `first_position`; the window is their sum.
    pub fn from_lengths(lengths: &[usize], first_position: usize) -> Result<Self, DocumentsError> {
        let mut cu = Vec::with_capacity(lengths.len() + 1);
        cu.push(0);
        for &l in lengths {
            cu.push(cu.last().expect("not empty") + l);
        }
        let window = *cu.last().expect("not empty");
        Self::new(window, cu, first_position)
    }

    /// One document of `n` tokens at position 0 (no document mask; positions `0..n`).
    pub fn whole(n: usize) -> Self {
        let cu_seqlens = if n == 0 { vec![0] } else { vec![0, n] };
        Self { cu_seqlens, first_position: 0 }
    }

    /// Checks that these documents cover a window of `window` tokens.
    pub fn check_window(&self, window: usize) -> Result<(), DocumentsError> {
        if self.window() != window {
            return Err(DocumentsError::WrongTotal { end: self.window(), window });
        }
        Ok(())
    }

    /// The window length `n` (the last boundary).
    pub fn window(&self) -> usize {
        *self.cu_seqlens.last().expect("at least [0]")
    }

    /// How many documents the window holds.
    pub fn count(&self) -> usize {
        self.cu_seqlens.len() - 1
    }

    /// The boundaries: `[0, ..., n]`, strictly increasing.
    pub fn cu_seqlens(&self) -> &[usize] {
        &self.cu_seqlens
    }

    /// The RoPE position of the window's first token.
    pub fn first_position(&self) -> usize {
        self.first_position
    }

    /// Whether this is one document at position 0: attention and positions as without documents.
    pub fn is_whole(&self) -> bool {
        self.count() <= 1 && self.first_position == 0
    }

    /// The index of the document holding position `pos`; `count()` for positions at or past the window (the
    /// padding pseudo-document).
    pub fn document_of(&self, pos: usize) -> usize {
        if pos >= self.window() {
            return self.count();
        }
        // The last boundary <= pos; cu_seqlens[0] = 0 <= pos, so the partition point is at least 1.
        self.cu_seqlens.partition_point(|&b| b <= pos) - 1
    }

    /// The window positions of document `doc` (`doc == count()`: the padding past the window, up to
    /// `usize::MAX`).
    pub fn document(&self, doc: usize) -> Range<usize> {
        if doc >= self.count() {
            return self.window()..usize::MAX;
        }
        self.cu_seqlens[doc]..self.cu_seqlens[doc + 1]
    }

    /// The first position of the document holding `pos` (`n` for padding past the window).
    pub fn start_of(&self, pos: usize) -> usize {
        self.document(self.document_of(pos)).start
    }

    /// The positions of the document holding `pos` (`n..usize::MAX` for padding past the window).
    pub fn range_of(&self, pos: usize) -> Range<usize> {
        self.document(self.document_of(pos))
    }

    /// The RoPE position of the token at window position `pos`: `pos - start_of(pos)`, plus
    /// `first_position` in the first document. Padding past the window counts from `n`.
    pub fn position(&self, pos: usize) -> usize {
        let doc = self.document_of(pos);
        let from_start = pos - self.document(doc).start;
        if doc == 0 {
            from_start + self.first_position
        } else {
            from_start
        }
    }

    /// The RoPE positions of window positions `range` (may run past the window into padding).
    pub fn positions(&self, range: Range<usize>) -> Vec<usize> {
        range.map(|p| self.position(p)).collect()
    }

    /// The documents' lengths, in order.
    pub fn lengths(&self) -> impl Iterator<Item = usize> + '_ {
        self.cu_seqlens.windows(2).map(|w| w[1] - w[0])
    }

    /// The longest document's length in tokens (0 for an empty window).
    pub fn longest(&self) -> usize {
        self.lengths().max().unwrap_or(0)
    }

    /// One past the largest RoPE position in the window (`max(position_ids) + 1`, what transformers'
    /// length-dependent RoPE scalings read on packed inputs): the longest document, the first counted from
    /// `first_position`. 0 for an empty window.
    pub fn position_extent(&self) -> usize {
        self.lengths().enumerate().map(|(d, l)| if d == 0 { l + self.first_position } else { l }).max().unwrap_or(0)
    }

    /// The positions whose next token starts another document of the window (`cu_seqlens[d] - 1` for each
    /// document `d > 0`): a next-token loss ignores their targets, so no document is trained on the text
    /// before it.
    pub fn boundary_targets(&self) -> impl Iterator<Item = usize> + '_ {
        self.cu_seqlens[1..self.count().max(1)].iter().map(|&b| b - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_is_one_document_from_zero() {
        let d = Documents::whole(5);
        assert_eq!(d.cu_seqlens(), &[0, 5]);
        assert!(d.is_whole());
        assert_eq!(d.count(), 1);
        assert_eq!(d.positions(0..5), vec![0, 1, 2, 3, 4]);
        assert_eq!(d.longest(), 5);
        assert_eq!(d.position_extent(), 5);
        assert_eq!(d.boundary_targets().count(), 0);
        let e = Documents::whole(0);
        assert_eq!((e.count(), e.window(), e.longest()), (0, 0, 0));
        assert_eq!(Documents::new(0, vec![0], 0), Ok(e));
    }

    #[test]
    fn documents_positions_and_lengths() {
        let d = Documents::new(10, vec![0, 3, 4, 10], 7).unwrap();
        assert_eq!(d.count(), 3);
        assert!(!d.is_whole());
        let docs: Vec<_> = (0..12).map(|p| d.document_of(p)).collect();
        assert_eq!(docs, vec![0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 3, 3]);
        let starts: Vec<_> = (0..12).map(|p| d.start_of(p)).collect();
        assert_eq!(starts, vec![0, 0, 0, 3, 4, 4, 4, 4, 4, 4, 10, 10]);
        assert_eq!(d.range_of(5), 4..10);
        assert_eq!(d.range_of(11), 10..usize::MAX);
        // Positions restart at each document; the first goes on from 7; padding counts from the window's end.
        assert_eq!(d.positions(0..12), vec![7, 8, 9, 0, 0, 1, 2, 3, 4, 5, 0, 1]);
        assert_eq!(d.lengths().collect::<Vec<_>>(), vec![3, 1, 6]);
        assert_eq!(d.longest(), 6);
        assert_eq!(d.position_extent(), 10);
        assert_eq!(d.boundary_targets().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(Documents::from_lengths(&[3, 1, 6], 7).unwrap(), d);
        assert!(d.check_window(10).is_ok());
    }

    #[test]
    fn bad_boundaries_are_refused_by_name() {
        assert_eq!(Documents::new(4, vec![], 0), Err(DocumentsError::Empty { window: 4 }));
        assert_eq!(Documents::new(4, vec![1, 4], 0), Err(DocumentsError::NotFromZero { first: 1 }));
        assert_eq!(
            Documents::new(4, vec![0, 2, 2, 4], 0),
            Err(DocumentsError::NotIncreasing { index: 2, previous: 2, value: 2 })
        );
        assert_eq!(
            Documents::new(4, vec![0, 3, 1, 4], 0),
            Err(DocumentsError::NotIncreasing { index: 2, previous: 3, value: 1 })
        );
        assert_eq!(Documents::new(4, vec![0, 2, 5], 0), Err(DocumentsError::WrongTotal { end: 5, window: 4 }));
        assert_eq!(Documents::new(4, vec![0, 2], 0), Err(DocumentsError::WrongTotal { end: 2, window: 4 }));
        assert!(matches!(Documents::from_lengths(&[2, 0, 1], 0), Err(DocumentsError::NotIncreasing { .. })));
        assert_eq!(Documents::whole(3).check_window(4), Err(DocumentsError::WrongTotal { end: 3, window: 4 }));
        let msg = Documents::new(4, vec![0, 3, 1, 4], 0).unwrap_err().to_string();
        assert!(msg.contains("cu_seqlens[2] = 1 after cu_seqlens[1] = 3"), "{msg}");
    }
}
