//! The sliding window an [`AttentionSlot`] carries: it is applied to every spec the slot runs (forward and
//! forward_output), the smaller window wins when the model's spec has one too, `None` leaves the spec as it
//! is, and `set_max_attention_distance` sets every slot of a module tree (and says how many).

use std::sync::Arc;

use autosp_core::module::{set_max_attention_distance, NaiveAttention};
use autosp_core::ops::attention::naive_attention_forward;
use autosp_core::ops::AttentionSpec;
use autosp_core::{AttentionSlot, Module, Tape};
use candle_core::{DType, Device, Tensor};

fn input(shape: &[usize], seed: u64) -> Tensor {
    autosp_core::gradcheck::probe(shape, seed, &Device::Cpu).unwrap().to_dtype(DType::F64).unwrap()
}

/// The slot's output for `spec` equals the naive attention's for `want` (same f64 computation: exactly).
fn check(slot: &AttentionSlot, spec: AttentionSpec, want: AttentionSpec) {
    let (q, k, v) = (input(&[1, 9, 2, 4], 1), input(&[1, 9, 1, 4], 2), input(&[1, 9, 1, 4], 3));
    let tape = Tape::inference();
    let (o, lse) = slot
        .forward(&tape, &tape.constant(q.clone()), &tape.constant(k.clone()), &tape.constant(v.clone()), &spec)
        .unwrap();
    let out = slot
        .forward_output(&tape, &tape.constant(q.clone()), &tape.constant(k.clone()), &tape.constant(v.clone()), &spec)
        .unwrap();
    let (o_ref, lse_ref) = naive_attention_forward(&q, &k, &v, &want).unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
    assert_eq!(flat(o.tensor()), flat(&o_ref), "{spec:?} through a slot with {:?}", slot.max_distance());
    assert_eq!(flat(lse.tensor()), flat(&lse_ref));
    assert_eq!(flat(out.tensor()), flat(&o_ref));
}

#[test]
fn the_slot_window_applies_on_top_of_the_spec() {
    let causal = AttentionSpec::causal;
    let mut slot = AttentionSlot::new(Arc::new(NaiveAttention));
    check(&slot, causal(), causal());
    check(&slot, causal().with_max_distance(3), causal().with_max_distance(3));
    slot.set_max_distance(Some(2));
    assert_eq!(slot.max_distance(), Some(2));
    check(&slot, causal(), causal().with_max_distance(2));
    check(&slot, causal().with_max_distance(5), causal().with_max_distance(2));
    check(&slot, causal().with_max_distance(1), causal().with_max_distance(1));
    check(&slot, AttentionSpec::full(), AttentionSpec::full().with_max_distance(2));
    // The window changes the result (the check is not vacuous).
    let (q, k, v) = (input(&[1, 9, 2, 4], 1), input(&[1, 9, 1, 4], 2), input(&[1, 9, 1, 4], 3));
    let a = naive_attention_forward(&q, &k, &v, &causal()).unwrap().0;
    let b = naive_attention_forward(&q, &k, &v, &causal().with_max_distance(2)).unwrap().0;
    assert!((a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap() > 1e-3);
}

/// A two-level tree with three slots.
struct Leaf(AttentionSlot);
struct Tree(Vec<Leaf>, Leaf);

impl Module for Leaf {
    fn kind(&self) -> &'static str {
        "Leaf"
    }
    fn attention_slot(&mut self) -> Option<&mut AttentionSlot> {
        Some(&mut self.0)
    }
}

impl Module for Tree {
    fn kind(&self) -> &'static str {
        "Tree"
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut c: Vec<(String, &dyn Module)> =
            self.0.iter().enumerate().map(|(i, l)| (i.to_string(), l as &dyn Module)).collect();
        c.push(("last".into(), &self.1));
        c
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        let mut c: Vec<(String, &mut dyn Module)> =
            self.0.iter_mut().enumerate().map(|(i, l)| (i.to_string(), l as &mut dyn Module)).collect();
        c.push(("last".into(), &mut self.1));
        c
    }
}

#[test]
fn set_max_attention_distance_sets_every_slot() {
    let leaf = || Leaf(AttentionSlot::new(Arc::new(NaiveAttention)));
    let mut tree = Tree(vec![leaf(), leaf()], leaf());
    assert_eq!(set_max_attention_distance(&mut tree, Some(7)), 3);
    assert!(tree.0.iter().chain([&tree.1]).all(|l| l.0.max_distance() == Some(7)));
    let text = autosp_core::module::describe_tree(&mut tree);
    assert_eq!(text.matches("[attention: naive, max distance 7]").count(), 3, "{text}");
    assert_eq!(set_max_attention_distance(&mut tree, None), 3);
    assert!(tree.0.iter().chain([&tree.1]).all(|l| l.0.max_distance().is_none()));
}
