//! The gather prefetch at `--shard parameters` (#41 item 5), on thread ranks with a tiny Llama: with the next
//! block's weights gathered on a communication thread while a block computes, the loss and every gradient are
//! bit for bit those of gathering each weight at its use (the same collectives carry the same slices, and
//! the sums are the same), on 1 × 2 and 2 × 2 meshes, full fine-tuning and LoRA; the recording shows the same
//! collectives (kind, elements, dtype) either way (LoRA too, whose first block's backward replays only the
//! weights its adapters' gradients read: the prefetch gathers those), the block gathers made by the prefetch
//! thread; in the forward block j's gathers asked for while block j - 1 computed (the forward
//! mark: j regions begun, block j not yet), block 0's before the first; and in
//! backward each block's gathers posted at a mark before backward ended, one mark per block after the last,
//! increasing: block k's weights were gathered while block k + 1's backward ran. Three blocks, so that a
//! block has a block on either side. The accounting counts what the prefetch holds (two blocks' weights
//! gathered): the compiled model's and the resume check's, which refuses a budget one block's count fits.

mod common;

use std::sync::Arc;

use autosp::compile::model_state_bytes_with;
use autosp::compile::sharding::ParamCounts;
use autosp::compile::{compile, Checkpointing, CompileConfig, Mesh, Strategy};
use autosp::core::comm::{CallRecord, ProcessGroup};
use autosp::core::lora::LoraConfig;
use autosp::core::{CausalLm, CheckpointPolicy, ShardLevel};
use autosp::models::TinySpec;
use autosp::train::checkpoint::model_slices::skeleton;
use autosp::train::checkpoint::resume_fit::{check_fits, Budget};
use candle_core::{DType, Device, Tensor};

/// The prefetch thread's name, as its records carry it.
const PREFETCH_THREAD: &str = "gather-prefetch";

/// Two sequences of 32 tokens (one per replica at D = 2), some labels ignored.
fn batch(vocab: usize) -> (Tensor, Tensor) {
    let (b, n) = (2, 32);
    let ids: Vec<u32> = (0..(b * n) as u32).map(|i| (i * 29 + 3) % vocab as u32).collect();
    let labels: Vec<i64> =
        ids.iter().enumerate().map(|(i, &x)| if i % n < 2 || i % 6 == 1 { -100 } else { x as i64 }).collect();
    (Tensor::from_vec(ids, (b, n), &Device::Cpu).unwrap(), Tensor::from_vec(labels, (b, n), &Device::Cpu).unwrap())
}

/// What rank 0 saw in one step.
struct Seen {
    loss: f64,
    /// Every trainable parameter's whole gradient, model order.
    grads: Vec<Vec<f32>>,
    /// The step's calls (whole gradients gathered after it are not among them).
    records: Vec<CallRecord>,
    /// Whether the compiled model prefetched.
    prefetched: bool,
    /// Decoder blocks.
    blocks: usize,
}

