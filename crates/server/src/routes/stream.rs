//! A request's output stream as the HTTP layer sees it: records time to first token, inter-token
//! latency, time per output token, end-to-end latency and queue time, and holds the request's
//! place in the pending count until it ends. Dropping it (a client that went away) aborts the
//! request in the engine.

use super::Shared;
use rserve_core::{EngineError, OutputStream, RequestDelta, RequestOutput};
use std::sync::atomic::Ordering;
use std::time::Instant;

pub struct Tracked {
    inner: OutputStream,
    state: Shared,
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    pub prompt_len: usize,
    ended: bool,
}

/// Places in the pending count reserved for a request's prompts; each becomes a [`Tracked`]
/// stream, and those never used are given back when this is dropped.
pub struct Slots {
    state: Shared,
    left: usize,
}

impl Slots {
    /// Takes over `k` places already added to `state.pending`.
    pub fn new(state: Shared, k: usize) -> Self {
        Self { state, left: k }
    }

    /// One reserved place for the stream of a submitted request.
    pub fn take(&mut self, inner: OutputStream, prompt_len: usize) -> Tracked {
        if self.left == 0 {
            // more streams than places: count this one too
            self.state.pending.fetch_add(1, Ordering::AcqRel);
        } else {
            self.left -= 1;
        }
        Tracked::new(inner, self.state.clone(), prompt_len)
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if self.left > 0 {
            self.state.pending.fetch_sub(self.left, Ordering::AcqRel);
        }
    }
}

impl Tracked {
    /// Wraps a stream whose place in the pending count is already taken (see [`Slots`]).
    fn new(inner: OutputStream, state: Shared, prompt_len: usize) -> Self {
        Self {
            inner,
            state,
            start: Instant::now(),
            first: None,
            last: None,
            tokens: 0,
            prompt_len,
            ended: false,
        }
    }

    fn observe(&mut self, out: &RequestDelta) {
        let now = Instant::now();
        let n = self.tokens + out.num_new_tokens();
        let m = &self.state.metrics;
        if n > self.tokens {
            match self.last {
                None => m.ttft.observe(now.duration_since(self.start).as_secs_f64()),
                Some(prev) => m.itl.observe(now.duration_since(prev).as_secs_f64()),
            }
            if self.first.is_none() {
                self.first = Some(now);
            }
            self.last = Some(now);
            self.tokens = n;
        }
        if out.finished {
            m.e2e.observe(now.duration_since(self.start).as_secs_f64());
            if let Some(q) = self.inner.output().queue_time {
                m.queue.observe(q);
            }
            if let (Some(f), true) = (self.first, n > 1) {
                m.tpot
                    .observe(now.duration_since(f).as_secs_f64() / (n - 1) as f64);
            }
        }
    }

    /// The next delta; `None` after the final one.
    pub async fn next(&mut self) -> Option<Result<RequestDelta, EngineError>> {
        let item = self.inner.next().await;
        match &item {
            Some(Ok(o)) => {
                self.observe(o);
                if o.finished {
                    self.end();
                }
            }
            _ => self.end(),
        }
        item
    }

    /// The output assembled so far.
    pub fn output(&self) -> &RequestOutput {
        self.inner.output()
    }

    /// Waits for the end; the assembled output.
    pub async fn finish(mut self) -> Result<RequestOutput, EngineError> {
        while let Some(item) = self.next().await {
            item?;
        }
        if !self.inner.output().finished {
            return Err(EngineError::Stopped);
        }
        Ok(self.inner.take_output())
    }

    fn end(&mut self) {
        if !self.ended {
            self.ended = true;
            self.state.pending.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.end();
    }
}

use crate::openai::error::ApiError;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use rserve_core::request::{CompletionDelta, TokenLogprob};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// How one endpoint renders its stream chunks.
pub trait ChunkFormat: Send + Sync + 'static {
    /// A chunk sent once per choice before any text (chat: the role).
    fn opening(&self, index: usize) -> Option<Value>;
    /// A chunk carrying new text and tokens of one choice (`out.logprobs` are the new tokens');
    /// `first` holds, for its first content chunk only, the prompt logprobs received so far
    /// (completions' `echo` puts the prompt, and with `logprobs` its logprobs, there).
    /// `None` when there is nothing to send yet (text held back).
    fn content(
        &self,
        index: usize,
        out: &CompletionDelta,
        first: Option<&[Option<TokenLogprob>]>,
    ) -> Option<Value>;
    /// The final usage chunk.
    fn usage(&self, usage: Value) -> Value;
}

