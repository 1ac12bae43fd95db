//! Continuous batching with one token budget per step (vLLM v1 semantics): there is no prefill or
//! decode phase; every step each running sequence asks for the tokens it has not computed yet
//! (a whole prompt, a chunk of it, or one decode token), then waiting sequences are admitted FCFS
//! with what is left of the budget.
//!
//! Owns the sequences, the waiting queue, the running list and the KV block tables. Pure: integer
//! ids and `Vec`s, no tensors, no clocks, no locks. When blocks run out the newest running sequence
//! is preempted by recompute (its blocks freed, its computed count reset, put back at the head of
//! the queue), so the oldest requests always make progress and nothing deadlocks as long as every
//! single request fits the cache on its own (checked at admission by the engine).
//!
//! Prefix caching (`enable_prefix_caching`): a sequence admitted with nothing computed starts from
//! the longest run of cached full blocks matching its known tokens (at least its last token is
//! computed again, for the logits). The full blocks a step will compute are registered when it
//! is planned, so sequences admitted later in the same step share them (blocks whose tokens were
//! still placeholders then are registered once known, at the latest when a step completes,
//! [`Scheduler::complete_step`]). Sequences that ask for prompt logprobs compute every position
//! (their rows need the logits), but still register their blocks for others.
//!
//! LoRA: the running sequences use at most `max_loras` distinct adapters (the device slots). A
//! waiting sequence whose adapter would exceed that stays in place; sequences behind it whose
//! adapter already runs (or that use none) may pass it for [`LORA_PASS_STEPS`] steps, after which
//! nothing is admitted before it.

use crate::kv_cache::{BlockId, KvCacheManager};
use crate::request::RequestId;
use crate::sequence::{SeqId, SeqStatus, Sequence, PENDING_TOKEN};
use std::collections::{HashMap, VecDeque};

/// Limits of the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Most prompt-logprob rows one step may produce (each is a full row of logits read back):
    /// prompt chunks of requests that ask for prompt logprobs are cut to fit.
    pub max_prompt_logprob_rows: usize,
    /// Most distinct LoRA adapters among the running sequences (`--max-loras`; `usize::MAX`
    /// without adapters).
    pub max_loras: usize,
    /// Whether computed blocks are cached by content and reused by later sequences.
    pub enable_prefix_caching: bool,
    /// Most image tokens whose images the vision encoder takes in one step (vLLM's encoder
    /// budget; `usize::MAX` for models without images): prompt chunks are cut before an image
    /// that would exceed it, except the step's first image.
    pub max_num_encoder_tokens: usize,
}

/// Prefix-cache lookups so far, in tokens (vLLM's `prefix_cache_queries` and `_hits`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheCounts {
    pub queries: u64,
    pub hits: u64,
}

/// Steps a waiting sequence held back by the adapter limit lets later sequences of adapters
/// already running pass it; after that admission waits for it (so it is never starved).
pub const LORA_PASS_STEPS: usize = 64;

/// `max_prompt_logprob_rows` for a vocabulary: 64 MiB of f32 logits a step, at least one row.
pub fn prompt_logprob_rows_for(vocab_size: usize) -> usize {
    ((64usize << 20) / (4 * vocab_size.max(1))).max(1)
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq_id: SeqId,
    /// Tokens already in the cache before this step.
    pub num_computed: usize,
    /// Tokens fed through the model in this step.
    pub num_new: usize,
    /// The step reaches the sequence's last token, so a new token is sampled.
    pub samples: bool,
}

/// What to run in one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    pub scheduled: Vec<ScheduledSeq>,
    /// Block copies `(src, dst)` to perform before the forward pass (copy-on-write).
    pub block_copies: Vec<(BlockId, BlockId)>,
    /// Sequences preempted in this step (their computed state was dropped).
    pub preempted: Vec<SeqId>,
    pub num_batched_tokens: usize,
}

