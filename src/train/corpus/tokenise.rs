//! Tokenising a data file into its cache: documents read in batches of a few MiB, each batch tokenised on
//! every core (a document per thread at a time) and written in order into the windows, so memory stays bounded
//! by the batch whatever the file's size.

use std::io::BufWriter;
use std::path::Path;

use autosp_models::chat::EncodedConversation;
use autosp_models::tokenizer::{encode, encode_document};

use super::layout::{ChatLayout, Windows};
use super::source::{for_each_doc, Doc, Item, Kind};
use super::Tokenising;
use crate::train::error::{IoContext, Result, TrainError};

/// Bytes of the file read into a batch before it is tokenised.
const BATCH_BYTES: usize = 4 << 20;
/// Documents read before a batch is tokenised (however short).
const BATCH_DOCS: usize = 8192;

/// A document tokenised.
enum Encoded {
    /// A text's ids (with EOS after a document's last piece), and whether they start a document.
    Text(Vec<u32>, bool),
    /// A conversation's.
    Chat(EncodedConversation),
}

/// Tokenises `data` (of `kind`) into `tmp`, and where its documents start into `tmp_starts` (`starts.rs`),
/// batch by batch, calling `progress` with the bytes of `data` read through after each; the tokens written.
pub(super) fn write_cache(
    data: &Path,
    kind: Kind,
    t: &Tokenising<'_>,
    (tmp, tmp_starts): (&Path, &Path),
    mut progress: impl FnMut(u64),
) -> Result<u64> {
    let chat = kind == Kind::Chat;
    if chat && t.layout == ChatLayout::Truncate && t.eos.is_none() {
        return Err(TrainError::Config(
            "--chat-layout truncate pads conversations with the model's EOS, and the model has none: use pack".into(),
        ));
    }
    let writing = || format!("writing the token cache {}", tmp.display());
    let out = std::fs::File::create(tmp).io(writing)?;
    let starts =
        std::fs::File::create(tmp_starts).io(|| format!("writing the document starts {}", tmp_starts.display()))?;
    let (out, starts) = (BufWriter::with_capacity(1 << 20, out), BufWriter::with_capacity(1 << 16, starts));
    let mut windows = Windows::new(out, starts, t.seq_len, t.layout, t.eos.unwrap_or(0));
    let mut batch: Vec<Item> = Vec::new();
    // Bytes of the file read into the batch: from where it started to the last item's end.
    let mut batch_from = 0u64;
    let mut flush = |batch: &mut Vec<Item>, windows: &mut Windows<_>| -> Result<()> {
        let Some(read) = batch.last().map(|i| i.read) else { return Ok(()) };
        for (item, enc) in batch.iter().zip(encode_all(batch, t)) {
            let enc = enc.map_err(|e| match e {
                TrainError::Data(m) => TrainError::Data(format!("{} line {}: {m}", data.display(), item.line)),
                e => e,
            })?;
            match enc {
                Encoded::Text(ids, first) => windows.document(&ids, first),
                Encoded::Chat(c) => windows.conversation(&c),
            }
            .io(writing)?;
        }
        batch.clear();
        progress(read);
        Ok(())
    };
    for_each_doc(data, kind, |item| {
        let read = item.read;
        batch.push(item);
        if read - batch_from >= BATCH_BYTES as u64 || batch.len() >= BATCH_DOCS {
            batch_from = read;
            flush(&mut batch, &mut windows)?;
        }
        Ok(())
    })?;
    flush(&mut batch, &mut windows)?;
    let (out, starts, count) = windows.finish(chat).io(writing)?;
    out.into_inner().map_err(|e| TrainError::io(writing(), e.into_error()))?.sync_all().io(writing)?;
    starts.into_inner().map_err(|e| TrainError::io(writing(), e.into_error()))?.sync_all().io(writing)?;
    if count == 0 {
        return Err(TrainError::Data(format!(
            "training data {} holds no tokens: give a file with text (or --data passkey)",
            data.display()
        )));
    }
    Ok(count)
}

/// Every item of `batch` tokenised, in order, on up to as many threads as there are cores.
fn encode_all(batch: &[Item], t: &Tokenising<'_>) -> Vec<Result<Encoded>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(batch.len()).max(1);
    if threads == 1 {
        return batch.iter().map(|i| encode_one(&i.doc, t)).collect();
    }
    let mut out: Vec<Option<Result<Encoded>>> = (0..batch.len()).map(|_| None).collect();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|k| {
                s.spawn(move || {
                    batch
                        .iter()
                        .enumerate()
                        .skip(k)
                        .step_by(threads)
                        .map(|(i, it)| (i, encode_one(&it.doc, t)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for w in workers {
            for (i, r) in w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)) {
                out[i] = Some(r);
            }
        }
    });
    out.into_iter().map(|r| r.expect("every item of the batch was given to a thread")).collect()
}

/// One document's tokens: a text's as transformers' `tokenizer(text)` (a piece that continues a document
/// without the special tokens) then EOS after a document's end; a conversation's by the chat template.
fn encode_one(doc: &Doc, t: &Tokenising<'_>) -> Result<Encoded> {
    match doc {
        Doc::Text { text, first, last } => {
            let mut ids = if *first { encode_document(t.tokenizer, text)? } else { encode(t.tokenizer, text)? };
            if let Some(e) = t.eos.filter(|&e| *last && ids.last() != Some(&e)) {
                ids.push(e);
            }
            Ok(Encoded::Text(ids, *first))
        }
        Doc::Chat(messages) => {
            let template = t.template.expect("checked: chat data has a template");
            let c = template.encode_conversation(t.tokenizer, messages).map_err(|e| TrainError::Data(e.to_string()))?;
            Ok(Encoded::Chat(c))
        }
    }
}
