//! Plain text read as documents, streamed: a document ends at a blank line (one holding only whitespace), and
//! one longer than a cap is handed on in pieces cut at a line end (else at whitespace, else between
//! characters), so no more than about the cap is ever held, whatever the file's size or line lengths.

use std::io::BufRead;

/// The most bytes of one document held at a time (a longer one is handed on in pieces).
pub(super) const DOCUMENT_CAP: usize = 1 << 20;

/// A piece of a plain-text document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Piece {
    /// Its text (a document's, without the line break that ends it).
    pub text: String,
    /// Whether it starts a document (else it continues the previous piece's).
    pub first: bool,
    /// Whether it ends its document.
    pub last: bool,
    /// The 1-based line it starts on.
    pub line: usize,
    /// Bytes of the file read through when it was handed on.
    pub read: u64,
}

/// The documents of a plain-text stream, a [`Piece`] at a time.
pub(super) struct Paragraphs<R> {
    input: R,
    cap: usize,
    /// The current document's bytes not yet handed on.
    doc: Vec<u8>,
    /// Whether `doc` continues a piece already handed on.
    continued: bool,
    /// The line `doc` starts on, and the line being read.
    doc_line: usize,
    line: usize,
    /// Bytes consumed from `input`, and the offset of `doc`'s first byte.
    read: u64,
    doc_at: u64,
    /// Whether the last byte read ended a line (or nothing was read yet).
    at_line_start: bool,
    /// Where in `doc` the line being read starts.
    line_start: usize,
    done: bool,
}

/// Why the text could not be read: an I/O error, or bytes that are not UTF-8 (at this byte offset).
#[derive(Debug)]
pub(super) enum ReadError {
    /// Reading failed.
    Io(std::io::Error),
    /// Not UTF-8 at this byte of the file.
    NotUtf8(u64),
}

impl<R: BufRead> Paragraphs<R> {
    /// Documents of `input`, held at most `cap` bytes (at least 8) at a time.
    pub fn new(input: R, cap: usize) -> Self {
        Self {
            input,
            cap: cap.max(8),
            doc: Vec::new(),
            continued: false,
            doc_line: 1,
            line: 1,
            read: 0,
            doc_at: 0,
            at_line_start: true,
            line_start: 0,
            done: false,
        }
    }

    /// The next piece; `None` at the end of the text.
    pub fn next_piece(&mut self) -> Result<Option<Piece>, ReadError> {
        loop {
            if self.done {
                return self.take_all(true);
            }
            // A piece of the current line: up to its end, or up to the room left under the cap.
            let room = self.cap.saturating_sub(self.doc.len()).max(1);
            let buf = match self.input.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ReadError::Io(e)),
            };
            if buf.is_empty() {
                self.done = true;
                continue;
            }
            let (n, ends_line) = match buf.iter().take(room).position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (buf.len().min(room), false),
            };
            if self.at_line_start {
                self.line_start = self.doc.len();
            }
            self.doc.extend_from_slice(&buf[..n]);
            self.input.consume(n);
            self.read += n as u64;
            self.at_line_start = ends_line;
            if ends_line {
                self.line += 1;
                let line = &self.doc[self.line_start..];
                if line.iter().all(u8::is_ascii_whitespace) {
                    // A blank line: it ends the document before it (and belongs to none).
                    self.doc.truncate(self.line_start);
                    if let Some(p) = self.take_all(true)? {
                        return Ok(Some(p));
                    }
                    self.doc_line = self.line;
                    continue;
                }
            }
            if self.doc.len() >= self.cap {
                return self.take_cut().map(Some);
            }
        }
    }

    /// Hands on the whole of `doc` (when it holds more than whitespace) as a piece ending its document when
    /// `last`; resets the document.
    fn take_all(&mut self, last: bool) -> Result<Option<Piece>, ReadError> {
        let mut bytes = std::mem::take(&mut self.doc);
        while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            bytes.pop();
        }
        let first = !self.continued;
        let (line, at) = (self.doc_line, self.doc_at);
        self.continued = false;
        self.doc_line = self.line;
        self.doc_at = self.read;
        self.line_start = 0;
        if first && bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(None);
        }
        if !first && bytes.is_empty() {
            // The rest of a document already handed on was a line break: end it with an empty piece.
            return Ok(Some(Piece { text: String::new(), first, last, line, read: self.read }));
        }
        let text = utf8(bytes, at)?;
        Ok(Some(Piece { text, first, last, line, read: self.read }))
    }

    /// Hands on `doc` (not empty) up to its last line end before its last line (else its last whitespace, else
    /// before its last character), keeping the rest.
    fn take_cut(&mut self) -> Result<Piece, ReadError> {
        let d = &self.doc;
        // Not after the last line: a blank line may follow it and end the document there.
        let cut = match d[..d.len() - 1].iter().rposition(|&b| b == b'\n') {
            Some(i) if i > 0 => i + 1,
            _ => match d.iter().rposition(u8::is_ascii_whitespace) {
                Some(i) if i > 0 => i + 1,
                // No whitespace at all: before the last character (which may not be whole yet).
                _ => match d.iter().rposition(|&b| (b & 0xC0) != 0x80) {
                    Some(i) if i > 0 => i,
                    _ => d.len(),
                },
            },
        };
        let rest = self.doc.split_off(cut);
        let bytes = std::mem::replace(&mut self.doc, rest);
        let lines_in_piece = bytes.iter().filter(|&&b| b == b'\n').count();
        let piece_line = self.doc_line;
        let first = !self.continued;
        self.continued = true;
        self.doc_line += lines_in_piece;
        self.line_start = self.line_start.saturating_sub(cut);
        let text = utf8(bytes, self.doc_at)?;
        self.doc_at += cut as u64;
        Ok(Piece { text, first, last: false, line: piece_line, read: self.read })
    }
}

