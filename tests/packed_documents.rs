//! Packed documents through the compiled tiny Llama (`Compiled::*_packed`): a window packed from several
//! documents trains exactly like its documents run one by one. Loss times valid targets and gradients times
//! valid targets equal the sums over the documents alone (each a plain `train_step`), at P = 1, 2 and 4 thread
//! ranks, Ulysses, Ring (zigzag) and hybrid, without and with a sliding window, within 1e-5 relative to the
//! largest element: the packed run computes the same attention pairs (its document mask keeps exactly each
//! document's own keys, restarted positions give each the same RoPE angles) but in f32 over other row counts
//! and shard boundaries, so its matmuls and reductions add the same terms in another order (measured worst
//! about 1e-6). Rows of one batch with different documents, logits, logits at rows and token losses agree
//! too; bad boundaries are typed errors. Transformers' loss on packed inputs: `packed_transformers.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use autosp::compile::{compile, Checkpointing, CompileConfig, CompileError, Compiled, Mesh, Strategy};
use autosp_core::comm::run_ranks;
use autosp_core::ops::Documents;
use autosp_core::CheckpointPolicy;
use autosp_models::{random_weights, LlamaModel, TinySpec};
use candle_core::{DType, Device, Tensor};

const VOCAB: usize = 128;

fn tiny() -> LlamaModel {
    // 4 heads, 2 kv heads, 2 layers, vocab 128.
    let spec = TinySpec { hidden: 32, intermediate: 64, ..TinySpec::default() };
    let cfg = spec.config();
    LlamaModel::from_weights(&cfg, random_weights(&cfg, 7, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

fn ids_of(tokens: &[u32]) -> Tensor {
    Tensor::from_vec(tokens.to_vec(), (1, tokens.len()), &Device::Cpu).unwrap()
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 17 + 5 + seed * 31) % VOCAB as u32).collect()
}

/// A loss times its valid targets and the gradients (by name) times them: what adds up over documents.
type Sums = (f64, usize, HashMap<String, Vec<f64>>);

fn sums_of(c: &Compiled<LlamaModel>, out: autosp::compile::StepOutput) -> Sums {
    let whole = c.whole_grads(&out.grads).unwrap();
    let count = out.valid_tokens as f64;
    let grads = c
        .params()
        .iter()
        .map(|p| {
            let g = whole.get(p).unwrap().flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            (p.name().to_string(), g.to_vec1::<f64>().unwrap().iter().map(|x| x * count).collect())
        })
        .collect();
    (out.loss * count, out.valid_tokens, grads)
}

fn add(a: &mut Sums, b: Sums) {
    a.0 += b.0;
    a.1 += b.1;
    for (n, g) in b.2 {
        let acc = a.2.entry(n).or_insert_with(|| vec![0.0; g.len()]);
        acc.iter_mut().zip(&g).for_each(|(x, y)| *x += y);
    }
}

/// The largest relative miss: the loss sum's, and each gradient's relative to its largest element.
fn miss(got: &Sums, want: &Sums) -> f64 {
    assert_eq!(got.1, want.1, "valid targets");
    let mut worst = (got.0 - want.0).abs() / want.0.abs();
    for (n, w) in &want.2 {
        let g = &got.2[n];
        let scale = w.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
        worst = worst.max(g.iter().zip(w).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale);
    }
    worst
}

/// On `p` thread ranks (a mesh of `d` replicas) with `strategy` and window `w`: the packed batch `rows` (each
/// row's documents' tokens and lengths) in one step, and every document alone; returns the worst miss.
fn packed_vs_alone(p: usize, d: usize, strategy: Strategy, w: Option<usize>, rows: Vec<Vec<(Vec<u32>, usize)>>) -> f64 {
    let rows = Arc::new(rows);
    let out = run_ranks(p, Duration::from_secs(120), move |pg| -> Result<f64, String> {
        let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
        let cfg =
            |mesh| CompileConfig::new(pg.clone(), strategy, policy).with_max_attention_distance(w).with_mesh(mesh);
        let c = compile(tiny(), cfg(Mesh::new(d, p / d))).map_err(|e| e.to_string())?;
        // The documents alone, one sequence each (a batch of one row): on the same ranks, as one replica.
        let one = if d == 1 { None } else { Some(compile(tiny(), cfg(Mesh::new(1, p))).map_err(|e| e.to_string())?) };
        let alone_on = one.as_ref().unwrap_or(&c);
        let mut all = Vec::new();
        let mut documents = Vec::new();
        let mut alone: Sums = (0.0, 0, HashMap::new());
        for row in rows.iter() {
            let lengths: Vec<usize> = row.iter().map(|d| d.1).collect();
            documents.push(Documents::from_lengths(&lengths, 0).map_err(|e| e.to_string())?);
            for (doc, _) in row {
                all.extend_from_slice(doc);
                let step = alone_on.train_step(&ids_of(doc), None).map_err(|e| e.to_string())?;
                add(&mut alone, sums_of(alone_on, step));
            }
        }
        let n = all.len() / rows.len();
        let ids = Tensor::from_vec(all, (rows.len(), n), &Device::Cpu).unwrap();
        let packed = sums_of(&c, c.train_step_packed(&ids, None, &documents).map_err(|e| e.to_string())?);
        Ok(miss(&packed, &alone))
    });
    out.into_iter().map(|r| r.expect("rank panicked").expect("step failed")).fold(0.0, f64::max)
}

/// Documents of 5, 9, 2, 4 and 6 tokens: a window of 26 (padded to 28 or 32 for the zigzag layouts, so the
/// padding is a document of its own), documents that cross shard boundaries and shards wholly inside one.
fn one_window() -> Vec<Vec<(Vec<u32>, usize)>> {
    vec![[5, 9, 2, 4, 6].iter().enumerate().map(|(i, &l)| (tokens(l, i as u32), l)).collect()]
}

#[test]
fn a_packed_window_trains_like_its_documents_one_by_one() {
    let mut worst = 0f64;
    for p in [1, 2, 4] {
        let mut strategies = vec![Strategy::Ulysses, Strategy::Ring];
        if p == 4 {
            strategies.push(Strategy::Hybrid { ulysses: 2 });
        }
        for s in strategies {
            for w in [None, Some(3)] {
                let m = packed_vs_alone(p, 1, s, w, one_window());
                assert!(m <= 1e-5, "P = {p}, {s:?}, window {w:?}: packed vs one by one off by {m:e}");
                worst = worst.max(m);
            }
        }
    }
    eprintln!("worst relative miss of a packed window against its documents one by one: {worst:e}");
}

/// Two rows with different documents (grouped by documents on one tape), and a row of one document (no mask);
/// on a mesh of 2 replicas × 2 sequence ranks each replica takes its row and that row's documents.
#[test]
fn rows_with_different_documents_train_like_their_documents() {
    let doc = |l: usize, s: u32| (tokens(l, s), l);
    let rows = vec![vec![doc(7, 1), doc(3, 2), doc(6, 3)], vec![doc(4, 4), doc(12, 5)], vec![doc(16, 6)]];
    for (p, s) in [(1, Strategy::Ulysses), (2, Strategy::Ring)] {
        let m = packed_vs_alone(p, 1, s, None, rows.clone());
        assert!(m <= 1e-5, "P = {p}, {s:?}: off by {m:e}");
    }
    let m = packed_vs_alone(4, 2, Strategy::Ring, None, rows[..2].to_vec());
    assert!(m <= 1e-5, "2 replicas × 2 ranks: off by {m:e}");
}

/// Logits, logits at rows and token losses of a packed window are those of each document alone (token
/// losses 0 at each document's last token, whose next token starts another document); P = 2, Ring.
#[test]
fn logits_and_token_losses_of_a_packed_window_are_each_documents() {
    let out = run_ranks(2, Duration::from_secs(60), |pg| -> Result<(), String> {
        let policy = Checkpointing::Policy(CheckpointPolicy::None);
        let c = compile(tiny(), CompileConfig::new(pg, Strategy::Ring, policy)).map_err(|e| e.to_string())?;
        let docs: Vec<Vec<u32>> = [5, 9, 2, 6].iter().enumerate().map(|(i, &l)| tokens(l, i as u32)).collect();
        let all: Vec<u32> = docs.concat();
        let d = Documents::from_lengths(&docs.iter().map(Vec::len).collect::<Vec<_>>(), 0).unwrap();
        let packed = c.logits_packed(&ids_of(&all), std::slice::from_ref(&d)).map_err(|e| e.to_string())?;
        let alone: Vec<Tensor> = docs.iter().map(|t| c.logits(&ids_of(t)).unwrap()).collect();
        let alone = Tensor::cat(&alone, 1).unwrap();
        let diff = (packed - &alone).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-5, "logits off by {diff}");
        let rows = [0, 6, 14, 21];
        let at = c.logits_at_packed(&ids_of(&all), &rows, std::slice::from_ref(&d)).map_err(|e| e.to_string())?;
        let want = alone.index_select(&Tensor::new(&[0u32, 6, 14, 21], &Device::Cpu).unwrap(), 1).unwrap();
        let diff = (at - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-5, "logits at rows off by {diff}");
        let losses = c.token_losses_packed(&ids_of(&all), None, std::slice::from_ref(&d)).map_err(|e| e.to_string())?;
        let alone: Vec<Tensor> = docs.iter().map(|t| c.token_losses(&ids_of(t), None).unwrap()).collect();
        let alone = Tensor::cat(&alone, 1).unwrap();
        let diff = (&losses - alone).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff <= 1e-5, "token losses off by {diff}");
        let l = losses.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!([l[4], l[13], l[15]], [0.0; 3], "the targets across boundaries are ignored");
        Ok(())
    });
    for r in out {
        r.expect("rank panicked").expect("rank failed");
    }
}

