//! Async scheduling's moving part: a step whose tokens were sampled on the device and not read
//! back yet (or, to exercise the same bookkeeping on a CPU, sampled on the host and not taken
//! in yet). Its sequences that go on hold placeholders ([`crate::sequence::PENDING_TOKEN`]), the
//! next step is planned and issued at once, [`Engine::feed_pending`] writes the sampled ids into
//! that step's token ids on the device, and [`Engine::collect_in_flight`] takes the ids in (while
//! the device runs the step after) and resolves the placeholders.

use super::Engine;
use crate::model_runner::PreparedStep;
use crate::request::TokenLogprob;
use crate::sequence::SeqId;
use candle_core::Tensor;
use rserve_kernels::sampling::PendingSample;
use std::collections::HashMap;

/// A step's sampled tokens, not accepted yet.
pub(super) enum Sampled {
    /// On their way from the device.
    Device(PendingSample),
    /// Sampled on the host already (planning ahead on a CPU: the same bookkeeping as a GPU's,
    /// see [`crate::engine::EngineConfig::lookahead_on_host`]): (token, logprob) per row.
    Host(Vec<(u32, f32)>),
}

/// Tokens sampled and not taken in yet.
pub(super) struct InFlight {
    pub sampled: Sampled,
    /// Per sampled row: its sequence and the index its token takes among the sequence's tokens.
    pub rows: Vec<(SeqId, usize)>,
}

impl Engine {
    /// Writes the tokens of `pending` rows (still being sampled by the step in flight) into the
    /// step's token ids on the device.
    pub(super) fn feed_pending(
        &self,
        step: &PreparedStep,
        pending: &[(u32, SeqId, usize)],
    ) -> candle_core::Result<()> {
        if pending.is_empty() {
            return Ok(());
        }
        let Some(f) = &self.in_flight else {
            candle_core::bail!("{} rows wait for tokens no step is sampling", pending.len());
        };
        let src: HashMap<(SeqId, usize), u32> = f
            .rows
            .iter()
            .zip(0u32..)
            .map(|(&key, row)| (key, row))
            .collect();
        let pairs = pending
            .iter()
            .map(|&(row, seq, pos)| {
                src.get(&(seq, pos)).map(|&s| (row, s)).ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "token {pos} of sequence {seq} is not being sampled"
                    ))
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let dst = self.runner.token_ids(step)?;
        match &f.sampled {
            Sampled::Device(p) => p.write_tokens(&dst, &pairs),
            Sampled::Host(tokens) => {
                for &(row, src) in &pairs {
                    let Some(&(tok, _)) = tokens.get(src as usize) else {
                        candle_core::bail!("no sampled row {src}");
                    };
                    let one = Tensor::from_slice(&[tok], 1, dst.device())?;
                    dst.slice_set(&one, 0, row as usize)?;
                }
                Ok(())
            }
        }
    }

    /// Takes in the tokens of the step in flight, if any (waiting for them).
    pub(super) fn collect_in_flight(&mut self) {
        if let Some(f) = self.in_flight.take() {
            self.collect(f);
        }
    }

    /// Waits for a step's sampled tokens and accepts them where their placeholders are.
    pub(super) fn collect(&mut self, f: InFlight) {
        let picked = match f.sampled {
            Sampled::Device(p) => p.wait(&mut self.readback),
            Sampled::Host(tokens) => Ok(tokens),
        };
        match picked {
            Ok(picked) => {
                for (&(seq, at), (token_id, logprob)) in f.rows.iter().zip(picked) {
                    let tl = TokenLogprob {
                        token_id,
                        logprob,
                        top: Vec::new(),
                        rank: None,
                    };
                    self.accept_token_at(seq, at, tl);
                }
            }
            Err(e) => {
                tracing::error!("reading sampled tokens failed: {e}");
                self.fail_all(crate::engine::EngineError::Model(e.to_string()));
            }
        }
    }
}
