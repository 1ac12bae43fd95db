//! Outputs (vLLM v1's OutputProcessor): accepted tokens become text and deltas for the readers.
//!
//! The engine hands over each accepted token with the finish it decided from the token alone
//! ([`OutputProcessor::token`]: a cheap push). [`OutputProcessor::settle`] then does the text
//! work in one place: incremental detokenizing, stop strings (which may end a completion the
//! engine thought was running: those are returned so it can end their sequences), and one
//! [`RequestDelta`] per changed request posted to its reader's coalescing mailbox. The engine
//! calls `settle` while the device computes the next step, so none of this is on the step's
//! critical path, and its cost is linear in the new tokens and text, never in what was sent
//! before.
//!
//! Owns each live request's text state; knows nothing of sequences, blocks or the scheduler.

use crate::engine_error::EngineError;
use crate::engine_types::EngineStats;
use crate::request::{
    CompletionDelta, FinishReason, RequestDelta, RequestId, SamplingParams, StopReason,
    TokenLogprob,
};
use crate::stop_strings::StopStrings;
use crate::stream::Sink;
use crate::tokenizer::{IncrementalDetokenizer, Tokenizer};
use std::collections::HashMap;
use std::sync::Arc;

struct CompletionText {
    detok: IncrementalDetokenizer,
    new_tokens: Vec<u32>,
    new_logprobs: Vec<TokenLogprob>,
    cumulative_logprob: f32,
    finish: Option<FinishReason>,
    stop_reason: Option<StopReason>,
    /// Something to send: tokens, text or the finish.
    changed: bool,
}

struct RequestText {
    sink: Sink,
    logprobs: bool,
    completions: Vec<CompletionText>,
    new_prompt_logprobs: Vec<Option<TokenLogprob>>,
    queue_time: Option<f64>,
    /// Prompt tokens the prefix cache held (known with the first step).
    cached_tokens: Option<usize>,
    queue_time_sent: bool,
    /// Listed in `touched`: something to send at the next settle.
    touched: bool,
}

impl RequestText {
    fn finished(&self) -> bool {
        self.completions.iter().all(|c| c.finish.is_some())
    }
}

/// What a token means for its completion, decided without its text.
pub(crate) struct Counted {
    /// Whether the token is text (not a stop token or EOS that ended the completion).
    pub text: bool,
    /// Whether stop strings may end the completion now (`min_tokens` reached).
    pub stops_active: bool,
    /// Why the completion ended here, if it did.
    pub finish: Option<(FinishReason, Option<StopReason>)>,
}

/// A token the engine accepted, waiting for its text.
struct TokenEvent {
    rid: RequestId,
    idx: usize,
    token: TokenLogprob,
    counted: Counted,
}

/// What [`OutputProcessor::settle`] tells the engine.
#[derive(Debug, Default)]
pub(crate) struct Settled {
    /// Completions a stop string ended.
    pub stopped: Vec<(RequestId, usize)>,
    /// Requests whose reader went away.
    pub gone: Vec<RequestId>,
}

pub(crate) struct OutputProcessor {
    tokenizer: Arc<Tokenizer>,
    stats: Arc<EngineStats>,
    requests: HashMap<RequestId, RequestText>,
    events: Vec<TokenEvent>,
    /// Requests with something to send, in first-touched order.
    touched: Vec<RequestId>,
}

impl OutputProcessor {
    pub fn new(tokenizer: Arc<Tokenizer>, stats: Arc<EngineStats>) -> Self {
        Self {
            tokenizer,
            stats,
            requests: HashMap::new(),
            events: Vec::new(),
            touched: Vec::new(),
        }
    }

    /// Starts a request's text state; `prompt` gives the detokenizer its context.
    pub fn add(&mut self, rid: RequestId, sink: Sink, prompt: &[u32], p: &SamplingParams) {
        let stops = Arc::new(StopStrings::new(p.stop.clone()));
        let completions = (0..p.n)
            .map(|_| CompletionText {
                detok: IncrementalDetokenizer::new(
                    &self.tokenizer,
                    prompt,
                    p.skip_special_tokens,
                    stops.clone(),
                    p.include_stop_str_in_output,
                ),
                new_tokens: Vec::new(),
                new_logprobs: Vec::new(),
                cumulative_logprob: 0.0,
                finish: None,
                stop_reason: None,
                changed: false,
            })
            .collect();
        let new_prompt_logprobs = if p.prompt_logprobs.is_some() {
            vec![None]
        } else {
            Vec::new()
        };
        self.requests.insert(
            rid,
            RequestText {
                sink,
                logprobs: p.logprobs.is_some(),
                completions,
                new_prompt_logprobs,
                queue_time: None,
                cached_tokens: None,
                queue_time_sent: false,
                touched: false,
            },
        );
    }

    /// A token accepted for completion `idx` of `rid`, with what the engine decided of it (its
    /// text is worked out in `settle`).
    pub fn token(&mut self, rid: RequestId, idx: usize, token: TokenLogprob, counted: Counted) {
        self.events.push(TokenEvent {
            rid,
            idx,
            token,
            counted,
        });
    }

    /// The next entry of a request's prompt logprobs.
    pub fn prompt_logprob(&mut self, rid: RequestId, entry: TokenLogprob) {
        if let Some(r) = self.requests.get_mut(&rid) {
            r.new_prompt_logprobs.push(Some(entry));
            Self::touch(&mut self.touched, r, rid);
        }
    }