/// `bytes` (read from offset `at` of the file) as text.
fn utf8(bytes: Vec<u8>, at: u64) -> Result<String, ReadError> {
    String::from_utf8(bytes).map_err(|e| ReadError::NotUtf8(at + e.utf8_error().valid_up_to() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str, cap: usize) -> Vec<Piece> {
        let mut p = Paragraphs::new(std::io::BufReader::with_capacity(5, text.as_bytes()), cap);
        let mut out = Vec::new();
        while let Some(x) = p.next_piece().unwrap() {
            out.push(x);
        }
        out
    }

    fn texts(p: &[Piece]) -> Vec<(&str, bool, bool, usize)> {
        p.iter().map(|x| (x.text.as_str(), x.first, x.last, x.line)).collect()
    }

    #[test]
    fn documents_end_at_blank_lines() {
        let p = pieces("\n  one\ntwo\n\n \t\r\n\nthree\r\n\nfour", 1000);
        assert_eq!(texts(&p), [("  one\ntwo", true, true, 2), ("three", true, true, 7), ("four", true, true, 9)]);
        assert_eq!(p.last().unwrap().read, 29);
        assert!(pieces(" \n\n \n", 1000).is_empty());
        assert_eq!(texts(&pieces("a", 1000)), [("a", true, true, 1)]);
    }

    #[test]
    fn long_documents_are_cut_at_line_ends_then_whitespace_then_characters() {
        // Cut after the last line break within the cap but before the last line (which a blank line may end).
        let p = pieces("ab\ncd\nefgh\nij\n\nk\n", 8);
        let want =
            [("ab\ncd\n", true, false, 1), ("efgh\n", false, false, 3), ("ij", false, true, 4), ("k", true, true, 6)];
        assert_eq!(texts(&p), want);
        // One long line: at whitespace; then between characters (é is two bytes, never split).
        let p = pieces("aaaaa bbbbbbbbbbbbbbbbbbbbé", 8);
        assert_eq!(p.iter().map(|x| x.text.as_str()).collect::<String>(), "aaaaa bbbbbbbbbbbbbbbbbbbbé");
        assert_eq!(p[0].text, "aaaaa ");
        assert!(p.len() >= 4 && p.iter().all(|x| x.text.len() <= 8), "{p:?}");
        assert!(p[0].first && !p[1].first && p.last().unwrap().last && !p[0].last);
        // A document cut inside its last line still ends at the blank line after it.
        let p = pieces("abcdefgh\n\nz", 8);
        assert_eq!(texts(&p), [("abcdefg", true, false, 1), ("h", false, true, 1), ("z", true, true, 3)]);
    }

    #[test]
    fn bytes_that_are_not_utf8_are_located() {
        let bytes = b"ok\n\nab\xffc".to_vec();
        let mut p = Paragraphs::new(std::io::BufReader::new(&bytes[..]), 100);
        assert_eq!(p.next_piece().unwrap().unwrap().text, "ok");
        match p.next_piece() {
            Err(ReadError::NotUtf8(at)) => assert_eq!(at, 6),
            other => panic!("{other:?}"),
        }
    }
}
