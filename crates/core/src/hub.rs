//! Resolving a model argument: a local directory, or a Hugging Face hub id (`org/name`, optional
//! `@revision`) found in the standard local cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`), laid out as `models--org--name/{refs,snapshots}`. The Python
//! package downloads missing models with huggingface-hub (with progress bars) into that same cache.
//! With nothing cached the error says so and names the cache and `HF_HUB_OFFLINE`.

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

fn is_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
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

/// The snapshot directory of `repo` at `revision` in `cache`, if present with a `config.json`.
pub fn cached_snapshot(cache: &Path, repo: &str, revision: &str) -> Option<PathBuf> {
    let root = cache.join(format!("models--{}", repo.replace('/', "--")));
    let commit = std::fs::read_to_string(root.join("refs").join(revision))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    let snap = root.join("snapshots").join(commit);
    snap.join("config.json").is_file().then_some(snap)
}

/// A local directory as is, or a hub id from the local cache.
pub fn resolve_model(spec: &str) -> Result<PathBuf, HubError> {
    let p = Path::new(spec);
    if p.is_dir() {
        return Ok(p.to_path_buf());
    }
    let (repo, rev) = parse_repo_id(spec).ok_or_else(|| HubError::NotAModel(spec.to_string()))?;
    let cache = hub_cache_dir();
    cached_snapshot(&cache, &repo, &rev).ok_or_else(|| HubError::NotCached {
        repo: repo.clone(),
        cache: cache.display().to_string(),
        hint: if is_offline() {
            " and HF_HUB_OFFLINE is set".into()
        } else {
            format!("; download it first, e.g. `huggingface-cli download {repo}` or `python -c \"import rserve; rserve.LLM('{repo}')\"`")
        },
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
