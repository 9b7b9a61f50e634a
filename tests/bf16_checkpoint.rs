//! A checkpoint saved by a bf16 training run (tests/fixtures/bf16_run/: a tiny bf16 Llama made by
//! transformers, trained 12 steps by `llama_longctx --dtype bf16 --sp 2` and saved in its own dtype; see
//! tests/fixtures/make_bf16_golden.py) loads in HF transformers in bf16, and transformers' logits on it
//! match ours computed in bf16.

use std::path::PathBuf;

use autosp_core::module::all_params;
use autosp_core::Tape;
use autosp_models::LlamaModel;
use candle_core::{DType, Device, Tensor};

/// `max |a - b| / max |b|`.
fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    d / b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn bf16_run_checkpoint_logits_match_transformers_in_bf16() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bf16_run");
    let golden = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu)
        .expect("tests/fixtures/bf16_run/golden.safetensors: run tests/fixtures/make_bf16_golden.py");
    // The save is bf16 on disk (the checkpoint's own dtype), and says so in config.json.
    let stored = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(stored.values().all(|t| t.dtype() == DType::BF16), "the bf16 run must save bf16 tensors");
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(config.contains("\"torch_dtype\": \"bfloat16\""), "{config}");

    let model = LlamaModel::load(dir.to_str().unwrap(), DType::BF16).unwrap();
    assert!(all_params(&model).iter().all(|p| p.tensor().dtype() == DType::BF16));
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
    let n = ids.dim(1).unwrap();
    let logits = model.logits(&Tape::inference(), &ids, &(0..n).collect::<Vec<_>>()).unwrap();
    assert_eq!(logits.dtype(), DType::BF16);
    let ours = logits.tensor().to_dtype(DType::F32).unwrap();
    let r = max_rel(&ours, &golden["logits"]);
    eprintln!("bf16 logits vs transformers in bf16: max relative error {r:.2e}");
    // Both sides compute in bf16 (8 significant bits: one rounding is up to 2^-9 = 2e-3 relative) through
    // two layers with different fusion and summation orders; the logits' scale is ~5, so a few bf16 ulps of
    // the largest logit. 2e-2 relative is about 5 ulps at that scale.
    assert!(r < 2e-2, "bf16 logits differ from transformers' by {r} relative");
}
