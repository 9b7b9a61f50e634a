//! Resolves a `--model`-style string to local files: a local directory, or a hub repo id
//! (`owner/name` or `owner/name@revision`) looked up in the HF cache first and downloaded through hf-hub
//! only when allowed. With `HF_HUB_OFFLINE=1`, or when the hub cannot be reached, only the cache is used,
//! and a miss names the missing files and the cache folder it looked in.

use crate::error::{Error, Result};
use crate::weights::{read_index, shard_names, WeightFiles, INDEX_FILE, SINGLE_FILE};
use std::path::{Path, PathBuf};

/// Where to look and whether the network may be used.
#[derive(Debug, Clone, Default)]
pub struct HubOptions {
    /// The hub cache root (the folder holding `models--owner--name`). `None`: `HF_HUB_CACHE`, else
    /// `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    pub cache_dir: Option<PathBuf>,
    /// Never use the network. `false` still honours `HF_HUB_OFFLINE=1`.
    pub offline: bool,
}

/// The files of a resolved model.
#[derive(Debug, Clone)]
pub struct ResolvedModel {
    /// `config.json`.
    pub config: PathBuf,
    /// The weight files (single or sharded).
    pub weights: WeightFiles,
    /// `tokenizer.json`, when the model has one.
    pub tokenizer: Option<PathBuf>,
}

/// A parsed model string.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSpec {
    /// A local directory.
    Local(PathBuf),
    /// A hub repo and revision (`main` when not given).
    Hub { repo: String, revision: String },
}

/// Parses `model`: an existing directory is local; `owner/name[@revision]` is a hub repo.
pub fn parse_model_spec(model: &str) -> Result<ModelSpec> {
    let p = Path::new(model);
    if p.is_dir() {
        return Ok(ModelSpec::Local(p.to_path_buf()));
    }
    let (repo, revision) = match model.split_once('@') {
        Some((r, rev)) => (r, rev),
        None => (model, "main"),
    };
    let parts: Vec<&str> = repo.split('/').collect();
    let valid = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if parts.len() == 2 && parts.iter().all(|s| valid(s)) && !revision.is_empty() {
        return Ok(ModelSpec::Hub { repo: repo.to_string(), revision: revision.to_string() });
    }
    Err(Error::NotFound {
        model: model.into(),
        missing: vec!["config.json".into()],
        looked_in: format!("{} (not a directory)", p.display()),
        hint: "; give a model directory or a hub id `owner/name[@revision]`".into(),
    })
}

/// The hub cache root from the options and the environment.
pub fn cache_root(opts: &HubOptions) -> PathBuf {
    if let Some(d) = &opts.cache_dir {
        return d.clone();
    }
    if let Ok(d) = std::env::var("HF_HUB_CACHE") {
        return PathBuf::from(d);
    }
    hf_hub::Cache::from_env().path().clone()
}

/// True when `HF_HUB_OFFLINE` is set to 1/true/yes/on.
pub fn offline_from_env() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
        .unwrap_or(false)
}

/// Resolves `model` (a directory or `owner/name[@revision]`) to its config, weight and tokenizer files.
pub fn resolve_model(model: &str, opts: &HubOptions) -> Result<ResolvedModel> {
    match parse_model_spec(model)? {
        ModelSpec::Local(dir) => resolve_local(&dir),
        ModelSpec::Hub { repo, revision } => {
            let offline = opts.offline || offline_from_env();
            HubRepo::new(model, &repo, &revision, cache_root(opts), offline).resolve()
        }
    }
}

fn resolve_local(dir: &Path) -> Result<ResolvedModel> {
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(Error::NotFound {
            model: dir.display().to_string(),
            missing: vec!["config.json".into()],
            looked_in: dir.display().to_string(),
            hint: String::new(),
        });
    }
    let weights = crate::weights::weight_files(dir)?;
    let tok = dir.join("tokenizer.json");
    Ok(ResolvedModel { config, weights, tokenizer: tok.is_file().then_some(tok) })
}

/// One hub repo at one revision: cache lookups, then downloads when online.
struct HubRepo {
    model: String,
    repo: String,
    revision: String,
    root: PathBuf,
    offline: bool,
    /// Why the hub was not used, once a download failed (then the rest is cache only).
    unreachable: Option<String>,
}