    /// Seconds the request waited for its first step and the prompt tokens the prefix cache
    /// held then (sent with its next delta).
    pub fn first_step(&mut self, rid: RequestId, seconds: f64, cached_tokens: usize) {
        if let Some(r) = self.requests.get_mut(&rid) {
            r.queue_time.get_or_insert(seconds);
            r.cached_tokens.get_or_insert(cached_tokens);
        }
    }

    pub fn has_pending(&self) -> bool {
        !self.events.is_empty() || !self.touched.is_empty()
    }

    fn touch(touched: &mut Vec<RequestId>, r: &mut RequestText, rid: RequestId) {
        if !r.touched {
            r.touched = true;
            touched.push(rid);
        }
    }

    /// Works out the text of the tokens handed over since the last call, applies stop strings
    /// (a stop string found now ends its completion, even at a token that also reached the
    /// length limit) and posts one delta to every request that changed.
    pub fn settle(&mut self) -> Settled {
        let mut settled = Settled::default();
        for ev in std::mem::take(&mut self.events) {
            let Some(r) = self.requests.get_mut(&ev.rid) else {
                continue;
            };
            let Some(c) = r.completions.get_mut(ev.idx) else {
                continue;
            };
            if c.finish.is_some() {
                // a token computed past a stop string found since: dropped
                continue;
            }
            c.new_tokens.push(ev.token.token_id);
            c.cumulative_logprob += ev.token.logprob;
            let id = ev.token.token_id;
            if r.logprobs {
                c.new_logprobs.push(ev.token);
            }
            let mut finish = ev.counted.finish;
            if ev.counted.text {
                match c
                    .detok
                    .push_with(&self.tokenizer, id, ev.counted.stops_active)
                {
                    Ok(Some(stop)) => {
                        if finish.is_none() {
                            settled.stopped.push((ev.rid, ev.idx));
                        }
                        finish = Some((FinishReason::Stop, Some(StopReason::Text(stop))));
                    }
                    Ok(_) => {}
                    Err(e) => tracing::debug!("detokenizer: {e}"),
                }
            }
            if let Some((reason, stop)) = finish {
                if let Err(e) = c.detok.flush(&self.tokenizer) {
                    tracing::debug!("detokenizer: {e}");
                }
                c.finish = Some(reason);
                c.stop_reason = stop;
                self.stats.record_finish(reason);
            }
            c.changed = true;
            Self::touch(&mut self.touched, r, ev.rid);
        }
        for rid in std::mem::take(&mut self.touched) {
            if !self.send(rid) {
                settled.gone.push(rid);
            }
        }
        settled
    }

    /// Posts what changed in `rid` since its last delta; false when its reader is gone.
    fn send(&mut self, rid: RequestId) -> bool {
        let Some(r) = self.requests.get_mut(&rid) else {
            return true;
        };
        r.touched = false;
        let finished = r.finished();
        let outputs = r
            .completions
            .iter_mut()
            .enumerate()
            .filter(|(_, c)| c.changed)
            .map(|(index, c)| {
                c.changed = false;
                CompletionDelta {
                    index,
                    text: c.detok.take_delta(c.finish.is_some()),
                    token_ids: std::mem::take(&mut c.new_tokens),
                    logprobs: std::mem::take(&mut c.new_logprobs),
                    cumulative_logprob: c.cumulative_logprob,
                    finish_reason: c.finish,
                    stop_reason: c.stop_reason.clone(),
                }
            })
            .collect();
        let (queue_time, num_cached_tokens) = if r.queue_time_sent {
            (None, None)
        } else {
            (r.queue_time, r.cached_tokens)
        };
        r.queue_time_sent |= queue_time.is_some();
        let delta = RequestDelta {
            request_id: rid,
            prompt_logprobs: std::mem::take(&mut r.new_prompt_logprobs),
            outputs,
            finished,
            queue_time,
            num_cached_tokens,
        };
        let delivered = r.sink.post(delta);
        if finished {
            self.requests.remove(&rid);
        }
        delivered || finished
    }

    /// Ends a request by abort: its text so far goes out with finish reason `abort` on every
    /// completion still open.
    pub fn abort(&mut self, rid: RequestId) {
        let Some(r) = self.requests.get_mut(&rid) else {
            return;
        };
        for c in &mut r.completions {
            if c.finish.is_none() {
                if let Err(e) = c.detok.flush(&self.tokenizer) {
                    tracing::debug!("detokenizer: {e}");
                }
                c.finish = Some(FinishReason::Abort);
                c.changed = true;
            }
        }
        self.stats.record_finish(FinishReason::Abort);
        self.touched.retain(|&t| t != rid);
        self.send(rid);
        self.requests.remove(&rid);
    }

    /// Ends a request with an error (after any text it has not sent).
    pub fn fail(&mut self, rid: RequestId, err: EngineError) {
        if let Some(r) = self.requests.remove(&rid) {
            r.sink.fail(err);
        }
        self.touched.retain(|&t| t != rid);
    }

    /// Requests with text state.
    pub fn ids(&self) -> Vec<RequestId> {
        self.requests.keys().copied().collect()
    }
}
