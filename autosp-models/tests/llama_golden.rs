//! Golden logits: tiny random checkpoints saved by HF transformers and the logits transformers computed for
//! fixed ids (tests/fixtures/golden/<case>/, made by tests/fixtures/make_golden.py); ours must match within
//! 1e-4 relative, for MHA, GQA, tied embeddings, Qwen2 biases and llama3 rope scaling.

use std::path::PathBuf;

use autosp_core::Tape;
use autosp_models::LlamaModel;
use candle_core::{DType, Device, Tensor};

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden")
}

/// `max |a - b| / max |b|`.
fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn logits_match_hf_transformers() {
    for case in ["mha", "gqa", "tied", "qwen2_bias", "llama3_rope"] {
        let dir = golden_dir().join(case);
        let golden_file = dir.join("golden.safetensors");
        assert!(
            golden_file.exists(),
            "golden fixture {} is missing: run `python3 tests/fixtures/make_golden.py` (needs torch and \
             transformers) and commit tests/fixtures/golden/",
            golden_file.display()
        );
        let golden = candle_core::safetensors::load(&golden_file, &Device::Cpu).unwrap();
        let model = LlamaModel::load(dir.to_str().unwrap(), DType::F32).unwrap();
        // inv_freq: transformers computes it in f32; ours in f64.
        let inv = Tensor::new(model.inv_freq(), &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        let r = max_rel(&inv, &golden["inv_freq"]);
        assert!(r < 1e-6, "{case}: rope inverse frequencies differ by {r} relative");
        let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
        let n = ids.dim(1).unwrap();
        let logits = model.logits(&Tape::inference(), &ids, &(0..n).collect::<Vec<_>>()).unwrap();
        let expect = &golden["logits"];
        assert_eq!(logits.dims(), expect.dims(), "{case}");
        // f32 on both sides, different summation orders (and f64 vs f32 rope tables): 1e-4 of the logits' scale.
        let r = max_rel(logits.tensor(), expect);
        eprintln!("{case}: max relative logit error vs transformers {r:.2e}");
        assert!(r < 1e-4, "{case}: logits differ from transformers' by {r} relative");
    }
}