impl HubRepo {
    fn new(model: &str, repo: &str, revision: &str, root: PathBuf, offline: bool) -> Self {
        HubRepo { model: model.into(), repo: repo.into(), revision: revision.into(), root, offline, unreachable: None }
    }

    fn repo_dir(&self) -> PathBuf {
        self.root.join(format!("models--{}", self.repo.replace('/', "--")))
    }

    /// The snapshot folder of the revision: `refs/<revision>` names the commit; a full commit hash is
    /// its own snapshot.
    fn snapshot_dir(&self) -> PathBuf {
        let dir = self.repo_dir();
        let commit = std::fs::read_to_string(dir.join("refs").join(&self.revision))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| self.revision.clone());
        dir.join("snapshots").join(commit)
    }

    fn cached(&self, file: &str) -> Option<PathBuf> {
        let p = self.snapshot_dir().join(file);
        p.is_file().then_some(p)
    }

    /// Cache, then (when allowed and reachable) download. `Ok(None)`: not available.
    fn get(&mut self, file: &str) -> Result<Option<PathBuf>> {
        if let Some(p) = self.cached(file) {
            return Ok(Some(p));
        }
        if self.offline || self.unreachable.is_some() {
            return Ok(None);
        }
        let api = hf_hub::api::sync::ApiBuilder::from_cache(hf_hub::Cache::new(self.root.clone()))
            .with_progress(false)
            .build()
            .map_err(|e| Error::Hub { model: self.model.clone(), file: file.into(), message: e.to_string() })?;
        let repo = hf_hub::Repo::with_revision(self.repo.clone(), hf_hub::RepoType::Model, self.revision.clone());
        match api.repo(repo).get(file) {
            Ok(p) => Ok(Some(p)),
            Err(hf_hub::api::sync::ApiError::RequestError(e)) => match *e {
                // 404: the repo has no such file (normal for the optional / alternative files).
                ureq::Error::Status(404, _) => Ok(None),
                other => {
                    self.unreachable = Some(other.to_string());
                    Ok(None)
                }
            },
            Err(e) => {
                self.unreachable = Some(e.to_string());
                Ok(None)
            }
        }
    }

    fn miss(&self, missing: Vec<String>) -> Error {
        let hint = if self.offline {
            "; offline (HF_HUB_OFFLINE or HubOptions::offline), so only the cache was used: \
             download the files while online, or unset HF_HUB_OFFLINE"
                .to_string()
        } else if let Some(why) = &self.unreachable {
            format!("; the hub could not be reached ({why}), so only the cache was used")
        } else {
            "; the repo or revision does not have them".to_string()
        };
        Error::NotFound {
            model: self.model.clone(),
            missing,
            looked_in: self.snapshot_dir().display().to_string(),
            hint,
        }
    }

    fn resolve(mut self) -> Result<ResolvedModel> {
        let config = self.get("config.json")?;
        let weights = match self.get(INDEX_FILE)? {
            Some(index) => {
                let mut shards = Vec::new();
                let mut missing = Vec::new();
                for name in shard_names(&read_index(&index)?) {
                    match self.get(&name)? {
                        Some(p) => shards.push(p),
                        None => missing.push(name),
                    }
                }
                if !missing.is_empty() {
                    return Err(self.miss(missing));
                }
                Some(WeightFiles::Sharded { index, shards })
            }
            None => self.get(SINGLE_FILE)?.map(WeightFiles::Single),
        };
        let mut missing = Vec::new();
        if config.is_none() {
            missing.push("config.json".to_string());
        }
        if weights.is_none() {
            missing.push(format!("{SINGLE_FILE} or {INDEX_FILE}"));
        }
        match (config, weights) {
            (Some(config), Some(weights)) => {
                let tokenizer = self.get("tokenizer.json")?;
                // Its config (the chat template) lands beside it in the cache, where the template is looked for.
                if tokenizer.is_some() {
                    self.get("tokenizer_config.json")?;
                }
                Ok(ResolvedModel { config, weights, tokenizer })
            }
            _ => Err(self.miss(missing)),
        }
    }
}
