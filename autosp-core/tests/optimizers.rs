//! AdamW, SGD, clipping and schedules against values computed by hand (scalar f64 arithmetic in the test).

use autosp_core::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd};
use autosp_core::{Gradients, Param};
use candle_core::{Device, Tensor};

fn t(v: &[f64]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn vals(p: &Param) -> Vec<f64> {
    p.tensor().to_vec1::<f64>().unwrap()
}

#[test]
fn adamw_two_steps_by_hand() {
    let cfg = AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let p = Param::new("w", t(&[1.0, -2.0]));
    let mut opt = AdamW::new(cfg).unwrap();
    let steps = [([0.5, 0.1], 0.1), ([-0.2, 0.3], 0.05)];
    let (mut w, mut m, mut v) = ([1.0f64, -2.0], [0.0f64; 2], [0.0f64; 2]);
    for (k, (g, lr)) in steps.iter().enumerate() {
        let mut grads = Gradients::new();
        grads.insert(&p, t(g));
        opt.step(std::slice::from_ref(&p), &grads, *lr).unwrap();
        let step = (k + 1) as i32;
        for i in 0..2 {
            m[i] = 0.9 * m[i] + 0.1 * g[i];
            v[i] = 0.999 * v[i] + 0.001 * g[i] * g[i];
            let mhat = m[i] / (1.0 - 0.9f64.powi(step));
            let vhat = v[i] / (1.0 - 0.999f64.powi(step));
            w[i] = w[i] * (1.0 - lr * 0.01) - lr * mhat / (vhat.sqrt() + 1e-8);
        }
        let got = vals(&p);
        for i in 0..2 {
            assert!((got[i] - w[i]).abs() < 1e-14, "step {step} elem {i}: {} vs {}", got[i], w[i]);
        }
    }
    assert_eq!(opt.steps(), 2);
    // The first step of Adam moves each coordinate by almost exactly lr (plus decay).
    assert!((w[0] - (0.999 * 1.0 - 0.1) * (1.0 - 0.05 * 0.01)).abs() < 0.1);
}

#[test]
fn adamw_rejects_bad_hyper_parameters() {
    let e = AdamW::new(AdamWConfig { beta1: 1.0, ..Default::default() }).unwrap_err();
    assert!(e.to_string().contains("beta1"), "{e}");
}

#[test]
fn sgd_with_momentum_by_hand() {
    let p = Param::new("w", t(&[1.0]));
    let mut opt = Sgd::new(0.9, 0.1).unwrap();
    let (mut w, mut buf) = (1.0f64, None::<f64>);
    for g in [0.5, -0.25, 1.0] {
        let mut grads = Gradients::new();
        grads.insert(&p, t(&[g]));
        opt.step(std::slice::from_ref(&p), &grads, 0.01).unwrap();
        let d = g + 0.1 * w;
        let b = match buf {
            Some(b) => 0.9 * b + d,
            None => d,
        };
        buf = Some(b);
        w -= 0.01 * b;
        assert!((vals(&p)[0] - w).abs() < 1e-15);
    }
}

#[test]
fn clipping_by_global_norm() {
    let (a, b) = (Param::new("a", t(&[3.0, 4.0])), Param::new("b", t(&[12.0])));
    let mut grads = Gradients::new();
    grads.insert(&a, t(&[3.0, 4.0]));
    grads.insert(&b, t(&[12.0]));
    let norm = clip_grad_norm(&mut grads, 6.5).unwrap();
    assert!((norm - 13.0).abs() < 1e-12);
    let coef = 6.5 / (13.0 + 1e-6);
    let ga = grads.get(&a).unwrap().to_vec1::<f64>().unwrap();
    let gb = grads.get(&b).unwrap().to_vec1::<f64>().unwrap();
    assert!((ga[0] - 3.0 * coef).abs() < 1e-12 && (ga[1] - 4.0 * coef).abs() < 1e-12);
    assert!((gb[0] - 12.0 * coef).abs() < 1e-12);
    // Below the threshold nothing changes.
    let norm2 = clip_grad_norm(&mut grads, 100.0).unwrap();
    assert!((norm2 - 6.5).abs() < 1e-5);
    assert_eq!(grads.get(&b).unwrap().to_vec1::<f64>().unwrap()[0], gb[0]);
    assert!(clip_grad_norm(&mut grads, 0.0).is_err());
}

#[test]
fn warmup_cosine_schedule_by_hand() {
    let s = LrSchedule::WarmupCosine { peak: 1e-3, min_lr: 1e-4, warmup: 4, total: 12 };
    s.validate().unwrap();
    assert!((s.lr(0) - 0.25e-3).abs() < 1e-15);
    assert!((s.lr(3) - 1e-3).abs() < 1e-15);
    assert!((s.lr(4) - 1e-3).abs() < 1e-15);
    // Half way through the decay: the mean of peak and min.
    assert!((s.lr(8) - 0.55e-3).abs() < 1e-15);
    assert!((s.lr(12) - 1e-4).abs() < 1e-15);
    assert!((s.lr(100) - 1e-4).abs() < 1e-15);
    assert_eq!(LrSchedule::Constant(0.5).lr(7), 0.5);
    assert!(LrSchedule::WarmupCosine { peak: 1e-4, min_lr: 1e-3, warmup: 1, total: 2 }.validate().is_err());
}

/// A parameter listed twice (tied weights) is updated once per step, by SGD and by AdamW.
#[test]
fn a_parameter_listed_twice_is_stepped_once() {
    let p = Param::new("w", t(&[1.0, -2.0]));
    let mut grads = Gradients::new();
    grads.insert(&p, t(&[0.5, 0.25]));
    let twice = [p.clone(), p.clone()];
    Sgd::new(0.0, 0.0).unwrap().step(&twice, &grads, 0.1).unwrap();
    assert_eq!(vals(&p), [1.0 - 0.05, -2.0 - 0.025]);

    let q = Param::new("w", t(&[1.0, -2.0]));
    let r = Param::new("w", t(&[1.0, -2.0]));
    let mut grads = Gradients::new();
    grads.insert(&q, t(&[0.5, 0.25]));
    grads.insert(&r, t(&[0.5, 0.25]));
    let cfg = AdamWConfig::default();
    AdamW::new(cfg).unwrap().step(&[q.clone(), q.clone()], &grads, 0.1).unwrap();
    AdamW::new(cfg).unwrap().step(std::slice::from_ref(&r), &grads, 0.1).unwrap();
    assert_eq!(vals(&q), vals(&r), "listing a parameter twice must not step it twice");
}