/// Per-choice progress of a streamed request.
#[derive(Default, Clone)]
struct Progress {
    tokens: usize,
    content_sent: bool,
    finished: bool,
}

type EventStream = Pin<Box<dyn Stream<Item = Vec<Event>> + Send>>;

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// `{"prompt_tokens", "completion_tokens", "total_tokens"}`.
/// OpenAI's usage object; `cached` prompt tokens came from the prefix cache.
pub fn usage_json(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// Tokens counted over the requests of one streamed response.
#[derive(Default)]
struct StreamCounts {
    generated: AtomicUsize,
    cached: AtomicUsize,
}

fn one_request<F: ChunkFormat>(
    fmt: Arc<F>,
    tracked: Tracked,
    base: usize,
    n: usize,
    counts: Arc<StreamCounts>,
) -> EventStream {
    // the prompt logprobs received so far, for the choices' first chunks
    let init = (tracked, vec![Progress::default(); n], false, Vec::new());
    let s = stream::unfold(init, move |(mut t, mut prog, opened, mut prompt_lps)| {
        let fmt = fmt.clone();
        let counts = counts.clone();
        async move {
            let mut events = Vec::new();
            if !opened {
                for i in 0..prog.len() {
                    if let Some(v) = fmt.opening(base + i) {
                        events.push(data(&v));
                    }
                }
            }
            match t.next().await {
                None => {
                    if events.is_empty() {
                        None
                    } else {
                        Some((events, (t, prog, true, prompt_lps)))
                    }
                }
                Some(Err(e)) => {
                    events.push(data(&ApiError::from(e).body()));
                    // end this request's stream after the error
                    prog.iter_mut().for_each(|p| p.finished = true);
                    Some((events, (t, prog, true, prompt_lps)))
                }
                Some(Ok(delta)) => {
                    prompt_lps.extend(delta.prompt_logprobs.iter().cloned());
                    if let Some(c) = delta.num_cached_tokens {
                        counts.cached.fetch_add(c, Ordering::Relaxed);
                    }
                    for c in &delta.outputs {
                        let Some(p) = prog.get_mut(c.index) else {
                            continue;
                        };
                        if p.finished {
                            continue;
                        }
                        p.tokens += c.token_ids.len();
                        let finishing = c.finish_reason.is_some();
                        if !c.text.is_empty() || finishing || !c.logprobs.is_empty() {
                            let first = (!p.content_sent).then_some(prompt_lps.as_slice());
                            if let Some(v) = fmt.content(base + c.index, c, first) {
                                events.push(data(&v));
                                p.content_sent = true;
                            }
                        }
                        if finishing {
                            p.finished = true;
                            counts.generated.fetch_add(p.tokens, Ordering::Relaxed);
                        }
                    }
                    Some((events, (t, prog, true, prompt_lps)))
                }
            }
        }
    });
    Box::pin(s)
}

/// The SSE response for one or more requests (choices `base..base + n` each), then the usage
/// chunk when asked for, then `[DONE]`.
pub fn sse_response<F: ChunkFormat>(
    fmt: F,
    requests: Vec<(Tracked, usize, usize)>,
    include_usage: bool,
) -> Response {
    let fmt = Arc::new(fmt);
    let counts = Arc::new(StreamCounts::default());
    let prompt_tokens: usize = requests.iter().map(|(t, _, _)| t.prompt_len).sum();
    let streams: Vec<EventStream> = requests
        .into_iter()
        .map(|(t, base, n)| one_request(fmt.clone(), t, base, n, counts.clone()))
        .collect();
    let tail_fmt = fmt.clone();
    let tail = stream::once(async move {
        let mut ev = Vec::new();
        if include_usage {
            let u = usage_json(
                prompt_tokens,
                counts.generated.load(Ordering::Relaxed),
                counts.cached.load(Ordering::Relaxed),
            );
            ev.push(data(&tail_fmt.usage(u)));
        }
        ev.push(Event::default().data("[DONE]"));
        ev
    });
    let body = stream::select_all(streams)
        .chain(tail)
        .flat_map(|v| stream::iter(v.into_iter().map(Ok::<Event, Infallible>)));
    Sse::new(body).into_response()
}
