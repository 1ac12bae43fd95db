//! Resolving a model argument: a local directory, or a Hugging Face hub id (`org/name`, optional
//! `@revision`) found in the standard local cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`), laid out as `models--org--name/{refs,snapshots}`. With the
//! `download` feature a model missing from the cache is fetched into that same cache (progress bars
//! on stderr, `HF_ENDPOINT` and `HF_TOKEN` honoured) unless `HF_HUB_OFFLINE` is set; offline with
//! nothing cached, the error says so and names the cache.

use std::path::{Path, PathBuf};

/// Why a model argument could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HubError {
    #[error("`{0}` is neither a local directory nor a hub id of the form org/name")]
    NotAModel(String),
    #[error("`{repo}` is not in the local Hugging Face cache ({cache}){hint}")]
    NotCached {
        repo: String,
        cache: String,
        hint: String,
    },
    #[error("downloading `{repo}` from {endpoint} failed: {reason}")]
    Download {
        repo: String,
        endpoint: String,
        reason: String,
    },
}

/// The hub cache directory the environment selects.
pub fn hub_cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        return PathBuf::from(p).join("hub");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("huggingface").join("hub")
}

fn env_flag(name: &str) -> bool {
    std::env::var(name)
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// Where models come from: the cache, the hub's address, offline mode and the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubSettings {
    pub cache: PathBuf,
    pub endpoint: String,
    pub offline: bool,
    pub token: Option<String>,
}

impl HubSettings {
    /// `HF_HUB_CACHE`/`HF_HOME`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`, `HF_TOKEN`, as huggingface-hub reads them.
    pub fn from_env() -> Self {
        Self {
            cache: hub_cache_dir(),
            endpoint: std::env::var("HF_ENDPOINT")
                .ok()
                .map(|e| e.trim_end_matches('/').to_string())
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "https://huggingface.co".into()),
            offline: env_flag("HF_HUB_OFFLINE"),
            token: std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()),
        }
    }
}

/// Splits `org/name[@rev]` if it has that shape.
pub fn parse_repo_id(spec: &str) -> Option<(String, String)> {
    let (repo, rev) = match spec.split_once('@') {
        Some((r, v)) if !v.is_empty() => (r, v.to_string()),
        _ => (spec, "main".to_string()),
    };
    let mut parts = repo.split('/');
    let (org, name) = (parts.next()?, parts.next()?);
    let ok = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    if parts.next().is_some() || !ok(org) || !ok(name) {
        return None;
    }
    Some((format!("{org}/{name}"), rev))
}

/// The snapshot directory of `repo` at `revision` in `cache`, if present with a `config.json`
/// (a model) or an `adapter_config.json` (a LoRA adapter).
pub fn cached_snapshot(cache: &Path, repo: &str, revision: &str) -> Option<PathBuf> {
    let root = cache.join(format!("models--{}", repo.replace('/', "--")));
    let commit = std::fs::read_to_string(root.join("refs").join(revision))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    let snap = root.join("snapshots").join(commit);
    (snap.join("config.json").is_file() || snap.join("adapter_config.json").is_file())
        .then_some(snap)
}

/// A local directory as is (a model or a LoRA adapter), or a hub id from the local cache, downloaded first when missing (with
/// the `download` feature and not offline). Settings come from the environment.
pub fn resolve_model(spec: &str) -> Result<PathBuf, HubError> {
    resolve_model_with(spec, &HubSettings::from_env())
}

/// [`resolve_model`] with explicit settings.
pub fn resolve_model_with(spec: &str, hub: &HubSettings) -> Result<PathBuf, HubError> {
    let p = Path::new(spec);
    if p.is_dir() || crate::gguf::is_gguf(p) {
        return Ok(p.to_path_buf());
    }
    let (repo, rev) = parse_repo_id(spec).ok_or_else(|| HubError::NotAModel(spec.to_string()))?;
    if let Some(snap) = cached_snapshot(&hub.cache, &repo, &rev) {
        return Ok(snap);
    }
    if hub.offline {
        return Err(HubError::NotCached {
            repo,
            cache: hub.cache.display().to_string(),
            hint: " and HF_HUB_OFFLINE is set".into(),
        });
    }
    download_snapshot(hub, &repo, &rev)
}

