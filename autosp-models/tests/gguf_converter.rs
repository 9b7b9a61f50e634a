//! GGUF files as llama.cpp's converter writes them, for every family autosp imports: a tiny HF checkpoint
//! (config.json + model.safetensors) is written, then converted by `tests/hf_to_gguf.py` with the `gguf`
//! Python package (`python3 -m pip install gguf==0.19.0`), which takes every tensor name from llama.cpp's own
//! tensor map (`gguf.get_tensor_name_map`) and changes the values as convert_hf_to_gguf.py does (llama's Q/K
//! permutation, Gemma's norms plus one, llama3 / longrope scalings as tensors). The import must give back the
//! HF weights, the RoPE scaling and the HF model's loss.

use autosp_core::{CheckpointPolicy, Tape};
use autosp_models::{
    import_gguf, random_weights, write_tiny, LlamaConfig, LlamaModel, LongRope, ModelType, RopeScaling, TinySpec,
};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A llama3 scaling whose blend covers two of a 16-wide head's 8 pairs at base 10^4 (wavelengths 628 and 1987).
const LLAMA3: RopeScaling = RopeScaling::Llama3 {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 2048,
};

/// A longrope scaling for a 16-wide head, pretrained on 64 positions (the tiny models have 256).
fn longrope() -> RopeScaling {
    RopeScaling::LongRope(LongRope {
        short_factor: vec![1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0, 2.5],
        long_factor: vec![1.0, 1.2, 1.5, 2.0, 2.8, 3.5, 4.0, 4.0],
        factor: None,
        original_max_position_embeddings: 64,
        attention_factor: None,
    })
}

/// Converts the HF checkpoint in `dir` to `out` with `tests/hf_to_gguf.py` (matrices in `outtype`).
fn convert(dir: &Path, out: &Path, outtype: &str) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/hf_to_gguf.py");
    let run = Command::new("python3")
        .arg(&script)
        .args([dir.as_os_str(), out.as_os_str()])
        .args(["--outtype", outtype])
        .output()
        .unwrap_or_else(|e| panic!("python3 could not be run ({e}): install Python 3 and `pip install gguf==0.19.0`"));
    assert!(
        run.status.success(),
        "{} failed (is the `gguf` package installed? `python3 -m pip install gguf==0.19.0`):\n{}",
        script.display(),
        String::from_utf8_lossy(&run.stderr)
    );
}

fn rel_rms(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b).unwrap().sqr().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
    let n = b.sqr().unwrap().mean_all().unwrap().to_scalar::<f32>().unwrap();
    (d / n).sqrt()
}

/// The model's mean next-token loss on a fixed 8-token sequence.
fn loss(config: &LlamaConfig, weights: HashMap<String, Tensor>) -> f32 {
    let m = LlamaModel::from_weights(config, weights).unwrap();
    let ids = Tensor::new(&[[3u32, 17, 5, 99, 42, 7, 64, 1]], &Device::Cpu).unwrap();
    let targets = Tensor::new(&[17i64, 5, 99, 42, 7, 64, 1, -100], &Device::Cpu).unwrap();
    let tape = Tape::new(CheckpointPolicy::None);
    let (l, _) = m.loss(&tape, &ids, &(0..8).collect::<Vec<_>>(), &targets).unwrap();
    l.tensor().to_scalar::<f32>().unwrap()
}