/// Boundaries that do not add up to the window, the wrong number of rows: typed errors naming what to do.
#[test]
fn bad_boundaries_are_refused() {
    let out = run_ranks(1, Duration::from_secs(60), |pg| {
        let policy = Checkpointing::Policy(CheckpointPolicy::None);
        let c = compile(tiny(), CompileConfig::new(pg, Strategy::Auto, policy)).unwrap();
        let ids = ids_of(&tokens(10, 0));
        let short = Documents::from_lengths(&[4, 5], 0).unwrap();
        let e = c.train_step_packed(&ids, None, std::slice::from_ref(&short)).unwrap_err();
        assert!(matches!(e, CompileError::Documents { row: 0, .. }), "{e}");
        assert!(e.to_string().contains("end at 9 but the window holds 10 tokens"), "{e}");
        let e = c.eval_loss_packed(&ids, None, &[]).unwrap_err();
        assert!(matches!(e, CompileError::DocumentsRows { rows: 1, given: 0 }), "{e}");
        let e = c.logits_packed(&ids, &[short.clone(), short]).unwrap_err();
        assert!(e.to_string().contains("pass one per row"), "{e}");
        let e = Documents::new(10, vec![0, 6, 4, 10], 0).unwrap_err();
        assert!(e.to_string().contains("not strictly increasing"), "{e}");
        // One document from position 0 is the unpacked step, bit for bit.
        let whole = c.train_step_packed(&ids, None, &[Documents::whole(10)]).unwrap();
        assert_eq!(whole.loss.to_bits(), c.train_step(&ids, None).unwrap().loss.to_bits());
    });
    out.into_iter().for_each(|r| r.expect("rank panicked"));
}