/// Whether rserve needs `file` of a model repository to serve it (weights as safetensors, configs,
/// tokenizer, chat template); other formats and documentation are not fetched.
pub fn is_needed_file(file: &str) -> bool {
    if file.contains('/') {
        return false;
    }
    file.ends_with(".safetensors")
        || file.ends_with(".safetensors.index.json")
        || matches!(
            file,
            "config.json"
                | "adapter_config.json"
                | "generation_config.json"
                | "tokenizer.json"
                | "tokenizer_config.json"
                | "special_tokens_map.json"
                | "chat_template.jinja"
                | "chat_template.json"
                | "preprocessor_config.json"
        )
}

/// Fetches the files rserve needs of `repo` at `rev` into the cache (resuming partial downloads,
/// skipping files already there) and returns the snapshot directory.
#[cfg(feature = "download")]
pub fn download_snapshot(hub: &HubSettings, repo: &str, rev: &str) -> Result<PathBuf, HubError> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Cache, Repo, RepoType};

    let endpoint = hub.endpoint.clone();
    let cache = hub.cache.as_path();
    let fail = |reason: String| HubError::Download {
        repo: repo.to_string(),
        endpoint: endpoint.clone(),
        reason,
    };
    let mut builder = ApiBuilder::from_cache(Cache::new(cache.to_path_buf()))
        .with_endpoint(endpoint.clone())
        .with_progress(true)
        .with_retries(2);
    if hub.token.is_some() {
        builder = builder.with_token(hub.token.clone());
    }
    let api = builder.build().map_err(|e| fail(e.to_string()))?;
    let remote = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        rev.to_string(),
    ));
    let info = remote.info().map_err(|e| fail(describe(&e)))?;
    let files: Vec<&str> = info
        .siblings
        .iter()
        .map(|s| s.rfilename.as_str())
        .filter(|f| is_needed_file(f))
        .collect();
    if !files.contains(&"config.json") {
        return Err(fail("the repository has no config.json".into()));
    }
    if !files.iter().any(|f| f.ends_with(".safetensors")) {
        return Err(fail(
            "the repository has no .safetensors weights (other formats are not supported)".into(),
        ));
    }
    tracing::info!(
        repo,
        revision = rev,
        files = files.len(),
        "downloading from {endpoint}"
    );
    for file in &files {
        remote
            .get(file)
            .map_err(|e| fail(format!("{file}: {}", describe(&e))))?;
    }
    cached_snapshot(cache, repo, rev)
        .ok_or_else(|| fail("the downloaded snapshot has no config.json".into()))
}

#[cfg(feature = "download")]
fn describe(e: &hf_hub::api::sync::ApiError) -> String {
    let msg = e.to_string();
    if msg.contains("status code 401") || msg.contains("status code 403") {
        format!("{msg} (a gated or private repository needs HF_TOKEN)")
    } else if msg.contains("status code 404") {
        format!("{msg} (no such repository or revision)")
    } else {
        msg
    }
}

#[cfg(not(feature = "download"))]
pub fn download_snapshot(hub: &HubSettings, repo: &str, _rev: &str) -> Result<PathBuf, HubError> {
    Err(HubError::NotCached {
        repo: repo.to_string(),
        cache: hub.cache.display().to_string(),
        hint: format!("; download it first, e.g. `huggingface-cli download {repo}`"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repo_ids() {
        assert_eq!(
            parse_repo_id("Qwen/Qwen2.5-0.5B"),
            Some(("Qwen/Qwen2.5-0.5B".into(), "main".into()))
        );
        assert_eq!(parse_repo_id("a/b@v1"), Some(("a/b".into(), "v1".into())));
        assert_eq!(parse_repo_id("a/b/c"), None);
        assert_eq!(parse_repo_id("../x"), None);
        assert_eq!(parse_repo_id("plain"), None);
    }

    #[test]
    fn finds_snapshots_through_refs() {
        let dir = std::env::temp_dir().join(format!("rserve-hub-test-{}", std::process::id()));
        let root = dir.join("models--org--tiny");
        let snap = root.join("snapshots").join("abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(root.join("refs")).unwrap();
        std::fs::write(root.join("refs").join("main"), "abc123\n").unwrap();
        assert_eq!(
            cached_snapshot(&dir, "org/tiny", "main"),
            None,
            "no config.json yet"
        );
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        assert_eq!(
            cached_snapshot(&dir, "org/tiny", "main"),
            Some(snap.clone())
        );
        assert_eq!(cached_snapshot(&dir, "org/tiny", "abc123"), Some(snap));
        assert_eq!(cached_snapshot(&dir, "org/other", "main"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
