//! How tokens fill the cache's `seq_len` windows: documents one after another, and conversations by the
//! [`ChatLayout`], never cutting an answer away. A conversation longer than a window keeps its end (the last
//! assistant turn and as much of the context before it as fits, cut on the left at a token) after its opening
//! (the template's start, the system turn and the first message's header), so its answer still trains.

use std::io::Write;

use autosp_models::chat::EncodedConversation;

/// The bit of a cached token that says it trains.
pub(super) const TRAINED: u32 = 1 << 31;

/// How conversations fill the training windows (`--chat-layout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatLayout {
    /// One after another; one that does not fit in what is left of a window starts the next (the rest is
    /// padded with untrained EOS), so none straddles two windows. One longer than a window is cut as in
    /// [`Truncate`](Self::Truncate) and fills a window alone.
    Pack,
    /// One per window, padded with untrained EOS; one longer than the window keeps its end (the last assistant
    /// turn and as much context before it as fits) after its opening.
    Truncate,
}

impl std::str::FromStr for ChatLayout {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "pack" => Ok(ChatLayout::Pack),
            "truncate" => Ok(ChatLayout::Truncate),
            _ => Err(format!("`{s}` is not a chat layout: use pack or truncate")),
        }
    }
}

/// The tokens of `c` that fill at most `len` (its ids and whether each trains): all of them when they fit;
/// else up to the end of its last answer when that fits; else a head (its opening when the last answer fits
/// after it with a token of context to spare, else the template's start) and the last tokens up to the end of
/// the last answer. An answer longer than the room after the head keeps its end.
pub(super) fn fit(c: &EncodedConversation, len: usize) -> (Vec<u32>, Vec<bool>) {
    let n = c.ids.len();
    if n <= len {
        return (c.ids.clone(), c.trained.clone());
    }
    // The last answer: the last run of trained tokens.
    let (end, answer) = match c.trained.iter().rposition(|&t| t) {
        Some(last) => {
            let start = c.trained[..last].iter().rposition(|&t| !t).map_or(0, |i| i + 1);
            (last + 1, last + 1 - start)
        }
        None => (n, 0),
    };
    if end <= len {
        return (c.ids[..end].to_vec(), c.trained[..end].to_vec());
    }
    let head = if c.opening + answer < len {
        c.opening
    } else if c.start < len {
        c.start
    } else {
        0
    };
    let from = end - (len - head);
    let ids = c.ids[..head].iter().chain(&c.ids[from..end]).copied().collect();
    let trained = c.trained[..head].iter().chain(&c.trained[from..end]).copied().collect();
    (ids, trained)
}

/// Writes tokens into the cache as they fill windows: each a little-endian u32, [`TRAINED`] set on those that
/// train; and where each document starts into the starts file (`starts.rs`): a text document, a conversation,
/// and a run of padding after one (untrained, seen by no real token) are each a document.
pub(super) struct Windows<W: Write> {
    out: W,
    /// The starts file: the offset of each document's first token, a little-endian u64.
    starts: W,
    /// Whether the next token written starts a document.
    starting: bool,
    seq_len: usize,
    layout: ChatLayout,
    /// What pads a window (untrained).
    pad: u32,
    /// Tokens in the window being filled.
    filled: usize,
    /// Tokens written.
    tokens: u64,
}

impl<W: Write> Windows<W> {
    /// Windows of `seq_len` tokens written to `out`, document starts to `starts`; conversations laid out by
    /// `layout`, padded with `pad`.
    pub fn new(out: W, starts: W, seq_len: usize, layout: ChatLayout, pad: u32) -> Self {
        Self { out, starts, starting: true, seq_len: seq_len.max(1), layout, pad, filled: 0, tokens: 0 }
    }

    /// A document's tokens, all trained, packed after the previous ones; `first`: they start a document (else
    /// they go on with the previous piece's, plain text's long documents coming in pieces).
    pub fn document(&mut self, ids: &[u32], first: bool) -> std::io::Result<()> {
        self.starting |= first;
        for &id in ids {
            self.token(id, true)?;
        }
        Ok(())
    }

    /// A conversation, laid out by the layout.
    pub fn conversation(&mut self, c: &EncodedConversation) -> std::io::Result<()> {
        let (ids, trained) = fit(c, self.seq_len);
        let starts_window = match self.layout {
            ChatLayout::Truncate => true,
            ChatLayout::Pack => self.filled + ids.len() > self.seq_len,
        };
        if starts_window {
            self.pad_window()?;
        }
        self.starting = true;
        for (&id, &t) in ids.iter().zip(&trained) {
            self.token(id, t)?;
        }
        if self.layout == ChatLayout::Truncate {
            // Its own window, even when empty.
            if ids.is_empty() {
                self.token(self.pad, false)?;
            }
            self.pad_window()?;
        }
        Ok(())
    }

    /// Pads the last window of conversations (documents are not padded: their last part window is left out
    /// of the windows) and flushes; the writer and the tokens written.
    pub fn finish(mut self, conversations: bool) -> std::io::Result<(W, W, u64)> {
        if conversations {
            self.pad_window()?;
        }
        self.out.flush()?;
        self.starts.flush()?;
        Ok((self.out, self.starts, self.tokens))
    }