fn step(mesh: Mesh, lora: bool, prefetch: bool) -> Seen {
    let spec = TinySpec { layers: 3, ..TinySpec::default() };
    let mut ranks = common::recorded_tiny_ranks(spec, 11, mesh.world(), |model, recorder| {
        let world: Arc<dyn ProcessGroup> = recorder.clone();
        let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
        let mut cfg = CompileConfig::new(world, Strategy::Ulysses, policy)
            .with_mesh(mesh)
            .with_sharding(ShardLevel::Parameters)
            .with_prefetch_gathers(prefetch);
        if lora {
            cfg = cfg.with_lora(LoraConfig::new(4));
        }
        let c = compile(model, cfg).map_err(|e| e.to_string())?;
        let (ids, labels) = batch(c.model().dims().vocab);
        recorder.clear();
        let out = c.train_step(&ids, Some(&labels)).map_err(|e| e.to_string())?;
        let records = recorder.records();
        let whole = c.whole_grads(&out.grads).map_err(|e| e.to_string())?;
        let grads =
            c.params().iter().map(|p| whole.get(p).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
        Ok(Seen {
            loss: out.loss,
            grads,
            records,
            prefetched: c.prefetches_gathers(),
            blocks: c.model().layers.0.len(),
        })
    });
    ranks.remove(0)
}

/// The calls' kinds, elements and dtypes, sorted: what every rank sends, whichever thread or handle sent it.
fn collectives(records: &[CallRecord]) -> Vec<String> {
    let mut out: Vec<String> =
        records.iter().map(|r| format!("{:?} {} {:?}", r.collective, r.elems, r.dtype)).collect();
    out.sort();
    out
}

/// In the forward, the prefetch thread's gathers (marked by no backward) were asked for, block by block, when
/// 0, 1, .., n - 1 regions had begun: block j's while block j - 1 computed, before block j began; then, with
/// all n begun, backward's first block. Fails where no prefetch ran (no such gathers) or where a block's
/// weights were gathered only once the block began.
fn assert_forward_overlap(what: &str, seen: &Seen) {
    let mut asked: Vec<usize> = seen
        .records
        .iter()
        .filter(|r| r.thread.as_deref() == Some(PREFETCH_THREAD) && r.mark.is_none())
        .map(|r| r.forward.map_or(0, |m| m.begun))
        .collect();
    asked.dedup();
    let want: Vec<usize> = (0..=seen.blocks).collect();
    assert_eq!(asked, want, "{what}: regions begun when each block's forward gathers were asked for");
}

#[test]
fn prefetched_gathers_give_the_same_step_bit_for_bit() {
    for (d, s) in [(1, 2), (2, 2)] {
        for lora in [false, true] {
            let what = format!("{d} x {s}, lora {lora}");
            let on = step(Mesh::new(d, s), lora, true);
            let off = step(Mesh::new(d, s), lora, false);
            assert!(on.prefetched && !off.prefetched, "{what}: the switch turns the prefetch on and off");
            assert_eq!(on.loss.to_bits(), off.loss.to_bits(), "{what}: loss {} vs {}", on.loss, off.loss);
            assert_eq!(on.grads.len(), off.grads.len(), "{what}");
            for (i, (a, b)) in on.grads.iter().zip(&off.grads).enumerate() {
                assert!(a == b, "{what}: gradient {i} differs");
            }
            // LoRA too: backward gathers again only the weights recorded nodes read in the forward (not the
            // first block's frozen projections of an input that takes no gradient), as at each use.
            assert_eq!(collectives(&on.records), collectives(&off.records), "{what}: the same collectives");
            assert_forward_overlap(&what, &on);
            let thread = |r: &&CallRecord| r.thread.as_deref() == Some(PREFETCH_THREAD);
            assert!(!off.records.iter().any(|r| thread(&r)), "{what}: no prefetch thread when off");
            let prefetched: Vec<&CallRecord> = on.records.iter().filter(thread).collect();
            assert!(!prefetched.is_empty(), "{what}: the block weights were gathered by the prefetch thread");
            // Backward: the last block's weights were gathered at forward's end (no mark); each block before it
            // at the hand-off of the block after it, while backward ran.
            let mut marks: Vec<_> = prefetched.iter().filter_map(|r| r.mark).collect();
            marks.dedup();
            assert_eq!(marks.len(), on.blocks - 1, "{what}: one hand-off mark per block below the last: {marks:?}");
            assert!(marks.iter().all(|m| m.before_end()), "{what}: posted before backward ended: {marks:?}");
            assert!(marks.windows(2).all(|w| w[0].done < w[1].done), "{what}: in backward's order: {marks:?}");
        }
    }
}

/// At `--shard parameters` over 2 ranks the accounting counts two blocks' gathered weights with the prefetch,
/// one without: in the compiled model (which prefetches or not) and in the resume check, which refuses, with
/// the prefetch asked for, a budget that the states with one block gathered fit (the count before let it
/// through) and accepts it without.
#[test]
fn the_accounting_counts_the_two_blocks_the_prefetch_holds() {
    let config = TinySpec { layers: 3, ..TinySpec::default() }.config();
    let mut model = skeleton(&config, DType::F32, &Device::Cpu).unwrap();
    let dims = model.dims();
    let counts = ParamCounts::of(&mut model, &dims);
    let at = |prefetch| model_state_bytes_with(&counts, DType::F32, ShardLevel::Parameters, 2, prefetch);
    let (one, two) = (at(false), at(true));
    assert!(one.gathered > 0 && two.gathered == 2 * one.gathered, "{one:?} vs {two:?}");
    // One process per rank (no launcher variables here): one rank's states against the budget.
    let budget = Budget { bytes: one.total() as u64, source: "the budget" };
    let mut fits =
        |prefetch| check_fits("x", &mut model, DType::F32, Some(ShardLevel::Parameters), 2, false, prefetch, &budget);
    assert!(fits(false).is_ok(), "one block gathered fits");
    let e = fits(true).unwrap_err().to_string();
    assert!(e.contains(&format!("gathered weights {:.1} MiB", two.gathered as f64 / (1 << 20) as f64)), "{e}");
    // The compiled model: the same counts, as it prefetches or not.
    for prefetch in [true, false] {
        let mut ranks =
            common::recorded_tiny_ranks(TinySpec { layers: 3, ..TinySpec::default() }, 11, 2, |model, g| {
                let policy = Checkpointing::Policy(CheckpointPolicy::SequenceAware);
                let cfg = CompileConfig::new(g, Strategy::Ulysses, policy)
                    .with_sharding(ShardLevel::Parameters)
                    .with_prefetch_gathers(prefetch);
                let c = compile(model, cfg).map_err(|e| e.to_string())?;
                Ok((c.prefetches_gathers(), c.model_state_bytes()))
            });
        let (prefetched, bytes) = ranks.remove(0);
        assert_eq!(prefetched, prefetch);
        assert_eq!(bytes.gathered, if prefetch { two.gathered } else { one.gathered }, "prefetch {prefetch}");
    }
}
