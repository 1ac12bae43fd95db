//! `rserve bench startup`: how long a fresh `rserve serve` process takes to answer, run after run.
//! Each run starts the server, polls `/health` until it answers 200, then streams a short
//! completion and notes when the first token arrives. The server's own `startup:` lines (one per
//! phase, `--log-level info`) come back in the report, so the total splits into its phases.

use crate::cli::BenchStartupArgs;
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Run {
    health: f64,
    first_token: f64,
    completion: f64,
    phases: Vec<String>,
}

/// Kills the server when a run ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Drops the page cache (root only); says why not when it cannot.
fn drop_page_cache() -> Result<()> {
    std::process::Command::new("sync").status().ok();
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .context("dropping the page cache needs root and a writable /proc/sys (--cold)")
}

type LogReader = std::thread::JoinHandle<(Vec<String>, String)>;

/// An error carrying the server's last lines, once it is gone.
fn failed(child: Server, log: LogReader, why: String) -> anyhow::Error {
    drop(child);
    let tail = log.join().map(|(_, t)| t).unwrap_or_default();
    anyhow::anyhow!("{why}; the server's last lines:\n{tail}")
}

fn one_run(args: &BenchStartupArgs, binary: &std::path::Path) -> Result<Run> {
    let port = free_port()?;
    let mut cmd = Command::new(binary);
    cmd.arg("--log-level")
        .arg("info")
        .arg("serve")
        .args(args.model.iter())
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(&args.serve_args)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = Server(
        cmd.spawn()
            .with_context(|| format!("starting {}", binary.display()))?,
    );
    let stderr = child.0.stderr.take().context("server stderr")?;
    let log = std::thread::spawn(move || {
        let mut phases = Vec::new();
        let mut tail = std::collections::VecDeque::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(i) = line.rfind("startup: ") {
                phases.push(line[i + 9..].to_string());
            }
            if tail.len() == 20 {
                tail.pop_front();
            }
            tail.push_back(line);
        }
        (phases, Vec::from(tail).join("\n"))
    });
    let base = format!("http://127.0.0.1:{port}");
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(args.timeout))
        .build();
    let deadline = start + Duration::from_secs(args.timeout);
    let health = loop {
        if let Ok(Some(status)) = child.0.try_wait() {
            return Err(failed(
                child,
                log,
                format!("the server exited ({status}) before /health answered"),
            ));
        }
        if Instant::now() > deadline {
            return Err(failed(
                child,
                log,
                format!("/health did not answer 200 within {} s", args.timeout),
            ));
        }
        match agent.get(&format!("{base}/health")).call() {
            Ok(r) if r.status() == 200 => break start.elapsed().as_secs_f64(),
            _ => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    let models: Value = agent
        .get(&format!("{base}/v1/models"))
        .call()
        .context("/v1/models")?
        .into_json()?;
    let model = models["data"][0]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let body = json!({
        "model": model,
        "prompt": "The quick brown fox",
        "max_tokens": args.max_tokens,
        "stream": true,
        "ignore_eos": true,
        // one event per token, text or not (a random model's first tokens may all be special)
        "logprobs": 0,
    });
    let resp = agent
        .post(&format!("{base}/v1/completions"))
        .send_json(body)
        .context("the completion request")?;
    let mut first_token = None;
    let mut reader = BufReader::new(resp.into_reader());
    let mut line = String::new();
    while reader.read_line(&mut line)? > 0 {
        if let Some(data) = line.trim().strip_prefix("data: ") {
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            let choice = &v["choices"][0];
            let has_token = choice["text"].as_str().is_some_and(|t| !t.is_empty())
                || choice["logprobs"]["tokens"]
                    .as_array()
                    .is_some_and(|t| !t.is_empty());
            if has_token && first_token.is_none() {
                first_token = Some(start.elapsed().as_secs_f64());
            }
        }
        line.clear();
    }
    let completion = start.elapsed().as_secs_f64();
    drop(child);
    let phases = log.join().map(|(p, _)| p).unwrap_or_default();
    Ok(Run {
        health,
        first_token: first_token.context("the completion streamed no token")?,
        completion,
        phases,
    })
}

pub fn run(args: BenchStartupArgs) -> Result<()> {
    let binary = match &args.binary {
        Some(b) => b.clone(),
        None => std::env::current_exe().context("locating the rserve binary")?,
    };
    let mut runs = Vec::new();
    for i in 0..args.runs {
        if args.cold {
            drop_page_cache()?;
        }
        let r = one_run(&args, &binary)?;
        if args.json {
            println!(
                "{}",
                json!({"run": i, "cold_page_cache": args.cold, "health_s": r.health,
                       "first_token_s": r.first_token, "completion_s": r.completion,
                       "max_tokens": args.max_tokens, "phases": r.phases})
            );
        } else {
            println!(
                "run {i}: /health {:.3} s, first token {:.3} s, {} tokens {:.3} s (from process start)",
                r.health, r.first_token, args.max_tokens, r.completion
            );
            for p in &r.phases {
                println!("    {p}");
            }
        }
        runs.push(r);
    }
    if !args.json && !runs.is_empty() {
        let best = |f: fn(&Run) -> f64| runs.iter().map(f).fold(f64::INFINITY, f64::min);
        println!(
            "best of {}: /health {:.3} s, first token {:.3} s",
            runs.len(),
            best(|r| r.health),
            best(|r| r.first_token)
        );
    }
    Ok(())
}