    /// Pads the window being filled up to `seq_len` (nothing when it is empty): the padding is a document of
    /// its own.
    fn pad_window(&mut self) -> std::io::Result<()> {
        if self.filled > 0 {
            self.starting = true;
            for _ in self.filled..self.seq_len {
                self.token(self.pad, false)?;
            }
        }
        debug_assert_eq!(self.filled, 0);
        Ok(())
    }

    fn token(&mut self, id: u32, trained: bool) -> std::io::Result<()> {
        if std::mem::take(&mut self.starting) {
            self.starts.write_all(&self.tokens.to_le_bytes())?;
        }
        let w = if trained { id | TRAINED } else { id };
        self.out.write_all(&w.to_le_bytes())?;
        self.tokens += 1;
        self.filled += 1;
        if self.filled == self.seq_len {
            self.filled = 0;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids 0..n; trained where `t` says; opening and start as given.
    fn conv(trained: &str, opening: usize, start: usize) -> EncodedConversation {
        let trained: Vec<bool> = trained.chars().map(|c| c == '1').collect();
        EncodedConversation { ids: (0..trained.len() as u32).collect(), trained, opening, start }
    }

    #[test]
    fn a_long_conversation_keeps_its_opening_and_its_last_answer() {
        // Fits: unchanged.
        let c = conv("0001100", 2, 1);
        assert_eq!(fit(&c, 7).0, c.ids);
        // Trailing untrained tokens go first.
        assert_eq!(fit(&c, 5), (vec![0, 1, 2, 3, 4], vec![false, false, false, true, true]));
        // Opening (2) + the end: the answer [9, 10] and as much context before it as fits.
        let c = conv("00001100011", 2, 1);
        assert_eq!(fit(&c, 6).0, vec![0, 1, 7, 8, 9, 10]);
        assert_eq!(fit(&c, 6).1, vec![false, false, false, false, true, true]);
        // The answer does not fit after the opening with context to spare: the start (1) only.
        let c = conv("00000000111", 4, 1);
        assert_eq!(fit(&c, 6).0, vec![0, 6, 7, 8, 9, 10]);
        // An answer longer than the window keeps its end after the start.
        assert_eq!(fit(&c, 3).0, vec![0, 9, 10]);
        // No answer: the opening and the end.
        assert_eq!(fit(&conv("000000", 2, 0), 4).0, vec![0, 1, 4, 5]);
    }

    fn words(bytes: &[u8]) -> Vec<u32> {
        bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    fn starts(bytes: &[u8]) -> Vec<u64> {
        bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect()
    }

    #[test]
    fn packed_conversations_never_straddle_windows() {
        let mut w = Windows::new(Vec::new(), Vec::new(), 4, ChatLayout::Pack, 99);
        w.conversation(&conv("01", 0, 0)).unwrap();
        w.conversation(&conv("011", 0, 0)).unwrap(); // does not fit in the 2 left: next window
        w.conversation(&conv("0", 0, 0)).unwrap(); // fits
        w.conversation(&conv("000011", 1, 0)).unwrap(); // longer than a window: cut, alone
        w.conversation(&conv("", 0, 0)).unwrap(); // nothing
        w.conversation(&conv("01", 0, 0)).unwrap();
        let (bytes, s, n) = w.finish(true).unwrap();
        let t = TRAINED;
        assert_eq!(words(&bytes), [0, 1 | t, 99, 99, 0, 1 | t, 2 | t, 0, 0, 3, 4 | t, 5 | t, 0, 1 | t, 99, 99]);
        assert_eq!(n, 16);
        // Each conversation starts a document, and so does each run of padding.
        assert_eq!(starts(&s), [0, 2, 4, 7, 8, 12, 14]);
    }

    #[test]
    fn truncated_conversations_take_a_window_each() {
        let mut w = Windows::new(Vec::new(), Vec::new(), 3, ChatLayout::Truncate, 99);
        w.conversation(&conv("01", 0, 0)).unwrap();
        w.conversation(&conv("", 0, 0)).unwrap();
        w.conversation(&conv("00011", 1, 0)).unwrap();
        let (bytes, s, _) = w.finish(true).unwrap();
        let t = TRAINED;
        assert_eq!(words(&bytes), [0, 1 | t, 99, 99, 99, 99, 2, 3 | t, 4 | t]);
        assert_eq!(starts(&s), [0, 2, 3, 4, 6]);
        // Documents are packed (a piece that goes on with a document starts none; an empty first piece starts
        // the document at the next token), and their last part window is not padded.
        let mut w = Windows::new(Vec::new(), Vec::new(), 3, ChatLayout::Truncate, 99);
        w.document(&[5, 6], true).unwrap();
        w.document(&[7], false).unwrap();
        w.document(&[], true).unwrap();
        w.document(&[8], false).unwrap();
        let (bytes, s, _) = w.finish(false).unwrap();
        assert_eq!(words(&bytes), [5 | t, 6 | t, 7 | t, 8 | t]);
        assert_eq!(starts(&s), [0, 3]);
    }
}
