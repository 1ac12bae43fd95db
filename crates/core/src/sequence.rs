//! Per-sequence mutable state: the tokens so far and how many of them the KV cache already holds.
//!
//! A request with `n` completions starts as one sequence and forks into `n` once its prompt is
//! computed; each completion is then its own sequence. Invariant:
//! `num_computed_tokens <= tokens.len()`, and the tokens not yet computed are exactly the ones the
//! scheduler still has to feed through the model.

use crate::kv_cache::hashing::{extend_hashes, root_hash, ExtraKeys, ImageKey};
use crate::kv_cache::BlockHash;
use crate::lora::{AdapterId, ResolvedLora};
use crate::multimodal::MmPrompt;
use crate::request::{RequestId, SamplingParams};
use std::fmt;
use std::sync::Arc;

/// Stands for a token sampled on the device and not read back yet: the next step's token ids get
/// its value on the device, and the engine writes it in once it arrives.
pub const PENDING_TOKEN: u32 = u32::MAX;

/// Identifier of one sequence (one completion of one request).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where a sequence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    Running,
    Finished,
}

/// Facts fixed for a request's whole life, shared by its sequences and read by the scheduler and
/// the model runner (so neither asks the engine's request maps). Later features add theirs here:
/// image spans, the grammar.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestMeta {
    /// Top alternatives per prompt position when prompt logprobs are asked for: every prompt
    /// position of a computed chunk is then a logit row.
    pub prompt_logprobs: Option<usize>,
    /// Top alternatives per generated token when logprobs are asked for (sampled on the host).
    pub logprobs: Option<usize>,
    /// Whether sampling reads the values of earlier output tokens (repetition, presence and
    /// frequency penalties), so no step may be planned before they are known.
    pub penalized: bool,
    /// The LoRA adapter of every row of the request (held until the request ends, so an
    /// adapter unloaded meanwhile stays usable by it).
    pub adapter: Option<ResolvedLora>,
    /// A tenant's key for the prefix cache: only requests with the same salt share blocks.
    pub cache_salt: Option<String>,
    /// The prompt's images: the encoder's inputs, their spans, M-RoPE positions.
    pub mm: Option<Arc<MmPrompt>>,
}

impl RequestMeta {
    pub fn of(params: &SamplingParams) -> Self {
        Self {
            prompt_logprobs: params.prompt_logprobs,
            logprobs: params.logprobs,
            penalized: params.repetition_penalty != 1.0
                || params.presence_penalty != 0.0
                || params.frequency_penalty != 0.0,
            adapter: None,
            cache_salt: None,
            mm: None,
        }
    }

    /// The root of the request's block-hash chain: its adapter and salt.
    pub fn hash_root(&self) -> BlockHash {
        root_hash(&ExtraKeys {
            adapter: self.adapter_id().map(|a| a.0),
            salt: self.cache_salt.as_deref(),
        })
    }

    /// The adapter's id, if the request uses one.
    pub fn adapter_id(&self) -> Option<AdapterId> {
        self.adapter.as_ref().map(|a| a.id)
    }

    /// Each image's (first token, tokens, content hash), for the block hashes of the blocks
    /// its tokens lie in.
    pub fn image_keys(&self) -> Vec<ImageKey> {
        self.mm.as_ref().map_or_else(Vec::new, |mm| {
            mm.spans
                .iter()
                .zip(&mm.images)
                .map(|(s, i)| ImageKey {
                    offset: s.offset,
                    len: s.len,
                    hash: i.hash,
                })
                .collect()
        })
    }
}

/// One sequence.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: SeqId,
    pub request_id: RequestId,
    /// Which completion of the request this is (0-based).
    pub index: usize,
    pub prompt_len: usize,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    pub num_computed_tokens: usize,
    pub status: SeqStatus,
    /// Further completions to fork from this one once its prompt is computed (`n - 1` at first).
    pub pending_forks: usize,
    /// How often this sequence was preempted.
    pub num_preemptions: usize,
    /// Placeholders ([`PENDING_TOKEN`]) at the end of `tokens`: tokens sampled on the device
    /// whose values are not read back yet.
    pub num_pending: usize,
    /// Content hashes of the full blocks of known tokens so far (prefix caching).
    pub block_hashes: Vec<BlockHash>,
    /// Prompt tokens found in the prefix cache when the sequence was first scheduled.
    pub num_cached_tokens: Option<usize>,
    pub meta: Arc<RequestMeta>,
}

impl Sequence {
    pub fn new(id: SeqId, request_id: RequestId, prompt: Vec<u32>, n: usize) -> Self {
        Self {
            id,
            request_id,
            index: 0,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed_tokens: 0,
            status: SeqStatus::Waiting,
            pending_forks: n.saturating_sub(1),
            num_preemptions: 0,
            num_pending: 0,
            block_hashes: Vec::new(),
            num_cached_tokens: None,
            meta: Arc::default(),
        }
    }

    /// Brings [`Sequence::block_hashes`] up to the full blocks of the known tokens.
    pub fn update_block_hashes(&mut self, block_size: usize) {
        let known = self.tokens.len() - self.num_pending;
        if known / block_size.max(1) > self.block_hashes.len() {
            let root = self.meta.hash_root();
            extend_hashes(
                &mut self.block_hashes,
                &root,
                &self.tokens[..known],
                &self.meta.image_keys(),
                block_size,
            );
        }
    }

    /// The sequence with its request's facts.
    pub fn with_meta(mut self, meta: Arc<RequestMeta>) -> Self {
        self.meta = meta;
        self
    }

    /// The tokens whose values are known: all but the placeholders at the end. A token becomes
    /// known in one place, [`crate::scheduler::Scheduler::set_token`]; whatever reads token
    /// values (block hashes, grammars, penalties) reads these.
    pub fn known_tokens(&self) -> &[u32] {
        &self.tokens[..self.tokens.len() - self.num_pending]
    }

    /// Prompt positions `< prompt_len - 1` among the next `num_new` tokens to compute: the rows
    /// of prompt logprobs such a chunk produces.
    pub fn prompt_logprob_rows(&self, num_new: usize) -> usize {
        if self.meta.prompt_logprobs.is_none() {
            return 0;
        }
        let end = (self.num_computed_tokens + num_new).min(self.prompt_len.saturating_sub(1));
        end.saturating_sub(self.num_computed_tokens)
    }

    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn output_tokens(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to be computed.
    pub fn num_uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed_tokens
    }
}
