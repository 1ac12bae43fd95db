//! Images in chat messages: `image_url` content parts read from `data:` URIs, fetched over
//! `http(s)://` (a size and a time limit, optionally only from `--allowed-media-domains`) or
//! read from `file://` paths under `--allowed-local-media-path`; decoded and preprocessed by
//! the model's processor and laid into the tokenized prompt. Every failure is a 400 naming
//! `messages`.

use super::error::ApiError;
use super::types::ChatMessage;
use base64::Engine as _;
use rserve_core::multimodal::{ImageInput, MmPrompt, Processor};
use rserve_core::EngineInfo;
use serde_json::Value;
use std::borrow::Cow;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Where images may come from and how many.
#[derive(Debug, Clone)]
pub struct MediaConfig {
    /// Images one prompt may hold (`--limit-mm-per-prompt image=N`).
    pub max_images: usize,
    /// Hosts `http(s)` images may be fetched from (`None`: any).
    pub allowed_domains: Option<Vec<String>>,
    /// The directory `file://` images may be read from (`None`: no file URLs).
    pub allowed_local_path: Option<PathBuf>,
    /// Time allowed to fetch one image.
    pub fetch_timeout: Duration,
    /// Largest encoded image, in bytes.
    pub max_bytes: usize,
}

impl Default for MediaConfig {
    fn default() -> Self {
        Self {
            max_images: 8,
            allowed_domains: None,
            allowed_local_path: None,
            fetch_timeout: Duration::from_secs(5),
            max_bytes: 20 << 20,
        }
    }
}

/// Parses `--limit-mm-per-prompt`: `image=N` or vLLM's JSON form `{"image": N}`.
pub fn parse_limit(s: &str) -> Result<usize, String> {
    let bad = || format!("`{s}`: expected image=N or {{\"image\": N}}");
    if let Ok(v) = serde_json::from_str::<Value>(s) {
        let map = v.as_object().ok_or_else(bad)?;
        let mut n = None;
        for (k, v) in map {
            match (k.as_str(), v.as_u64()) {
                ("image", Some(x)) => n = Some(x as usize),
                // other modalities are not served; their limits do not matter
                (_, Some(_)) => {}
                _ => return Err(bad()),
            }
        }
        return n.ok_or_else(bad);
    }
    let mut n = None;
    for part in s.split(',') {
        let (k, v) = part.split_once('=').ok_or_else(bad)?;
        let v: usize = v.trim().parse().map_err(|_| bad())?;
        if k.trim() == "image" {
            n = Some(v);
        }
    }
    n.ok_or_else(bad)
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg).with_param("messages")
}

/// The URLs of every `image_url` part, in order.
pub fn image_urls(messages: &[ChatMessage]) -> Result<Vec<&str>, ApiError> {
    let mut out = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let Some(Value::Array(parts)) = &m.content else {
            continue;
        };
        for p in parts {
            if p.get("type").and_then(Value::as_str) != Some("image_url") {
                continue;
            }
            let url = p.get("image_url").and_then(|u| match u {
                Value::String(s) => Some(s.as_str()),
                _ => u.get("url").and_then(Value::as_str),
            });
            match url {
                Some(u) => out.push(u),
                None => {
                    return Err(bad(format!(
                        "messages[{i}]: an image_url part needs `image_url.url`"
                    )))
                }
            }
        }
    }
    Ok(out)
}

/// The bytes of the image at `url`.
pub fn fetch(url: &str, cfg: &MediaConfig) -> Result<Vec<u8>, ApiError> {
    if let Some(rest) = url.strip_prefix("data:") {
        return data_uri(rest, cfg);
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        return http(url, cfg);
    }
    if let Some(path) = url.strip_prefix("file://") {
        return local(Path::new(path), cfg);
    }
    Err(bad(format!(
        "unsupported image URL `{}`: use a data: URI, http(s):// or file://",
        truncate(url)
    )))
}

fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}

