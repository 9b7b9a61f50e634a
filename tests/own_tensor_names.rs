//! `--dump-grads` writes each gradient under the checkpoint's own tensor name, as transformers'
//! `named_parameters` has it: a Phi-3 checkpoint's fused `qkv_proj` and `gate_up_proj` (which the model holds
//! split, `autosp::models::fused`) are dumped fused. The run of a Phi-3 checkpoint and the run of a Llama
//! checkpoint holding the same weights split (the same function: no window, no bias) dump the same
//! gradients, the Phi-3 one's fused tensors being the Llama one's parts stacked, bit for bit. A checkpoint's
//! `optimizer.safetensors` is keyed by the same names (`<name>.exp_avg`, ...), and resumes bit for bit.

mod longctx_cli;

use std::path::Path;

use autosp_models::{save_model, write_tiny, LlamaModel, ModelType, SaveOptions, TinySpec};
use candle_core::{DType, Device, Tensor};
use longctx_cli::{ids_file, losses, run_ok, s, tensors};

/// The gradients `--dump-grads` writes after one step of `model` on the ids of `data` (P = `sp`).
fn dump(t: &Path, model: &Path, data: &Path, sp: &str) -> std::collections::HashMap<String, Tensor> {
    let g = t.join(format!("{}-{sp}.safetensors", model.file_name().unwrap().to_str().unwrap()));
    let ids = format!("ids:{}", s(data));
    let save = t.join(format!("save-{}-{sp}", model.file_name().unwrap().to_str().unwrap()));
    let args = ["--model", s(model), "--data", &ids, "--seq-len", "32", "--steps", "1", "--sp", sp];
    run_ok(t, &[&args[..], &["--dump-grads", s(&g), "--save", s(&save)]].concat());
    tensors(&g)
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn phi3_gradients_are_dumped_under_its_fused_names() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let (phi3_dir, llama_dir) = (t.join("phi3"), t.join("llama"));
    let phi3 = TinySpec { model_type: ModelType::Phi3, ..TinySpec::default() };
    write_tiny(&phi3_dir, &phi3, 11, DType::F32).unwrap();
    // The same weights as a Llama checkpoint (split names).
    let split = LlamaModel::load(s(&phi3_dir), DType::F32).unwrap().to_weights();
    save_model(&llama_dir, &TinySpec::default().config(), &split, &SaveOptions::default()).unwrap();
    let data = ids_file(t);

    let file = candle_core::safetensors::load(phi3_dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let llama = dump(t, &llama_dir, &data, "1");
    for sp in ["1", "2"] {
        let got = dump(t, &phi3_dir, &data, sp);
        // Exactly the file's names and shapes (untied: every tensor is a parameter).
        let mut names: Vec<_> = got.keys().cloned().collect();
        let mut want: Vec<_> = file.keys().cloned().collect();
        names.sort();
        want.sort();
        assert_eq!(names, want, "sp {sp}: the dump's names are the checkpoint's");
        for (n, g) in &got {
            assert_eq!(g.dims(), file[n].dims(), "sp {sp}: {n}");
        }
        assert!(got.contains_key("model.layers.1.self_attn.qkv_proj.weight"));
        assert!(!got.contains_key("model.layers.1.mlp.gate_proj.weight"));
        if sp != "1" {
            continue;
        }
        // The fused gradients are the Llama run's parts stacked (q, k, v; gate, up), bit for bit.
        for l in 0..2 {
            let p = format!("model.layers.{l}");
            for (fused, parts) in [
                ("self_attn.qkv_proj", &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"][..]),
                ("mlp.gate_up_proj", &["mlp.gate_proj", "mlp.up_proj"][..]),
            ] {
                let parts: Vec<Tensor> = parts.iter().map(|q| llama[&format!("{p}.{q}.weight")].clone()).collect();
                let stacked = Tensor::cat(&parts, 0).unwrap();
                let g = &got[&format!("{p}.{fused}.weight")];
                assert_eq!(values(g), values(&stacked), "{p}.{fused}");
                assert!(values(g).iter().any(|&v| v != 0.0), "{p}.{fused} trains");
            }
        }
        for (n, g) in got.iter().filter(|(n, _)| !n.contains("qkv_proj") && !n.contains("gate_up_proj")) {
            assert_eq!(values(g), values(&llama[n]), "{n}");
        }
    }
}

#[test]
fn a_phi3_checkpoint_keeps_its_optimizer_state_under_the_fused_names_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let model = t.join("phi3");
    write_tiny(&model, &TinySpec { model_type: ModelType::Phi3, ..TinySpec::default() }, 11, DType::F32).unwrap();
    let data = format!("ids:{}", s(&ids_file(t)));
    let common = ["--model", s(&model), "--data", &data, "--seq-len", "32", "--sp", "1", "--shard", "none"];
    let common = [&common[..], &["--steps", "3"]].concat();
    let (run, m_run, m_resumed) = (t.join("run"), t.join("run.jsonl"), t.join("resumed.jsonl"));
    run_ok(t, &[&common[..], &["--save", s(&run), "--save-every", "1", "--metrics", s(&m_run)]].concat());
    let step1 = run.join("step-1");
    let state = tensors(&step1.join("optimizer.safetensors"));
    let file = candle_core::safetensors::load(model.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<String> = state.keys().filter_map(|k| k.strip_suffix(".exp_avg_sq")).map(String::from).collect();
    let mut want: Vec<String> = file.keys().cloned().collect();
    names.sort();
    want.sort();
    assert_eq!(names, want, "the optimizer state's names are the checkpoint's");
    let qkv = "model.layers.0.self_attn.qkv_proj.weight";
    assert_eq!(state[&format!("{qkv}.exp_avg")].dims(), file[qkv].dims());
    run_ok(t, &[&common[..], &["--resume", s(&step1), "--metrics", s(&m_resumed)]].concat());
    let (all, resumed) = (losses(&m_run), losses(&m_resumed));
    assert_eq!(resumed.len(), 2, "{resumed:?}");
    assert_eq!(resumed[..], all[1..], "resumed from the fused state, the run goes on bit for bit");
}
