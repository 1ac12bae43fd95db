//! Downloads from a hub: a local stand-in for the Hugging Face endpoint (the repository info API and
//! `resolve/` with range requests, commit and etag headers) serves a fixture model; the model is
//! fetched into an empty cache, found there offline afterwards, and runs.
#![cfg(feature = "download")]
#![allow(clippy::unwrap_used)]

mod common;

use rserve_core::hub::{resolve_model_with, HubError, HubSettings};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// Serves `dir` as the repository `org/tiny` at revision `main`; records every path asked for.
struct MockHub {
    url: String,
    requests: Arc<Mutex<Vec<String>>>,
}

impl MockHub {
    fn start(dir: PathBuf, extra_listed: &'static [&'static str]) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (dir, log) = (dir.clone(), log.clone());
                std::thread::spawn(move || serve(stream, &dir, extra_listed, &log));
            }
        });
        Self { url, requests }
    }

    fn paths(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

fn serve(stream: TcpStream, dir: &Path, extra: &[&str], log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut range: Option<(u64, Option<u64>)> = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
            let (a, b) = v.trim().split_once('-').unwrap();
            range = Some((a.parse().unwrap(), b.parse().ok()));
        }
    }
    log.lock().unwrap().push(path.clone());
    let mut out = stream;
    let respond = |out: &mut TcpStream, status: &str, headers: &[String], body: &[u8]| {
        let mut head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for h in headers {
            head.push_str(h);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        let _ = out.write_all(head.as_bytes());
        let _ = out.write_all(body);
    };
    if path == "/api/models/org/tiny/revision/main" {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.extend(extra.iter().map(|s| s.to_string()));
        let siblings: Vec<_> = names
            .iter()
            .map(|n| serde_json::json!({ "rfilename": n }))
            .collect();
        let body = serde_json::json!({ "sha": COMMIT, "siblings": siblings }).to_string();
        respond(
            &mut out,
            "200 OK",
            &["Content-Type: application/json".into()],
            body.as_bytes(),
        );
        return;
    }
    let Some(file) = path.strip_prefix("/org/tiny/resolve/main/") else {
        respond(&mut out, "404 Not Found", &[], b"not found");
        return;
    };
    let Ok(mut f) = std::fs::File::open(dir.join(file)) else {
        respond(&mut out, "404 Not Found", &[], b"not found");
        return;
    };
    let mut data = Vec::new();
    f.read_to_end(&mut data).unwrap();
    let size = data.len() as u64;
    let (start, end) = match range {
        Some((a, b)) => (a, b.unwrap_or(size - 1).min(size - 1)),
        None => (0, size - 1),
    };
    let headers = vec![
        format!("x-repo-commit: {COMMIT}"),
        format!("ETag: \"etag-{}\"", file.replace('.', "-")),
        format!("Content-Range: bytes {start}-{end}/{size}"),
    ];
    respond(
        &mut out,
        "206 Partial Content",
        &headers,
        &data[start as usize..=end as usize],
    );
}

fn settings(cache: &Path, endpoint: &str, offline: bool) -> HubSettings {
    HubSettings {
        cache: cache.to_path_buf(),
        endpoint: endpoint.to_string(),
        offline,
        token: None,
    }
}

fn temp_cache(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rserve-hub-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn downloads_into_the_cache_then_resolves_offline_and_runs() {
    let fixture = common::fixture_model("llama3");
    let hub = MockHub::start(
        fixture.clone(),
        &["pytorch_model.bin", "README.md", "onnx/model.onnx"],
    );
    let cache = temp_cache("dl");

    let offline = resolve_model_with("org/tiny", &settings(&cache, &hub.url, true)).unwrap_err();
    assert!(matches!(offline, HubError::NotCached { .. }), "{offline}");
    assert!(offline.to_string().contains("HF_HUB_OFFLINE"), "{offline}");
    assert!(hub.paths().is_empty(), "offline makes no request");

    let snap = resolve_model_with("org/tiny", &settings(&cache, &hub.url, false)).unwrap();
    assert!(
        snap.ends_with(format!("models--org--tiny/snapshots/{COMMIT}")),
        "{}",
        snap.display()
    );
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let name = entry.unwrap().file_name();
        let got = std::fs::read(snap.join(&name)).unwrap();
        let want = std::fs::read(fixture.join(&name)).unwrap();
        assert!(got == want, "{name:?} differs after download");
    }
    let asked = hub.paths();
    assert!(
        asked
            .iter()
            .all(|p| !p.contains(".bin") && !p.contains("README") && !p.contains("onnx")),
        "{asked:?}"
    );
    let ref_main = std::fs::read_to_string(cache.join("models--org--tiny/refs/main")).unwrap();
    assert_eq!(ref_main.trim(), COMMIT);

    // Cached now: offline resolution finds it without asking the hub again.
    let before = hub.paths().len();
    let again = resolve_model_with("org/tiny", &settings(&cache, &hub.url, true)).unwrap();
    assert_eq!(again, snap);
    assert_eq!(hub.paths().len(), before);

    // The downloaded snapshot loads and generates like the fixture it came from.
    let mut cfg = rserve_core::EngineConfig::new(snap);
    cfg.kv_cache = rserve_core::KvBudget::Blocks(64);
    let h = rserve_core::Engine::start(cfg).unwrap();
    let g = common::golden("llama3");
    let case = &g.cases[0];
    let mut params = rserve_core::SamplingParams::greedy(case.tokens.len());
    params.ignore_eos = true;
    let out = h
        .submit(rserve_core::EngineRequest {
            prompt_token_ids: case.prompt.clone(),
            params,
            lora: None,
            cache_salt: None,
            mm: None,
        })
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(out.outputs[0].token_ids, case.tokens);
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn unknown_repository_is_a_clear_error() {
    let hub = MockHub::start(common::fixture_model("llama3"), &[]);
    let cache = temp_cache("missing");
    let err = resolve_model_with("org/absent", &settings(&cache, &hub.url, false)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, HubError::Download { .. }), "{msg}");
    assert!(msg.contains("org/absent") && msg.contains("404"), "{msg}");
    let _ = std::fs::remove_dir_all(&cache);
}
