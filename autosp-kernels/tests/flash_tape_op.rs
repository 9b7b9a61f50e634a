//! Flash attention as a tape op: its backward passes central finite differences in f64 (tolerance as in
//! autosp-core's op tests: 1e-7 + 1e-6 relative) and its gradients equal the naive tape op's, packed
//! documents included (the document mask only changes which pairs are computed).

use std::sync::Arc;

use autosp_core::gradcheck::{check_gradients, probe};
use autosp_core::ops::{self, AttentionSpec, Documents};
use autosp_core::{CheckpointPolicy, Tape};
use autosp_kernels::attention::attention;
use candle_core::Device;

#[test]
fn flash_op_gradients_match_finite_differences_and_naive() {
    let cases = [
        (AttentionSpec::causal(), 6, 6, 4, 2),
        (
            AttentionSpec {
                causal: true,
                scale: Some(0.3),
                q_offset: 5,
                k_offset: 2,
                max_distance: None,
                documents: None,
            },
            5,
            7,
            2,
            1,
        ),
        (AttentionSpec::full(), 4, 9, 2, 2),
        (
            AttentionSpec::causal().with_documents(Some(Arc::new(Documents::from_lengths(&[2, 3, 1], 0).unwrap()))),
            6,
            6,
            4,
            2,
        ),
        (
            AttentionSpec::full().with_documents(Some(Arc::new(Documents::from_lengths(&[4, 3], 0).unwrap()))),
            7,
            7,
            2,
            1,
        ),
    ];
    for (i, (spec, nq, nk, h, hkv)) in cases.into_iter().enumerate() {
        let s = 10 * i as u64;
        let inputs = [
            probe(&[1, nq, h, 8], s, &Device::Cpu).unwrap(),
            probe(&[1, nk, hkv, 8], s + 1, &Device::Cpu).unwrap(),
            probe(&[1, nk, hkv, 8], s + 2, &Device::Cpu).unwrap(),
        ];
        check_gradients(
            |t, v| {
                let (o, lse) = attention(t, &v[0], &v[1], &v[2], spec.clone())?;
                Ok(vec![o, lse])
            },
            &inputs,
            &[0, 1, 2],
            1e-6,
            1e-7,
            1e-6,
        )
        .unwrap();

        let grads = |naive: bool| {
            let tape = Tape::new(CheckpointPolicy::None);
            let v: Vec<_> = inputs.iter().map(|t| tape.leaf(t.clone())).collect();
            let (o, _) = if naive {
                ops::naive_attention(&tape, &v[0], &v[1], &v[2], spec.clone()).unwrap()
            } else {
                attention(&tape, &v[0], &v[1], &v[2], spec.clone()).unwrap()
            };
            let seed = probe(o.dims(), 99, &Device::Cpu).unwrap();
            tape.backward_with_grad(&o, &seed, false).unwrap();
            v.iter().map(|x| tape.grad(x).unwrap().unwrap()).collect::<Vec<_>>()
        };
        for (a, b) in grads(false).iter().zip(grads(true)) {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(d < 1e-12, "case {i}: flash vs naive gradient differs by {d}");
        }
    }
}
