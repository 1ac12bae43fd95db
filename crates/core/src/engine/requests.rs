//! The engine's bookkeeping of live requests: each request's parameters and facts, its
//! completions (their sequences, random streams and token counts), and which request and
//! completion every sequence belongs to.
//!
//! Owns no text: detokenizing, stop strings and what readers receive are the output processor's
//! ([`crate::output`]). A request leaves this registry once every completion is done (by EOS, a
//! stop token or string, length, or abort); it may still have text to send then.

use crate::lora::ResolvedLora;
use crate::output::Counted;
use crate::request::{EngineRequest, FinishReason, RequestId, SamplingParams, StopReason};
use crate::sampler::SeqRng;
use crate::sequence::{RequestMeta, SeqId};
use crate::structured::{CompiledGrammar, RowMatcher};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// One completion as the engine sees it.
pub(super) struct Completion {
    /// Its sequence while it runs (a completion of `n > 1` gets one at the fork).
    pub seq: Option<SeqId>,
    pub rng: SeqRng,
    /// Its place in the request's structured-output grammar, if it has one.
    pub matcher: Option<RowMatcher>,
    /// Tokens accepted so far.
    pub num_tokens: usize,
    pub done: bool,
}

pub(super) struct RequestState {
    pub params: SamplingParams,
    pub meta: Arc<RequestMeta>,
    pub prompt_len: usize,
    pub completions: Vec<Completion>,
    /// `max_tokens`, cut to what the context leaves.
    pub max_tokens: usize,
    pub arrival: Instant,
    /// Whether the time to the first scheduled step was reported.
    pub queued: bool,
    /// Prompt logprob entries produced so far (the first, `None`, counts).
    pub prompt_logprobs_done: usize,
    /// Its completions follow a grammar (each has a matcher).
    pub constrained: bool,
}

impl RequestState {
    pub fn finished(&self) -> bool {
        self.completions.iter().all(|c| c.done)
    }
}

/// What a request brings besides its parameters: its adapter and its compiled grammar.
pub(super) struct Attached {
    pub lora: Option<ResolvedLora>,
    pub grammar: Option<CompiledGrammar>,
}

/// Live requests, and the owner of every running sequence.
#[derive(Default)]
pub(super) struct Requests {
    map: HashMap<RequestId, RequestState>,
    owner: HashMap<SeqId, (RequestId, usize)>,
    next_seq: u64,
}

impl Requests {
    pub fn new_seq_id(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    /// Registers a request whose first sequence is `seq`; `seed` seeds completion 0's stream
    /// (completion `i` gets [`SeqRng::for_sample`]`(seed, i)`).
    pub fn admit(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        seq: SeqId,
        seed: u64,
        max_model_len: usize,
        with: Attached,
    ) -> &RequestState {
        let Attached { lora, grammar } = with;
        let p = req.params;
        let cache_salt = req.cache_salt;
        let mm = req.mm;
        let prompt_len = req.prompt_token_ids.len();
        let max_tokens = p
            .max_tokens
            .unwrap_or(usize::MAX)
            .min(max_model_len.saturating_sub(prompt_len));
        let completions = (0..p.n)
            .map(|i| Completion {
                seq: (i == 0).then_some(seq),
                rng: SeqRng::for_sample(seed, i),
                matcher: grammar.as_ref().map(CompiledGrammar::matcher),
                num_tokens: 0,
                done: false,
            })
            .collect();
        self.owner.insert(seq, (id, 0));
        let state = RequestState {
            meta: Arc::new(RequestMeta {
                adapter: lora,
                cache_salt,
                mm,
                ..RequestMeta::of(&p)
            }),
            prompt_logprobs_done: usize::from(p.prompt_logprobs.is_some()),
            params: p,
            prompt_len,
            completions,
            max_tokens,
            arrival: Instant::now(),
            queued: false,
            constrained: grammar.is_some(),
        };
        self.map.entry(id).insert_entry(state).into_mut()
    }

    pub fn get_mut(&mut self, id: RequestId) -> Option<&mut RequestState> {
        self.map.get_mut(&id)
    }

    /// The request and completion index of a running sequence.
    pub fn owner(&self, seq: SeqId) -> Option<(RequestId, usize)> {
        self.owner.get(&seq).copied()
    }

    /// The request a running sequence belongs to.
    pub fn of_seq(&self, seq: SeqId) -> Option<&RequestState> {
        self.owner(seq).and_then(|(rid, _)| self.map.get(&rid))
    }

    /// Gives completion `idx` of `rid` the forked sequence `seq`.
    pub fn attach(&mut self, rid: RequestId, idx: usize, seq: SeqId) {
        if let Some(c) = self
            .map
            .get_mut(&rid)
            .and_then(|st| st.completions.get_mut(idx))
        {
            c.seq = Some(seq);
            self.owner.insert(seq, (rid, idx));
        }
    }

    /// Counts a token accepted for completion `idx` of `rid` and decides the stops that need no
    /// text (stop token ids, EOS unless ignored, length).
    pub fn count_token(
        &mut self,
        rid: RequestId,
        idx: usize,
        token: u32,
        eos: &[u32],
        max_model_len: usize,
    ) -> Option<Counted> {
        let st = self.map.get_mut(&rid)?;
        let p = &st.params;
        let c = st.completions.get_mut(idx)?;
        c.num_tokens += 1;
        let n_out = c.num_tokens;
        let mut finish = None;
        if n_out >= p.min_tokens && p.stop_token_ids.contains(&token) {
            finish = Some((FinishReason::Stop, Some(StopReason::Token(token))));
        } else if n_out >= p.min_tokens && !p.ignore_eos && eos.contains(&token) {
            finish = Some((FinishReason::Stop, None));
        }
        let text = finish.is_none();
        // a token of a finished grammar is text, and nothing may follow it
        if finish.is_none() && !eos.contains(&token) {
            if let Some(m) = c.matcher.as_mut() {
                if m.advance(token) {
                    finish = Some((FinishReason::Stop, None));
                }
            }
        }
        let total = st.prompt_len + n_out;
        if finish.is_none() && (n_out >= st.max_tokens || total >= max_model_len) {
            finish = Some((FinishReason::Length, None));
        }
        if finish.is_some() {
            c.done = true;
        }
        Some(Counted {
            text,
            stops_active: n_out >= p.min_tokens,
            finish,
        })
    }

    /// Marks completion `idx` of `rid` done; returns its sequence if it was still running.
    pub fn end_completion(&mut self, rid: RequestId, idx: usize) -> Option<SeqId> {
        let c = self.map.get_mut(&rid)?.completions.get_mut(idx)?;
        c.done = true;
        let seq = c.seq?;
        self.owner.remove(&seq).map(|_| seq)
    }

    /// Forgets a sequence that ended (its completion is done).
    pub fn release(&mut self, seq: SeqId) {
        self.owner.remove(&seq);
    }

    /// Removes a request once all its completions are done; true if it was removed.
    pub fn remove_if_finished(&mut self, rid: RequestId) -> bool {
        if self.map.get(&rid).is_some_and(RequestState::finished) {
            self.remove(rid);
            return true;
        }
        false
    }

    /// Removes a request and its sequences' owners.
    pub fn remove(&mut self, rid: RequestId) -> Option<RequestState> {
        let st = self.map.remove(&rid)?;
        for c in &st.completions {
            if let Some(s) = c.seq {
                self.owner.remove(&s);
            }
        }
        Some(st)
    }

    pub fn ids(&self) -> Vec<RequestId> {
        self.map.keys().copied().collect()
    }
}
