//! Ops given a frozen weight (a LoRA base: `Param::set_frozen`, a tape leaf that takes no gradient) skip the
//! weight's gradient and give the other inputs exactly the gradients they get when the weight trains: the core
//! `linear`, the chunked MLP and the chunked loss, on the CPU kernels and the generic ones (the path every other
//! device runs). Exact equality: the skipped products feed only the weight's gradient, so the gradients kept
//! are computed by the same operations in the same order.

use autosp_core::gradcheck::probe;
use autosp_core::{ops, CheckpointPolicy, Param, Result, Tape, Value};
use autosp_kernels::cross_entropy::chunked_cross_entropy;
use autosp_kernels::mlp::chunked_mlp;
use autosp_kernels::{with_kernels, Kernels};
use candle_core::{DType, Device, Tensor};

/// A loss of `x` and the weights.
type Loss<'a> = &'a dyn Fn(&Tape, &Value, &[Value]) -> Result<Value>;

fn rand(shape: &[usize], seed: u64) -> Tensor {
    probe(shape, seed, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
}

/// `x`'s gradient and whether each weight got one, for `loss = f(x, weights)` with the weights frozen or not.
fn grads(frozen: bool, x: &Tensor, weights: &[Tensor], f: Loss<'_>) -> (Tensor, Vec<bool>) {
    let tape = Tape::new(CheckpointPolicy::None);
    let params: Vec<Param> = weights.iter().enumerate().map(|(i, w)| Param::new(format!("w{i}"), w.clone())).collect();
    for p in &params {
        p.set_frozen(frozen);
    }
    let xv = tape.leaf(x.clone());
    let ws: Vec<_> = params.iter().map(|p| tape.param(p).unwrap()).collect();
    let loss = f(&tape, &xv, &ws).unwrap();
    tape.backward(&loss).unwrap();
    let pg = tape.param_grads();
    (tape.grad(&xv).unwrap().unwrap(), params.iter().map(|p| pg.get(p).is_some()).collect())
}

fn check(name: &str, x: &Tensor, weights: &[Tensor], f: Loss<'_>) {
    for kernels in [Kernels::Auto, Kernels::Generic] {
        let ((dx_train, got_train), (dx_frozen, got_frozen)) =
            with_kernels(kernels, || (grads(false, x, weights, f), grads(true, x, weights, f)));
        assert!(got_train.iter().all(|&g| g), "{name} {kernels:?}: trainable weights get gradients");
        assert!(got_frozen.iter().all(|&g| !g), "{name} {kernels:?}: frozen weights get none");
        let d = (&dx_train - &dx_frozen).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(d, 0.0, "{name} {kernels:?}: x's gradient changed when the weights froze");
    }
}

#[test]
fn frozen_weights_skip_their_gradient_and_leave_the_inputs_exact() {
    let x = rand(&[2, 37, 16], 1);
    let project = rand(&[2, 37, 16], 9);
    // The core linear, with a bias.
    check("linear", &x, &[rand(&[16, 16], 2), rand(&[16], 3)], &|t, x, w| {
        let y = ops::linear(t, x, &w[0], Some(&w[1]))?;
        ops::sum_all(t, &ops::mul(t, &y, &t.constant(project.clone()))?)
    });
    // The chunked MLP, 37 · 2 rows in chunks of 16 (the last one short).
    let (wg, wu, wd) = (rand(&[24, 16], 4), rand(&[24, 16], 5), rand(&[16, 24], 6));
    check("chunked_mlp", &x, &[wg, wu, wd], &|t, x, w| {
        let y = chunked_mlp(t, x, &w[0], &w[1], &w[2], 16)?;
        ops::sum_all(t, &ops::mul(t, &y, &t.constant(project.clone()))?)
    });
    // The chunked loss over a vocabulary of 50, some targets ignored.
    let h = rand(&[74, 16], 7);
    let targets: Vec<i64> = (0..74).map(|i| if i % 7 == 3 { -100 } else { (i * 13 % 50) as i64 }).collect();
    let targets = Tensor::new(targets, &Device::Cpu).unwrap();
    check("chunked_cross_entropy", &h, &[rand(&[50, 16], 8)], &|t, x, w| {
        Ok(chunked_cross_entropy(t, x, &w[0], &t.constant(targets.clone()), 16)?.0)
    });
}
