//! `Tape::backward_with_ready`: each parameter's gradient is handed over once, right after backward
//! differentiated its first use in the forward pass (a parameter used twice waits for both uses), equal to
//! what `backward` leaves in `param_grads`; the backward mark counts the nodes done when it is handed over.

use autosp_core::ops;
use autosp_core::progress::{current_mark, BackwardMark};
use autosp_core::{CheckpointPolicy, Param, Result, Tape, Value};
use candle_core::{Device, Tensor};

/// `sum(a * (b * (c * (a * x))))` over 4 elements: node 0 uses `a`, node 1 `c`, node 2 `b`, node 3 `a` again.
fn forward(tape: &Tape, a: &Param, b: &Param, c: &Param) -> Result<Value> {
    let x = tape.constant(Tensor::new(&[1f32, -2., 3., 0.5], &Device::Cpu)?);
    let (a, b, c) = (tape.param(a)?, tape.param(b)?, tape.param(c)?);
    let y = ops::mul(tape, &a, &x)?;
    let y = ops::mul(tape, &c, &y)?;
    let y = ops::mul(tape, &b, &y)?;
    let y = ops::mul(tape, &a, &y)?;
    ops::sum_all(tape, &y)
}

#[test]
fn each_gradient_is_handed_over_once_when_its_first_use_is_done() -> Result<()> {
    let p = |name: &str, v: [f32; 4]| Param::new(name, Tensor::new(&v, &Device::Cpu).unwrap());
    let (a, b, c) = (p("a", [0.5, 1., -1., 2.]), p("b", [3., 0.25, 1., -1.]), p("c", [1., 2., 0.5, 4.]));
    let tape = Tape::new(CheckpointPolicy::None);
    let loss = forward(&tape, &a, &b, &c)?;
    tape.backward(&loss)?;
    let want = tape.param_grads();

    let tape = Tape::new(CheckpointPolicy::None);
    let loss = forward(&tape, &a, &b, &c)?;
    let mut handed: Vec<(String, Vec<f32>, Option<BackwardMark>)> = Vec::new();
    let names = [(a.id(), "a"), (b.id(), "b"), (c.id(), "c")];
    tape.backward_with_ready(&loss, &mut |id, g| {
        let name = names.iter().find(|(i, _)| *i == id).unwrap().1;
        handed.push((name.to_string(), g.to_vec1::<f32>()?, current_mark()));
        Ok(())
    })?;
    assert_eq!(current_mark(), None, "the mark is cleared when backward ends");
    let order: Vec<&str> = handed.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(order, ["b", "c", "a"], "in the order backward finishes them; `a` after both its uses");
    let marks: Vec<usize> = handed.iter().map(|(_, _, m)| m.unwrap().done).collect();
    // 5 nodes: sum, mul(a), mul(b), mul(c), mul(a); b is final after 3, c after 4, a after all 5.
    assert_eq!(marks, [3, 4, 5]);
    assert!(handed[0].2.unwrap().before_end() && !handed[2].2.unwrap().before_end());
    for (name, g, _) in &handed {
        let p = [&a, &b, &c].into_iter().find(|p| p.name() == name).unwrap();
        assert_eq!(g, &want.get(p).unwrap().to_vec1::<f32>()?, "{name}: the same gradient as backward's");
    }
    assert!(tape.param_grads().is_empty(), "handed-over gradients are not kept on the tape");
    Ok(())
}
