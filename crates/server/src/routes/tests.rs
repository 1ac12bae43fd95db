//! The router in-process: validation errors and their shape, SSE framing, the usage chunk and
//! `[DONE]`, auth, and unknown models, against a tiny fixture model.

use super::*;
use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use rserve_core::{Engine, EngineConfig, KvBudget};
use serde_json::{json, Value};
use tower::ServiceExt;

fn app(api_key: Option<&str>) -> Router {
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/qwen2");
    let mut cfg = EngineConfig::new(model);
    cfg.kv_cache = KvBudget::Blocks(64);
    cfg.max_model_len = Some(128);
    let edge = EdgeConfig {
        max_pending: 16,
        body_limit: Some(1 << 20),
        ..EdgeConfig::default()
    };
    let state = Arc::new(AppState::new(
        "tiny".into(),
        api_key.map(String::from),
        edge,
    ));
    state.set_engine(Engine::start(cfg).expect("engine"));
    router(state)
}

async fn call(
    app: &Router,
    method: &str,
    path: &str,
    body: Option<&str>,
    auth: Option<&str>,
) -> (StatusCode, String, String) {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(a) = auth {
        b = b.header("authorization", format!("Bearer {a}"));
    }
    let req = b
        .body(Body::from(body.unwrap_or("").to_string()))
        .expect("request");
    let resp = app.clone().oneshot(req).await.expect("response");
    let status = resp.status();
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, ctype, String::from_utf8_lossy(&bytes).into_owned())
}

fn error_of(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).expect("json error body");
    for k in ["message", "type", "param", "code"] {
        assert!(v["error"].get(k).is_some(), "missing error.{k} in {body}");
    }
    v["error"].clone()
}

#[tokio::test]
async fn validation_errors_are_400_in_openai_shape() {
    let app = app(None);
    let cases = [
        r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
        r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":-1}"#,
        r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"top_p":2}"#,
        r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"n":0}"#,
        r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":50}"#,
        r#"{"model":"tiny","messages":[]}"#,
        r#"{"model":"tiny","messages":[{"role":"wizard","content":"x"}]}"#,
        r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
        r#"{"model":"tiny","messages": "#,
    ];
    for body in cases {
        let (status, _, text) = call(&app, "POST", "/v1/chat/completions", Some(body), None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {text}");
        assert_eq!(error_of(&text)["code"], 400);
    }
    // limits on stop strings and logit_bias, named in the message
    let stops: Vec<String> = (0..129).map(|i| format!("s{i}")).collect();
    let bias: serde_json::Map<String, Value> =
        (0..1025).map(|t| (t.to_string(), json!(1))).collect();
    for (body, limit) in [
        (
            json!({"model": "tiny", "prompt": "a", "stop": stops}),
            "128",
        ),
        (
            json!({"model": "tiny", "prompt": "a", "stop": ["y".repeat(1025)]}),
            "1024",
        ),
        (
            json!({"model": "tiny", "prompt": "a", "logit_bias": bias}),
            "1024",
        ),
    ] {
        let (status, _, text) = call(
            &app,
            "POST",
            "/v1/completions",
            Some(&body.to_string()),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        let msg = error_of(&text)["message"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(msg.contains(limit), "{msg}");
    }
    let long = format!(
        r#"{{"model":"tiny","prompt":[{}],"max_tokens":10}}"#,
        vec!["5"; 125].join(",")
    );
    let (status, _, text) = call(&app, "POST", "/v1/completions", Some(&long), None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(error_of(&text)["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length is 128 tokens"));
    let (status, _, text) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(r#"{"model":"nope","prompt":"a"}"#),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        error_of(&text)["message"],
        "The model `nope` does not exist."
    );
    // still serving
    let (status, _, _) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(r#"{"model":"tiny","prompt":"a","max_tokens":2}"#),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let app = app(None);
    let big = format!(r#"{{"model":"tiny","prompt":"{}"}}"#, "a".repeat(2 << 20));
    let (status, _, text) = call(&app, "POST", "/v1/completions", Some(&big), None).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    error_of(&text);
}

#[tokio::test]
async fn sse_framing_usage_chunk_and_done() {
    let app = app(None);
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}, "n": 2, "seed": 1});
    let (status, ctype, text) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(ctype.starts_with("text/event-stream"), "{ctype}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    for e in &events {
        assert!(e.starts_with("data: "), "{e}");
    }
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e["data: ".len()..]).expect("chunk json"))
        .collect();
    for idx in 0..2 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"].get(0).is_some_and(|ch| ch["index"] == idx))
            .collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        let finishes: Vec<&Value> = mine
            .iter()
            .filter(|c| !c["choices"][0]["finish_reason"].is_null())
            .copied()
            .collect();
        assert_eq!(finishes.len(), 1);
        assert!(
            std::ptr::eq(*mine.last().unwrap(), finishes[0]),
            "finish_reason rides on the last chunk"
        );
        assert_eq!(finishes[0]["choices"][0]["finish_reason"], "length");
    }
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    assert_eq!(usage["object"], "chat.completion.chunk");
}

#[tokio::test]
async fn api_key_guards_v1_only() {
    let app = app(Some("sekrit"));
    let body = r#"{"model":"tiny","prompt":"a","max_tokens":1}"#;
    let (status, _, text) = call(&app, "POST", "/v1/completions", Some(body), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    error_of(&text);
    let (status, _, _) = call(&app, "POST", "/v1/completions", Some(body), Some("wrong")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = call(&app, "POST", "/v1/completions", Some(body), Some("sekrit")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        call(&app, "GET", "/health", None, None).await.0,
        StatusCode::OK
    );
    assert_eq!(
        call(&app, "GET", "/metrics", None, None).await.0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn usage_matches_tokenize() {
    let app = app(None);
    let (_, _, tok) = call(
        &app,
        "POST",
        "/tokenize",
        Some(r#"{"prompt":"hello world"}"#),
        None,
    )
    .await;
    let count = serde_json::from_str::<Value>(&tok).unwrap()["count"].clone();
    let (_, _, out) = call(
        &app,
        "POST",
        "/v1/completions",
        Some(r#"{"model":"tiny","prompt":"hello world","max_tokens":3,"ignore_eos":true}"#),
        None,
    )
    .await;
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], count);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
}
