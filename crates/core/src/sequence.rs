//! Per-sequence mutable state: the tokens so far and how many of them the KV cache already holds.
//!
//! A request with `n` completions starts as one sequence and forks into `n` once its prompt is
//! computed; each completion is then its own sequence. Invariant:
//! `num_computed_tokens <= tokens.len()`, and the tokens not yet computed are exactly the ones the
//! scheduler still has to feed through the model.

use crate::request::RequestId;
use std::fmt;

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
        }
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