fn data_uri(rest: &str, cfg: &MediaConfig) -> Result<Vec<u8>, ApiError> {
    let (head, payload) = rest
        .split_once(',')
        .ok_or_else(|| bad("a data: URI needs a comma before its payload"))?;
    let mut meta = head.split(';');
    let mime = meta.next().unwrap_or_default();
    if !mime.is_empty() && !mime.starts_with("image/") {
        return Err(bad(format!("a data: URI of type `{mime}` is not an image")));
    }
    if !meta.any(|m| m == "base64") {
        return Err(bad("an image data: URI must be base64-encoded (;base64,)"));
    }
    if payload.len() / 4 * 3 > cfg.max_bytes {
        return Err(too_large(cfg));
    }
    // line breaks inside the payload are allowed (MIME-style base64); most payloads have none
    let payload = payload.as_bytes();
    let compact: Cow<[u8]> = if payload.iter().any(u8::is_ascii_whitespace) {
        Cow::Owned(
            payload
                .iter()
                .copied()
                .filter(|c| !c.is_ascii_whitespace())
                .collect(),
        )
    } else {
        Cow::Borrowed(payload)
    };
    base64::engine::general_purpose::STANDARD
        .decode(compact)
        .map_err(|e| bad(format!("invalid base64 in an image data: URI: {e}")))
}

fn too_large(cfg: &MediaConfig) -> ApiError {
    bad(format!(
        "the image is larger than the limit of {} bytes",
        cfg.max_bytes
    ))
}

fn http(url: &str, cfg: &MediaConfig) -> Result<Vec<u8>, ApiError> {
    // the host checked is the one the client connects to: the URL is parsed once, by the parser
    // the client uses (WHATWG rules: a backslash ends the authority, `user@` is dropped, ...)
    let parsed = url::Url::parse(url)
        .map_err(|e| bad(format!("invalid image URL `{}`: {e}", truncate(url))))?;
    let host = parsed.host_str().unwrap_or_default().to_ascii_lowercase();
    if let Some(allowed) = &cfg.allowed_domains {
        if !allowed.iter().any(|d| d.eq_ignore_ascii_case(&host)) {
            return Err(bad(format!(
                "images may not be fetched from `{host}` (--allowed-media-domains)"
            )));
        }
    }
    let agent = ureq::AgentBuilder::new()
        .timeout(cfg.fetch_timeout)
        .redirects(if cfg.allowed_domains.is_some() { 0 } else { 5 })
        .build();
    let resp = agent
        .request_url("GET", &parsed)
        .call()
        .map_err(|e| match e {
            ureq::Error::Status(code, _) => bad(format!("fetching the image failed: HTTP {code}")),
            ureq::Error::Transport(t) => bad(format!("fetching the image failed: {t}")),
        })?;
    let mut body = Vec::new();
    resp.into_reader()
        .take(cfg.max_bytes as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| bad(format!("fetching the image failed: {e}")))?;
    if body.len() > cfg.max_bytes {
        return Err(too_large(cfg));
    }
    Ok(body)
}

fn local(path: &Path, cfg: &MediaConfig) -> Result<Vec<u8>, ApiError> {
    let Some(root) = &cfg.allowed_local_path else {
        return Err(bad("file:// image URLs need --allowed-local-media-path"));
    };
    let denied = || bad("the image path is not under --allowed-local-media-path");
    let root = root.canonicalize().map_err(|_| denied())?;
    let real = path.canonicalize().map_err(|_| denied())?;
    if !real.starts_with(&root) || !real.is_file() {
        return Err(denied());
    }
    let len = std::fs::metadata(&real)
        .map(|m| m.len())
        .unwrap_or(u64::MAX);
    if len > cfg.max_bytes as u64 {
        return Err(too_large(cfg));
    }
    std::fs::read(&real).map_err(|e| bad(format!("reading the image failed: {e}")))
}

