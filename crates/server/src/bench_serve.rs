//! `rserve bench serve`: a load client in the spirit of `vllm bench serve` for any
//! OpenAI-compatible server. Sends `--num-prompts` streamed completions of random token ids
//! (fixed input and output lengths, `ignore_eos`) with at most `--max-concurrency` in flight and
//! Poisson arrivals at `--request-rate`, then prints throughput and TTFT / TPOT / ITL statistics.
//! `--dataset-name prefix_repetition` sends prompts sharing a few long prefixes instead (vLLM's
//! dataset of that name) and reports the prompt tokens the server found in its prefix cache;
//! `random-mm` sends chat messages with random images (`bench_dataset`). Prompt tokens are
//! counted from the server's `usage` where it reports them.
//! It speaks plain HTTP/1.1 over TCP itself (no TLS), which is all a benchmark on a local network
//! needs.

use crate::bench_dataset;
use crate::cli::BenchServeArgs;
use anyhow::{bail, Context, Result};
use rserve_core::sampler::SeqRng;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

/// Timings of one request.
#[derive(Debug, Clone, Default)]
struct Sample {
    ok: bool,
    ttft: f64,
    e2e: f64,
    itl: Vec<f64>,
    output_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens` of the final chunk.
    cached_tokens: usize,
    /// `usage.prompt_tokens` of the final chunk (0 when the server sent none).
    prompt_tokens: usize,
    error: Option<String>,
}

fn split_url(base: &str) -> Result<(String, String)> {
    let rest = base
        .strip_prefix("http://")
        .context("--base-url must start with http://")?;
    let (host, path) = match rest.split_once('/') {
        Some((h, p)) => (h.to_string(), format!("/{}", p.trim_end_matches('/'))),
        None => (rest.to_string(), String::new()),
    };
    let host = if host.contains(':') {
        host
    } else {
        format!("{host}:80")
    };
    Ok((host, path))
}

/// Reads one line of the (possibly chunked) body into `buf`; handles chunk framing.
struct BodyReader<R> {
    r: BufReader<R>,
    chunked: bool,
    left_in_chunk: usize,
    done: bool,
}

impl<R: tokio::io::AsyncRead + Unpin> BodyReader<R> {
    async fn read_some(&mut self) -> Result<Option<Vec<u8>>> {
        if self.done {
            return Ok(None);
        }
        if !self.chunked {
            let mut buf = vec![0u8; 8192];
            let n = self.r.read(&mut buf).await?;
            if n == 0 {
                self.done = true;
                return Ok(None);
            }
            buf.truncate(n);
            return Ok(Some(buf));
        }
        if self.left_in_chunk == 0 {
            let mut line = String::new();
            self.r.read_line(&mut line).await?;
            if line.trim().is_empty() {
                line.clear();
                self.r.read_line(&mut line).await?;
            }
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16)
                .context("bad chunk size")?;
            if size == 0 {
                self.done = true;
                return Ok(None);
            }
            self.left_in_chunk = size;
        }
        let mut buf = vec![0u8; self.left_in_chunk.min(8192)];
        let n = self.r.read(&mut buf).await?;
        if n == 0 {
            self.done = true;
            return Ok(None);
        }
        buf.truncate(n);
        self.left_in_chunk -= n;
        Ok(Some(buf))
    }
}

async fn one_request(host: &str, path: &str, auth: Option<&str>, body: &Value) -> Result<Sample> {
    let start = Instant::now();
    let stream = TcpStream::connect(host)
        .await
        .with_context(|| format!("connecting to {host}"))?;
    stream.set_nodelay(true)?;
    let (rd, mut wr) = stream.into_split();
    let payload = body.to_string();
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n",
        payload.len()
    );
    if let Some(k) = auth {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    head.push_str("\r\n");
    wr.write_all(head.as_bytes()).await?;
    wr.write_all(payload.as_bytes()).await?;
    let mut r = BufReader::new(rd);
    let mut status = String::new();
    r.read_line(&mut status).await?;
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut chunked = false;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).await? == 0 || line == "\r\n" {
            break;
        }
        let l = line.to_ascii_lowercase();
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let mut body = BodyReader {
        r,
        chunked,
        left_in_chunk: 0,
        done: false,
    };
    let mut s = Sample::default();
    let mut pending = Vec::new();
    let mut last: Option<Instant> = None;
    let mut usage_tokens = None;
    let mut chunks_with_text = 0usize;
    while let Some(bytes) = body.read_some().await? {
        pending.extend_from_slice(&bytes);
        while let Some(pos) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            if let Some(e) = v.get("error") {
                s.error = Some(e.to_string());
                continue;
            }
            if let Some(u) = v
                .get("usage")
                .and_then(|u| u.get("completion_tokens"))
                .and_then(Value::as_u64)
            {
                usage_tokens = Some(u as usize);
                s.cached_tokens = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0) as usize;
                s.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            }
            let has_text = v["choices"]
                .get(0)
                .and_then(|c| c.get("text").or_else(|| c["delta"].get("content")))
                .and_then(Value::as_str)
                .is_some_and(|t| !t.is_empty());
            if has_text {
                let now = Instant::now();
                match last {
                    None => s.ttft = now.duration_since(start).as_secs_f64(),
                    Some(p) => s.itl.push(now.duration_since(p).as_secs_f64()),
                }
                last = Some(now);
                chunks_with_text += 1;
            }
        }
    }
    s.e2e = start.elapsed().as_secs_f64();
    s.output_tokens = usage_tokens.unwrap_or(chunks_with_text);
    s.ok = code == 200 && s.error.is_none() && last.is_some();
    if code != 200 {
        s.error = Some(format!("HTTP {code}"));
    }
    Ok(s)
}

fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let pct = |p: f64| v[((p * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)];
    (mean, pct(0.5), pct(0.99))
}

/// `--structured-output json_schema`: an array of records with more items than any output holds.
fn records_schema() -> Value {
    let record = json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
            "name": {"type": "string", "maxLength": 16},
            "kind": {"enum": ["user", "group", "service", "device"]},
            "active": {"type": "boolean"},
            "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
        },
        "required": ["id", "name", "kind", "active", "scores"],
        "additionalProperties": false,
    });
    json!({"type": "json_schema", "json_schema": {"name": "records", "schema": {
        "type": "array", "items": record, "minItems": 100000,
    }}})
}

pub fn run(args: BenchServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_async(args))
}

async fn run_async(args: BenchServeArgs) -> Result<()> {
    if args.max_concurrency == 0 {
        bail!("--max-concurrency must be positive");
    }
    let (host, base_path) = split_url(&args.base_url)?;
    let mut rng = SeqRng::new(args.seed);
    let data = bench_dataset::build(&args, &mut rng)?;
    let path = format!(
        "{base_path}/{}",
        if data.chat {
            "chat/completions"
        } else {
            "completions"
        }
    );
    let (input_len, output_len, data_chat) = (data.input_len, data.output_len, data.chat);
    let sem = Arc::new(Semaphore::new(args.max_concurrency));
    let auth: Option<Arc<str>> = args.api_key.as_deref().map(Arc::from);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(data.prompts.len());
    for (i, p) in data.prompts.into_iter().enumerate() {
        if let Some(rate) = args.request_rate.filter(|r| r.is_finite() && *r > 0.0) {
            let gap = -(1.0 - rng.next_f64()).ln() / rate;
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
        let permit = sem.clone().acquire_owned().await?;
        let mut body = json!({
            "model": match args.lora_modules.len() {
                0 => args.model.as_str(),
                k => args.lora_modules[i % k].as_str(),
            },
            "max_tokens": output_len, "ignore_eos": true,
            "temperature": 0.0, "stream": true, "stream_options": {"include_usage": true},
        });
        p.insert_into(&mut body);
        if args.structured_output.is_some() {
            body["response_format"] = records_schema();
        }
        let (host, path, auth) = (host.clone(), path.clone(), auth.clone());
        tasks.push(tokio::spawn(async move {
            let r = one_request(&host, &path, auth.as_deref(), &body).await;
            drop(permit);
            r.unwrap_or_else(|e| Sample {
                error: Some(e.to_string()),
                ..Sample::default()
            })
        }));
    }
    let mut samples = Vec::with_capacity(tasks.len());
    for t in tasks {
        samples.push(t.await?);
    }
    let dur = start.elapsed().as_secs_f64();
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let failed = samples.len() - ok.len();
    if let Some(e) = samples.iter().find_map(|s| s.error.clone()) {
        eprintln!("first error: {e}");
    }
    let out_tokens: usize = ok.iter().map(|s| s.output_tokens).sum();
    // the server's count where every request has one (images, chat templates), else the
    // dataset's for token prompts; a chat prompt's count is the server's alone
    let in_tokens: Option<usize> = if ok.iter().all(|s| s.prompt_tokens > 0) {
        Some(ok.iter().map(|s| s.prompt_tokens).sum())
    } else if data_chat {
        None
    } else {
        Some(ok.len() * input_len)
    };
    let cached_tokens: usize = ok.iter().map(|s| s.cached_tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().map(|s| s.ttft).collect();
    let mut tpot: Vec<f64> = ok
        .iter()
        .filter(|s| s.output_tokens > 1)
        .map(|s| (s.e2e - s.ttft) / (s.output_tokens - 1) as f64)
        .collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|s| s.itl.iter().copied()).collect();
    let (t, tp, i) = (stats(&mut ttft), stats(&mut tpot), stats(&mut itl));
    let report = json!({
        "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "dataset": args.dataset_name, "input_len": input_len, "output_len": output_len,
        "structured_output": args.structured_output,
        "total_input_tokens": in_tokens,
        "prompt_tokens_mean": in_tokens.map(|n| n as f64 / ok.len().max(1) as f64),
        "cached_prompt_tokens": cached_tokens,
        "prefix_cache_hit_rate": in_tokens.map(|n| cached_tokens as f64 / n.max(1) as f64),
        "successful": ok.len(), "failed": failed, "duration_s": dur,
        "request_throughput": ok.len() as f64 / dur, "output_throughput": out_tokens as f64 / dur,
        "total_token_throughput": in_tokens.map(|n| (out_tokens + n) as f64 / dur),
        "ttft_ms": {"mean": t.0 * 1e3, "median": t.1 * 1e3, "p99": t.2 * 1e3},
        "tpot_ms": {"mean": tp.0 * 1e3, "median": tp.1 * 1e3, "p99": tp.2 * 1e3},
        "itl_ms": {"mean": i.0 * 1e3, "median": i.1 * 1e3, "p99": i.2 * 1e3},
    });
    if args.json {
        println!("{report}");
    } else {
        println!("============ Serving Benchmark Result ============");
        println!("{:<40}{:>10}", "Successful requests:", ok.len());
        println!("{:<40}{:>10}", "Failed requests:", failed);
        println!(
            "{:<40}{:>10}",
            "Maximum request concurrency:", args.max_concurrency
        );
        println!("{:<40}{:>10.2}", "Benchmark duration (s):", dur);
        let unknown = || "unknown".to_string();
        println!(
            "{:<40}{:>10}",
            "Total input tokens:",
            in_tokens.map_or_else(unknown, |n| n.to_string())
        );
        println!("{:<40}{:>10}", "Cached prompt tokens:", cached_tokens);
        println!("{:<40}{:>10}", "Total generated tokens:", out_tokens);
        println!(
            "{:<40}{:>10.2}",
            "Request throughput (req/s):",
            ok.len() as f64 / dur
        );
        println!(
            "{:<40}{:>10.2}",
            "Output token throughput (tok/s):",
            out_tokens as f64 / dur
        );
        println!(
            "{:<40}{:>10}",
            "Total token throughput (tok/s):",
            in_tokens.map_or_else(unknown, |n| format!("{:.2}", (out_tokens + n) as f64 / dur))
        );
        for (name, s) in [("TTFT", t), ("TPOT", tp), ("ITL", i)] {
            println!("{:<40}{:>10.2}", format!("Mean {name} (ms):"), s.0 * 1e3);
            println!("{:<40}{:>10.2}", format!("Median {name} (ms):"), s.1 * 1e3);
            println!("{:<40}{:>10.2}", format!("P99 {name} (ms):"), s.2 * 1e3);
        }
        println!("==================================================");
    }
    if ok.is_empty() {
        bail!("every request failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_urls() {
        assert_eq!(
            split_url("http://127.0.0.1:8000/v1").unwrap(),
            ("127.0.0.1:8000".into(), "/v1".into())
        );
        assert_eq!(
            split_url("http://localhost/v1/").unwrap(),
            ("localhost:80".into(), "/v1".into())
        );
        assert!(split_url("https://x").is_err());
    }

    #[test]
    fn percentiles() {
        let mut v = vec![3.0, 1.0, 2.0];
        assert_eq!(stats(&mut v), (2.0, 2.0, 3.0));
        assert!(stats(&mut []).0.is_nan());
    }
}