/// Writes `spec` as an HF checkpoint and as the converter's GGUF (`outtype`); returns the HF config and
/// weights and the imported model.
fn round_trip(
    spec: &TinySpec,
    outtype: &str,
    tmp: &Path,
) -> (LlamaConfig, HashMap<String, Tensor>, autosp_models::GgufModel) {
    let rope = spec.rope_scaling.as_ref().map_or("none", RopeScaling::rope_type);
    let name = format!("{}-{rope}-{outtype}", spec.model_type.as_str());
    let dir = tmp.join(&name);
    let config = write_tiny(&dir, spec, 29, DType::F32).unwrap();
    let w = random_weights(&spec.config(), 29, DType::F32, &Device::Cpu).unwrap();
    let gguf = tmp.join(format!("{name}.gguf"));
    convert(&dir, &gguf, outtype);
    let m = import_gguf(&gguf, DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{name}: the converter's GGUF does not import: {e}"));
    (config, w, m)
}

/// Every family's converter-written f32 GGUF imports as the HF weights it was converted from (Gemma 3's
/// norms back from `1 + w` up to f32 rounding), with the HF config's attention layout, and the same loss.
#[test]
fn converter_written_gguf_imports_as_the_hf_model() {
    let tmp = tempfile::tempdir().unwrap();
    let specs = [
        // Biases on, so llama's permuted q/k biases are checked too.
        TinySpec { model_type: ModelType::Llama, bias: true, ..TinySpec::default() },
        // Mistral is converted as llama (permuted) and imports as a llama model.
        TinySpec { model_type: ModelType::Mistral, ..TinySpec::default() },
        TinySpec { model_type: ModelType::Qwen2, tied: true, ..TinySpec::default() },
        TinySpec { model_type: ModelType::Qwen3, ..TinySpec::default() },
        TinySpec { model_type: ModelType::Phi3, window: Some(8), ..TinySpec::default() },
        // Llama 3.1's scaling, which the converter stores as the tensor `rope_freqs` (two blended pairs of 8).
        TinySpec { model_type: ModelType::Llama, rope_scaling: Some(LLAMA3), ..TinySpec::default() },
        // Phi-3 128K's longrope, stored as `rope_factors_short` / `rope_factors_long`.
        TinySpec { model_type: ModelType::Phi3, rope_scaling: Some(longrope()), ..TinySpec::default() },
        // Gemma 3 with 6 layers and a window: five sliding layers, then a global one (llama.cpp's pattern).
        TinySpec { model_type: ModelType::Gemma3, tied: true, window: Some(8), layers: 6, ..TinySpec::default() },
    ];
    for spec in specs {
        let (config, w, m) = round_trip(&spec, "f32", tmp.path());
        let t = spec.model_type;
        let want_type = if t == ModelType::Mistral { ModelType::Llama } else { t };
        assert_eq!(m.config.model_type, want_type);
        assert_eq!(m.config.num_hidden_layers, config.num_hidden_layers, "{t:?}");
        assert_eq!((m.config.num_attention_heads, m.config.num_key_value_heads), (4, 2), "{t:?}");
        assert_eq!(m.config.head_dim, config.head_dim, "{t:?}");
        assert_eq!(m.config.attention_bias, config.attention_bias, "{t:?}");
        assert_eq!(m.config.tie_word_embeddings, config.tie_word_embeddings, "{t:?}");
        if matches!(t, ModelType::Phi3 | ModelType::Gemma3) {
            assert_eq!(m.config.sliding_window, config.sliding_window, "{t:?}");
            assert_eq!(m.config.layer_types, config.layer_types, "{t:?}");
        }
        assert_eq!(m.config.query_pre_attn_scalar, config.query_pre_attn_scalar, "{t:?}");
        match (&m.config.rope_scaling, &config.rope_scaling) {
            (Some(RopeScaling::LongRope(got)), Some(RopeScaling::LongRope(want))) => {
                // Stored in f32, as the converter stores them.
                let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
                assert_eq!(f32s(&got.short_factor), f32s(&want.short_factor));
                assert_eq!(f32s(&got.long_factor), f32s(&want.long_factor));
                assert_eq!(got.original_max_position_embeddings, want.original_max_position_embeddings);
            }
            (got, want) => assert_eq!(got, want, "{t:?}"),
        }
        assert_eq!(m.config.rope_local_theta, config.rope_local_theta, "{t:?}");
        assert_eq!(m.weights.len(), w.len(), "{t:?}");
        for (name, want) in &w {
            let got = m.weights.get(name).unwrap_or_else(|| panic!("{t:?}: {name} not imported"));
            let bound = if t == ModelType::Gemma3 && name.ends_with("norm.weight") { 1e-6 } else { 0.0 };
            let e = rel_rms(got, want);
            assert!(e <= bound, "{t:?} {name}: relative RMS error {e} > {bound}");
        }
        let (a, b) = (loss(&m.config, m.weights), loss(&config, w));
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{t:?}: imported loss {a}, HF loss {b}");
    }
}

/// A Gemma 3 file quantised by the `gguf` package's own Q8_0 (not candle's): candle dequantises it to
/// within Q8_0's error of the HF weights, and the loss stays close.
#[test]
fn converter_q8_0_gemma3_imports() {
    let tmp = tempfile::tempdir().unwrap();
    let spec =
        TinySpec { model_type: ModelType::Gemma3, tied: true, window: Some(8), layers: 6, ..TinySpec::default() };
    let (config, w, m) = round_trip(&spec, "q8_0", tmp.path());
    for (name, want) in &w {
        let e = rel_rms(&m.weights[name], want);
        let bound = if name.ends_with("norm.weight") { 1e-6 } else { 0.01 };
        assert!(e <= bound, "{name}: relative RMS error {e} > {bound}");
    }
    let (a, b) = (loss(&m.config, m.weights), loss(&config, w));
    assert!((a - b).abs() <= 0.01 * b.abs(), "imported loss {a}, HF loss {b}");
}