impl SchedulerOutput {
    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }

    /// Records `num_new` of a sequence's `remaining` uncomputed tokens and its block copies.
    fn add(
        &mut self,
        seq_id: SeqId,
        num_computed: usize,
        num_new: usize,
        remaining: usize,
        copies: Vec<(BlockId, BlockId)>,
    ) {
        self.block_copies.extend(copies);
        self.scheduled.push(ScheduledSeq {
            seq_id,
            num_computed,
            num_new,
            samples: num_new == remaining,
        });
    }
}

/// The scheduler.
#[derive(Debug, Clone)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    kv: KvCacheManager,
    /// The waiting sequence held back by the adapter limit, and for how many steps.
    lora_blocked: Option<(SeqId, usize)>,
    prefix_counts: PrefixCacheCounts,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Self {
            kv: KvCacheManager::new(cfg.num_blocks, cfg.block_size),
            cfg,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            lora_blocked: None,
            prefix_counts: PrefixCacheCounts::default(),
        }
    }

    /// Prefix-cache lookups and hits so far.
    pub fn prefix_cache_counts(&self) -> PrefixCacheCounts {
        self.prefix_counts
    }

    /// Forgets every cached block content; returns how many blocks were cached.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.kv.reset_prefix_cache()
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn seq(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Queues a new sequence at the tail.
    pub fn add(&mut self, mut seq: Sequence) {
        seq.status = SeqStatus::Waiting;
        self.waiting.push_back(seq.id);
        self.seqs.insert(seq.id, seq);
    }

    /// Plans one step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut rows = self.cfg.max_prompt_logprob_rows.max(1);
        // image tokens the encoder takes this step
        let mut encoded = 0;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let num_computed = seq.num_computed_tokens;
            let remaining = seq.num_uncomputed();
            let chunk = (num_computed, remaining.min(budget), false);
            let num_new = self.fit_chunk(seq, chunk, &mut rows, &mut encoded);
            if num_new == 0 {
                i += 1;
                continue;
            }
            let mut self_preempted = false;
            let copies = loop {
                match self.kv.allocate_slots(id, num_computed, num_new) {
                    Ok(c) => break c,
                    Err(_) => {
                        let Some(victim) = self.running.pop() else {
                            self_preempted = true;
                            break Vec::new();
                        };
                        self.preempt(victim);
                        out.preempted.push(victim);
                        if victim == id {
                            self_preempted = true;
                            break Vec::new();
                        }
                    }
                }
            };
            if self_preempted {
                break;
            }
            out.add(id, num_computed, num_new, remaining, copies);
            self.cache_planned(id, num_computed + num_new);
            budget -= num_new;
            i += 1;
        }
        if out.preempted.is_empty() {
            let limited = self.cfg.max_loras < usize::MAX;
            let mut adapters = if limited {
                self.running_adapters()
            } else {
                Vec::new()
            };
            // position in the queue: sequences held back by the adapter limit stay in place
            let mut pos = 0;
            let mut blocked: Option<SeqId> = None;
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.get(pos) else {
                    break;
                };
                let Some(seq) = self.seqs.get(&id) else {
                    self.waiting.remove(pos);
                    continue;
                };
                let adapter = seq.meta.adapter_id().filter(|_| limited);
                if let Some(a) = adapter {
                    if !adapters.contains(&a) && adapters.len() >= self.cfg.max_loras {
                        // the first one held back may be passed, for a while, by sequences of
                        // adapters already running (or of none)
                        if blocked.is_none() {
                            if !self.may_pass(id) {
                                break;
                            }
                            blocked = Some(id);
                        }
                        pos += 1;
                        continue;
                    }
                }
                let hit = self.cached_prefix(id);
                let Some(seq) = self.seqs.get(&id) else {
                    break;
                };
                let num_computed = seq.num_computed_tokens.max(hit.len() * self.cfg.block_size);
                let remaining = seq.num_tokens() - num_computed;
                let (mut left, mut enc) = (rows, encoded);
                let chunk = (num_computed, remaining.min(budget), true);
                let num_new = self.fit_chunk(seq, chunk, &mut left, &mut enc);
                if num_new == 0 {
                    break;
                }
                if !hit.is_empty() && self.kv.adopt_prefix(id, &hit).is_err() {
                    break;
                }
                let Ok(copies) = self.kv.allocate_slots(id, num_computed, num_new) else {
                    if !hit.is_empty() {
                        self.kv.free(id);
                    }
                    break;
                };
                (rows, encoded) = (left, enc);
                let looked_up = self.looks_up(id);
                if let Some(s) = self.seqs.get_mut(&id) {
                    s.num_computed_tokens = num_computed;
                    if s.num_cached_tokens.is_none() {
                        s.num_cached_tokens = Some(hit.len() * self.cfg.block_size);
                        // vLLM's counters: only sequences that looked their prompt up
                        if looked_up {
                            self.prefix_counts.hits += (hit.len() * self.cfg.block_size) as u64;
                            self.prefix_counts.queries += s.known_tokens().len() as u64;
                        }
                    }
                }
                self.waiting.remove(pos);
                if let Some(a) = adapter.filter(|a| !adapters.contains(a)) {
                    adapters.push(a);
                }
                if self.lora_blocked.is_some_and(|(b, _)| b == id) {
                    self.lora_blocked = None;
                }
                self.running.push(id);
                if let Some(s) = self.seqs.get_mut(&id) {
                    s.status = SeqStatus::Running;
                }
                out.add(id, num_computed, num_new, remaining, copies);
                self.cache_planned(id, num_computed + num_new);
                budget -= num_new;
            }
        }
        out.num_batched_tokens = self.cfg.max_num_batched_tokens - budget;
        out
    }

    /// The names of the adapters of the running and of the waiting sequences (each sorted,
    /// without repeats).
    pub fn adapter_names(&self) -> (Vec<String>, Vec<String>) {
        let names = |ids: &mut dyn Iterator<Item = &SeqId>| {
            let mut v: Vec<String> = ids
                .filter_map(|id| {
                    Some(
                        self.seqs
                            .get(id)?
                            .meta
                            .adapter
                            .as_ref()?
                            .adapter
                            .name
                            .clone(),
                    )
                })
                .collect();
            v.sort();
            v.dedup();
            v
        };
        (
            names(&mut self.running.iter()),
            names(&mut self.waiting.iter()),
        )
    }

    /// The distinct adapters of the running sequences.
    fn running_adapters(&self) -> Vec<crate::lora::AdapterId> {
        let mut v: Vec<_> = self
            .running
            .iter()
            .filter_map(|id| self.seqs.get(id)?.meta.adapter_id())
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Whether sequences behind `id`, held back by the adapter limit, may still pass it: for
    /// [`LORA_PASS_STEPS`] steps after it was first held back.
    fn may_pass(&mut self, id: SeqId) -> bool {
        let steps = match self.lora_blocked {
            Some((b, n)) if b == id => n + 1,
            _ => 1,
        };
        self.lora_blocked = Some((id, steps));
        steps <= LORA_PASS_STEPS
    }

    /// Whether a waiting sequence looks its tokens up in the prefix cache: with caching on, from
    /// nothing computed, and without prompt logprobs (whose rows need every position computed).
    fn looks_up(&self, id: SeqId) -> bool {
        self.cfg.enable_prefix_caching
            && self
                .seqs
                .get(&id)
                .is_some_and(|s| s.num_computed_tokens == 0 && s.meta.prompt_logprobs.is_none())
    }

    /// The cached blocks a waiting sequence may start from: the longest run matching its full
    /// blocks of known tokens, short of its last token (computed again for its logits). Empty
    /// unless it [looks them up](Self::looks_up).
    fn cached_prefix(&mut self, id: SeqId) -> Vec<BlockId> {
        let bs = self.cfg.block_size;
        if !self.looks_up(id) {
            return Vec::new();
        }
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Vec::new();
        };
        seq.update_block_hashes(bs);
        let usable = seq.known_tokens().len().saturating_sub(1) / bs.max(1);
        let n = usable.min(seq.block_hashes.len());
        self.kv.cached_prefix(&seq.block_hashes[..n])
    }

    /// Cuts a chunk `(num_computed, num_new, admitted)` of `seq` to what the step's limits
    /// leave: the prompt-logprob rows, then the encoder budget; takes both for the chunk kept.
    fn fit_chunk(
        &self,
        seq: &Sequence,
        (num_computed, num_new, admitted): (usize, usize, bool),
        rows: &mut usize,
        encoded: &mut usize,
    ) -> usize {
        let mut left = *rows;
        let n = Self::fit_rows(seq, num_new, &mut left);
        let n = self.fit_encoder(seq, num_computed, n, admitted, encoded);
        // a shorter chunk produces no more rows than the one that fit
        *rows -= seq.prompt_logprob_rows(n).min(*rows);
        n
    }

    /// Cuts a chunk of `num_new` tokens after `num_computed` so that the images the vision
    /// encoder takes for it fit the step's encoder budget, of which `used` image tokens are
    /// taken (adding the chunk's). An image is encoded in the step that schedules its first
    /// token, and also, in a sequence's first step after admission (`admitted`), when the chunk
    /// starts inside it (after a prefix-cache hit). The chunk is cut before the first image that
    /// would pass the budget, unless it is the step's first image (a single image always fits:
    /// the engine sets the budget to at least the largest image). Counts are conservative: an
    /// image kept from before a preemption counts again.
    fn fit_encoder(
        &self,
        seq: &Sequence,
        num_computed: usize,
        num_new: usize,
        admitted: bool,
        used: &mut usize,
    ) -> usize {
        let Some(mm) = seq.meta.mm.as_deref() else {
            return num_new;
        };
        let budget = self.cfg.max_num_encoder_tokens;
        let mut need = 0;
        let mut n = num_new;
        for (_, span) in mm.images_in(num_computed, num_computed + num_new) {
            if span.offset < num_computed && !admitted {
                continue;
            }
            let taken = *used + need;
            if taken > 0 && taken.saturating_add(span.len) > budget {
                n = span.offset.saturating_sub(num_computed);
                break;
            }
            need += span.len;
        }
        *used += need;
        n
    }

    /// Cuts `num_new` so that the prompt-logprob rows it produces fit in `rows` (taking them).
    /// A chunk with rows to produce and none left is cut to nothing.
    fn fit_rows(seq: &Sequence, num_new: usize, rows: &mut usize) -> usize {
        let wanted = seq.prompt_logprob_rows(num_new);
        if wanted <= *rows {
            *rows -= wanted;
            return num_new;
        }
        // the rows are the chunk's first positions: `rows` of them leave a chunk of that length
        let cut = *rows;
        *rows = 0;
        cut
    }

    /// With prefix caching, registers the full blocks of known tokens that `id` will hold once
    /// its first `upto` tokens are computed, when the step is planned (as vLLM does at
    /// allocation): a sequence admitted later in the same step starts from them instead of
    /// computing them again, since every layer writes the step's keys and values before any row
    /// attends. A step that is planned but not run must not leave them: the engine forgets the
    /// cache when it fails a step.
    fn cache_planned(&mut self, id: SeqId, upto: usize) {
        if !self.cfg.enable_prefix_caching {
            return;
        }
        let bs = self.cfg.block_size;
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.update_block_hashes(bs);
            self.kv
                .cache_full_blocks(id, &seq.block_hashes, upto / bs.max(1));
        }
    }

    fn preempt(&mut self, id: SeqId) {
        self.kv.free(id);
        if let Some(s) = self.seqs.get_mut(&id) {
            s.num_computed_tokens = 0;
            s.status = SeqStatus::Waiting;
            s.num_preemptions += 1;
        }
        self.waiting.push_front(id);
    }

    /// Records that the planned tokens of a step are now in the cache (and, with prefix caching,
    /// the contents of the blocks they filled).
    pub fn complete_step(&mut self, out: &SchedulerOutput) {
        let bs = self.cfg.block_size;
        for s in &out.scheduled {
            if let Some(seq) = self.seqs.get_mut(&s.seq_id) {
                seq.num_computed_tokens = (s.num_computed + s.num_new).min(seq.tokens.len());
                if self.cfg.enable_prefix_caching {
                    seq.update_block_hashes(bs);
                    let full = seq.num_computed_tokens / bs.max(1);
                    self.kv.cache_full_blocks(s.seq_id, &seq.block_hashes, full);
                }
            }
        }
    }

    /// Appends a sampled token to a sequence.
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens.push(token);
        }
    }

    /// Appends a placeholder ([`PENDING_TOKEN`]) for a token still being sampled on the device, so
    /// the next step can be planned before it is read back.
    pub fn reserve_token(&mut self, id: SeqId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens.push(PENDING_TOKEN);
            seq.num_pending += 1;
        }
    }

    /// Sets token `index` of a sequence (a placeholder's value), or appends it when `index` is the
    /// sequence's length. The one place a token's value becomes known
    /// ([`Sequence::known_tokens`]); placeholders are resolved in order.
    pub fn set_token(&mut self, id: SeqId, index: usize, token: u32) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            match seq.tokens.get_mut(index) {
                Some(t) => {
                    if *t == PENDING_TOKEN && seq.num_pending > 0 {
                        seq.num_pending -= 1;
                    }
                    *t = token;
                }
                None => seq.tokens.push(token),
            }
        }
    }

    /// Splits `parent` into itself plus one child per id in `children`, sharing its KV blocks. Each
    /// child copies the parent's tokens; the caller appends each one's own sampled token.
    pub fn fork(&mut self, parent: SeqId, children: &[SeqId]) {
        let Some(p) = self.seqs.get_mut(&parent) else {
            return;
        };
        p.pending_forks = 0;
        let template = p.clone();
        for (k, &cid) in children.iter().enumerate() {
            let mut c = template.clone();
            c.id = cid;
            c.index = template.index + k + 1;
            self.kv.fork(parent, cid);
            self.seqs.insert(cid, c);
            match template.status {
                SeqStatus::Running => self.running.push(cid),
                _ => self.waiting.push_back(cid),
            }
        }
    }

    /// Ends a sequence and frees its blocks; returns it.
    pub fn finish(&mut self, id: SeqId) -> Option<Sequence> {
        self.kv.free(id);
        self.running.retain(|&s| s != id);
        self.waiting.retain(|&s| s != id);
        let mut seq = self.seqs.remove(&id)?;
        seq.status = SeqStatus::Finished;
        Some(seq)
    }

    /// Ends every sequence of a request; returns their ids.
    pub fn abort_request(&mut self, request: RequestId) -> Vec<SeqId> {
        let ids: Vec<SeqId> = self
            .seqs
            .values()
            .filter(|s| s.request_id == request)
            .map(|s| s.id)
            .collect();
        for &id in &ids {
            self.finish(id);
        }
        ids
    }

    /// Inconsistencies between sequences, queues and blocks (empty when sound).
    pub fn check_integrity(&self) -> Vec<String> {
        let mut errs = self.kv.check_integrity();
        for (id, s) in &self.seqs {
            let in_run = self.running.contains(id);
            let in_wait = self.waiting.contains(id);
            if in_run == in_wait {
                errs.push(format!("seq {id}: running={in_run} waiting={in_wait}"));
            }
            if s.num_computed_tokens > s.tokens.len() {
                errs.push(format!(
                    "seq {id}: computed {} > tokens {}",
                    s.num_computed_tokens,
                    s.tokens.len()
                ));
            }
            let held = self.kv.block_table(*id).len();
            if held < self.kv.blocks_for(s.num_computed_tokens) {
                errs.push(format!(
                    "seq {id}: {} computed tokens in {held} blocks",
                    s.num_computed_tokens
                ));
            }
        }
        if self.kv.num_tables() > self.seqs.len() {
            errs.push("block tables of finished sequences remain".into());
        }
        errs
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "scheduler_encoder_tests.rs"]
mod encoder_tests;