/// Fetches, decodes and preprocesses every image of `messages` for the model's processor
/// (`None` when the model takes no images, which is then a 400 if any is given).
pub fn load_images(
    messages: &[ChatMessage],
    processor: Option<&Processor>,
    cfg: &MediaConfig,
) -> Result<Vec<ImageInput>, ApiError> {
    let urls = image_urls(messages)?;
    if urls.is_empty() {
        return Ok(Vec::new());
    }
    let Some(proc) = processor else {
        return Err(bad(
            "this model does not take images (content parts of type `image_url`)",
        ));
    };
    if urls.len() > cfg.max_images {
        return Err(bad(format!(
            "At most {} image(s) may be provided in one prompt (--limit-mm-per-prompt); {} were given",
            cfg.max_images,
            urls.len()
        )));
    }
    urls.iter()
        .map(|u| {
            let bytes = fetch(u, cfg)?;
            proc.decode(&bytes)
                .map_err(|e| bad(format!("invalid image: {e}")))
        })
        .collect()
}

/// The prompt of a chat request with its images: the template rendered and tokenized, each
/// image fetched, decoded, preprocessed and laid in. Blocking: run it off the async workers.
pub fn chat_inputs(
    info: &EngineInfo,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    extra: Option<&serde_json::Map<String, Value>>,
    tools: Option<&[Value]>,
    cfg: &MediaConfig,
) -> Result<(Vec<u32>, Option<Arc<MmPrompt>>), ApiError> {
    let (_, ids) = super::params::chat_prompt(info, messages, add_generation_prompt, extra, tools)?;
    let images = load_images(messages, info.processor.as_deref(), cfg)?;
    expand(info, ids, images)
}

/// Lays `images` into the tokenized prompt `ids` (each image's placeholder expanded).
pub fn expand(
    info: &EngineInfo,
    ids: Vec<u32>,
    images: Vec<ImageInput>,
) -> Result<(Vec<u32>, Option<Arc<MmPrompt>>), ApiError> {
    match (&info.processor, images.is_empty()) {
        (_, true) => Ok((ids, None)),
        (None, false) => Err(bad("this model does not take images")),
        (Some(p), false) => {
            let (ids, mm) = p.expand(&ids, images).map_err(|e| bad(e.to_string()))?;
            Ok((ids, Some(Arc::new(mm))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_in_both_forms() {
        assert_eq!(parse_limit("image=3"), Ok(3));
        assert_eq!(parse_limit("image=2,video=0"), Ok(2));
        assert_eq!(parse_limit(r#"{"image": 5, "video": 0}"#), Ok(5));
        assert!(parse_limit("image").is_err());
        assert!(parse_limit("video=1").is_err());
        assert!(parse_limit(r#"{"image": "x"}"#).is_err());
    }

    #[test]
    fn data_uris_decode_and_bad_ones_are_refused() {
        let cfg = MediaConfig::default();
        assert_eq!(
            fetch("data:image/png;base64,AAEC", &cfg).ok(),
            Some(vec![0, 1, 2])
        );
        // line breaks inside the payload are skipped
        assert_eq!(
            fetch("data:image/png;base64,AA\r\nEC\n", &cfg).ok(),
            Some(vec![0, 1, 2])
        );
        for url in [
            "data:image/png;base64,@@@",
            "data:text/plain;base64,AAEC",
            "data:image/png,AAEC",
            "data:image/png;base64",
            "ftp://x/y.png",
            "file:///etc/passwd",
        ] {
            let e = fetch(url, &cfg).expect_err(url);
            assert_eq!(e.status.as_u16(), 400, "{url}");
        }
        let tiny = MediaConfig {
            max_bytes: 2,
            ..MediaConfig::default()
        };
        assert!(fetch("data:image/png;base64,AAECAwQF", &tiny).is_err());
    }

    #[test]
    fn local_files_only_under_the_allowed_directory() {
        let dir = std::env::temp_dir().join(format!("rserve-media-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let f = dir.join("a.png");
        std::fs::write(&f, [1u8, 2, 3]).expect("file");
        let cfg = MediaConfig {
            allowed_local_path: Some(dir.clone()),
            ..MediaConfig::default()
        };
        assert_eq!(
            fetch(&format!("file://{}", f.display()), &cfg).ok(),
            Some(vec![1, 2, 3])
        );
        let outside = format!("file://{}/../{}", dir.display(), "etc");
        assert!(fetch(&outside, &cfg).is_err());
        assert!(fetch("file:///etc/hostname", &cfg).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn http_hosts_outside_the_allowed_domains_are_refused_before_fetching() {
        let cfg = MediaConfig {
            allowed_domains: Some(vec!["images.example.com".into()]),
            ..MediaConfig::default()
        };
        let e = fetch("https://user@evil.example.org:443/a.png", &cfg).expect_err("refused");
        assert!(e.message.contains("evil.example.org"), "{}", e.message);
        // a backslash ends the authority for the client's URL parser: the host is evil.com,
        // whatever a split on `@` and `/` would say
        for url in [
            "https://evil.com\\@images.example.com/a.png",
            "https://evil.com\\.images.example.com/a.png",
            "https://images.example.com.evil.com/a.png",
            "https://evil.com#@images.example.com/a.png",
            "https://evil.com?@images.example.com/a.png",
        ] {
            let e = fetch(url, &cfg).expect_err(url);
            assert!(
                e.message.contains("--allowed-media-domains"),
                "{url}: {}",
                e.message
            );
        }
        let e = fetch("https://[not a host/a.png", &cfg).expect_err("unparsable");
        assert!(e.message.contains("invalid image URL"), "{}", e.message);
    }

    /// A seeded fuzz of what a client controls on the image path before any pixel: URLs made of
    /// scheme pieces, data: headers, base64 and junk, and content parts of random shapes. Every
    /// one is an image's bytes or a 400; none panics, and no http(s) URL is fetched (the allowed
    /// domain is one no URL here names).
    #[test]
    fn fuzzed_urls_and_content_parts_are_bytes_or_400s() {
        let cfg = MediaConfig {
            allowed_domains: Some(vec!["allowed.invalid".into()]),
            max_bytes: 64,
            ..MediaConfig::default()
        };
        let pieces = [
            "data:",
            "image/png",
            ";base64",
            ",",
            "AAEC",
            "====",
            "\\",
            "@",
            "http://",
            "https://",
            "file://",
            "/",
            "%00",
            "\u{1F600}",
            ":",
            ";",
            "evil.com",
            "[::1]",
            "#",
            "?",
            "\r\n",
            "text/plain",
            "//",
            "..",
            "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygp",
        ];
        let mut s = 0x853c49e6748fea9bu64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for _ in 0..5000 {
            let n = 1 + next() % 8;
            let url: String = (0..n)
                .map(|_| pieces[(next() % pieces.len() as u64) as usize])
                .collect();
            match fetch(&url, &cfg) {
                Ok(bytes) => assert!(bytes.len() <= 64, "{url}"),
                Err(e) => assert_eq!(e.status.as_u16(), 400, "{url}"),
            }
        }
        let parts = [
            serde_json::json!({"type": "image_url"}),
            serde_json::json!({"type": "image_url", "image_url": 3}),
            serde_json::json!({"type": "image_url", "image_url": {"url": null}}),
            serde_json::json!({"type": "image_url", "image_url": "data:image/png;base64,AAEC"}),
            serde_json::json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAEC"}}),
            serde_json::json!({"type": 7}),
            serde_json::json!("text"),
            serde_json::json!(null),
        ];
        for _ in 0..500 {
            let content: Vec<Value> = (0..next() % 5)
                .map(|_| parts[(next() % parts.len() as u64) as usize].clone())
                .collect();
            let msg: ChatMessage = serde_json::from_value(serde_json::json!({
                "role": "user",
                "content": content,
            }))
            .expect("a message");
            match image_urls(std::slice::from_ref(&msg)) {
                Ok(urls) => {
                    for u in urls {
                        match fetch(u, &cfg) {
                            Ok(bytes) => assert!(bytes.len() <= 64, "{u}"),
                            Err(e) => assert_eq!(e.status.as_u16(), 400, "{u}"),
                        }
                    }
                }
                Err(e) => assert_eq!(e.status.as_u16(), 400),
            }
        }
    }
}
