//! One engine step: plan (scheduler), build and run the forward pass (model runner), sample, and
//! accept the tokens.
//!
//! Sampling is decided per row ([`crate::sampler`] holds the policy): a row whose request wants
//! top-N logprobs is sampled on the host, every other row on the device when there is one, and
//! prompt-logprob rows are log-softmaxed on the device before they are read. Both samplers follow
//! the same rules and draw with the same counter hash, so a seeded request's tokens do not depend
//! on what else is in the step. When every row is sampled on the device with nothing that reads
//! earlier output values (penalties), forks or prompt rows, the next step is planned before the
//! tokens are read ([`super::in_flight`]).

use super::in_flight::{InFlight, Sampled};
use super::{Engine, EngineError};
use crate::lora::{AdapterId, ResolvedLora};
use crate::model_runner::LogitRow;
use crate::request::RequestId;
use crate::request::TokenLogprob;
use crate::sampler::{self, RowSampling};
use crate::scheduler::SchedulerOutput;
use crate::sequence::SeqId;
use crate::structured::RowMatcher;
use candle_core::{Tensor, D};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// One token to sample: from logits row `row`, for `seq`.
struct Job {
    row: u32,
    seq: SeqId,
    sampling: RowSampling,
    /// Top alternatives wanted with the token (host sampler only).
    logprobs: Option<usize>,
    /// Sampled on the device (a GPU, and no top alternatives wanted).
    device: bool,
    /// The request's sampling reads earlier output values (penalties).
    penalized: bool,
}

/// `logits` rows `rows` as one tensor (the same tensor when they are all of its rows, in order).
fn select_rows(logits: &Tensor, rows: &[u32]) -> candle_core::Result<Tensor> {
    let identity = rows.len() == logits.dim(0)? && rows.iter().zip(0u32..).all(|(&r, i)| r == i);
    if identity {
        return Ok(logits.clone());
    }
    let idx = Tensor::from_slice(rows, rows.len(), logits.device())?;
    logits.index_select(&idx, 0)
}

impl Engine {
    pub(super) fn step(&mut self) {
        self.profile.tick(self.runner.device());
        let started = Instant::now();
        self.step_inner();
        self.timing.finish(started);
    }

    fn step_inner(&mut self) {
        let out = self.scheduler.schedule();
        if out.is_empty() {
            // Only possible when every running sequence was preempted this step; the next call
            // admits them again. Tokens of the steps before still go out now.
            self.collect_in_flight();
            self.settle();
            return;
        }
        self.stats
            .preemptions
            .fetch_add(out.preempted.len() as u64, Ordering::Relaxed);
        let now = Instant::now();
        for s in &out.scheduled {
            let Some((rid, _)) = self.requests.owner(s.seq_id) else {
                continue;
            };
            if let Some(st) = self.requests.get_mut(rid) {
                if !st.queued {
                    st.queued = true;
                    let waited = now.duration_since(st.arrival).as_secs_f64();
                    let cached = self
                        .scheduler
                        .seq(s.seq_id)
                        .and_then(|q| q.num_cached_tokens)
                        .unwrap_or(0);
                    self.output.first_step(rid, waited, cached);
                }
            }
        }
        let placed = match self.place_adapters(&out) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!("placing LoRA adapters failed: {e}");
                self.fail_all(EngineError::Model(e.to_string()));
                return;
            }
        };
        let encoded_before = self.runner.images_encoded();
        let prepared = self.runner.prepare(&self.scheduler, &out, placed.as_ref());
        let encoded = self.runner.images_encoded();
        self.stats.images_encoded.store(encoded, Ordering::Relaxed);
        self.timing.prepared = Some(Instant::now());
        let result = prepared.and_then(|(step, rows, pending)| {
            let run = self.feed_pending(&step, &pending).and_then(|()| {
                if !pending.is_empty() {
                    // the other ranks of a tensor-parallel group take these tokens from this one
                    self.runner.share_tokens(&step)?;
                }
                self.runner.execute(&out, &step)
            });
            if let Err(e) = &run {
                // the other ranks are running this step already
                self.runner.stop_followers(&e.to_string());
            }
            Ok((run?, rows))
        });
        self.timing.issued = Some(Instant::now());
        self.timing.tokens += out.num_batched_tokens;
        self.timing.shape = (
            out.scheduled.len(),
            out.num_batched_tokens,
            out.scheduled.iter().filter(|s| s.num_new == 1).count(),
            encoded.saturating_sub(encoded_before),
        );
        let (logits, rows) = match result {
            Ok(x) => x,
            Err(e) => {
                tracing::error!("forward pass failed: {e}");
                self.fail_all(EngineError::Model(e.to_string()));
                return;
            }
        };
        self.scheduler.complete_step(&out);
        if let Err(e) = self.sample_step(&logits, &rows) {
            tracing::error!("sampling failed: {e}");
            self.fail_all(EngineError::Model(e.to_string()));
        }
    }

    /// Puts the adapters of the step's sequences into device slots (writing those not resident);
    /// each one's slot, or `None` when no sequence of the step uses an adapter.
    fn place_adapters(
        &mut self,
        out: &SchedulerOutput,
    ) -> candle_core::Result<Option<HashMap<AdapterId, u32>>> {
        let Some(dev) = self.adapters.as_mut() else {
            return Ok(None);
        };
        let mut used: Vec<ResolvedLora> = Vec::new();
        for s in &out.scheduled {
            if let Some(a) = self
                .scheduler
                .seq(s.seq_id)
                .and_then(|q| q.meta.adapter.as_ref())
            {
                if !used.iter().any(|u| u.id == a.id) {
                    used.push(a.clone());
                }
            }
        }
        if used.is_empty() {
            return Ok(None);
        }
        let ids: Vec<AdapterId> = used.iter().map(|u| u.id).collect();
        let placement = dev.table.assign(&ids).map_err(candle_core::Error::Msg)?;
        for (slot, id) in &placement.writes {
            let adapter = used.iter().find(|u| u.id == *id).map(|u| &*u.adapter);
            dev.slots.write(*slot, adapter)?;
        }
        Ok(Some(placement.slot_of))
    }

    /// Writes the first of `names` into free device slots (at start every slot is free, and at
    /// most that many are taken), so their first requests find them resident. An adapter that
    /// does not resolve or write is logged and left to its first request, which reports it.
    pub(super) fn preload_adapters(&mut self, names: &[String]) {
        let (Some(dev), Some(registry)) = (self.adapters.as_mut(), self.info.lora.as_ref()) else {
            return;
        };
        let started = std::time::Instant::now();
        let mut written = 0;
        for name in names.iter().take(dev.table.resident().len()) {
            let resolved = match registry.resolve(name) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("LoRA adapter `{name}` not preloaded: {e}");
                    continue;
                }
            };
            let placement = match dev.table.assign(&[resolved.id]) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!("LoRA adapter `{name}` not preloaded: {e}");
                    continue;
                }
            };
            for (slot, _) in placement.writes {
                if let Err(e) = dev.slots.write(slot, Some(&resolved.adapter)) {
                    tracing::warn!("LoRA adapter `{name}` not preloaded: {e}");
                    dev.table.evict(resolved.id);
                } else {
                    written += 1;
                }
            }
        }
        if written > 0 {
            tracing::info!(
                "LoRA: {written} adapters written into device slots in {:.0} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
    }

    /// Samples a step's rows and accepts the tokens (or, planning ahead, leaves them in flight).
    fn sample_step(&mut self, logits: &Tensor, rows: &[LogitRow]) -> candle_core::Result<()> {
        let gpu = !self.runner.device().is_cpu();
        // a grammar must have followed every earlier token before it masks this step's rows
        let constrained = rows.iter().any(|r| match *r {
            LogitRow::Sample(seq) => self.requests.of_seq(seq).is_some_and(|st| st.constrained),
            LogitRow::PromptLogprob { .. } => false,
        });
        if constrained {
            self.collect_in_flight();
        }
        let (mut jobs, forked) = self.plan_jobs(rows, gpu);
        if constrained {
            self.mask_rows(logits, &jobs)?;
        }
        let prompt_rows: Vec<(u32, SeqId, usize)> = rows
            .iter()
            .zip(0u32..)
            .filter_map(|(r, i)| match *r {
                LogitRow::PromptLogprob { seq, pos } => Some((i, seq, pos)),
                LogitRow::Sample(_) => None,
            })
            .collect();
        let plain = !forked
            && prompt_rows.is_empty()
            && jobs.iter().all(|j| j.logprobs.is_none() && !j.penalized);
        let ahead = self.async_scheduling
            && plain
            && !jobs.is_empty()
            && if gpu {
                jobs.iter().all(|j| j.device)
            } else {
                self.host_lookahead
            };
        // the device's rows are queued first, so the host's work below overlaps them
        let device_rows: Vec<u32> = jobs.iter().filter(|j| j.device).map(|j| j.row).collect();
        let pending = if device_rows.is_empty() {
            None
        } else {
            let settings: Vec<RowSampling> = jobs
                .iter_mut()
                .filter(|j| j.device)
                .map(|j| std::mem::take(&mut j.sampling))
                .collect();
            let selected = select_rows(logits, &device_rows)?;
            Some(rserve_kernels::sampling::sample_rows_async(
                &selected,
                &settings,
                &mut self.readback,
            )?)
        };
        if ahead {
            let sampled = match pending {
                Some(p) => Sampled::Device(p),
                None => Sampled::Host(
                    self.sample_on_host(logits, &jobs.iter().collect::<Vec<_>>())?
                        .into_iter()
                        .map(|t| (t.token_id, t.logprob))
                        .collect(),
                ),
            };
            let targets: Vec<(SeqId, usize)> = jobs
                .iter()
                .map(|j| {
                    let at = self.scheduler.seq(j.seq).map_or(0, |s| s.tokens.len());
                    (j.seq, at)
                })
                .collect();
            // sequences that go on hold a placeholder, so the next step can be planned now
            let mut reserved = false;
            for &(seq, _) in &targets {
                if !self.ends_by_length(seq) {
                    self.scheduler.reserve_token(seq);
                    reserved = true;
                }
            }
            let this = InFlight {
                sampled,
                rows: targets,
            };
            // the device runs this step while the step before's tokens are taken in and become
            // text
            self.collect_in_flight();
            if reserved {
                self.stats.steps_ahead.fetch_add(1, Ordering::Relaxed);
                self.in_flight = Some(this);
                self.timing.sampled = Some(Instant::now());
                self.settle_overlapped();
            } else {
                self.settle_overlapped();
                self.collect(this);
                self.timing.sampled = Some(Instant::now());
                if !self.scheduler.has_work() {
                    self.settle();
                }
            }
            return Ok(());
        }
        self.collect_in_flight();
        self.settle_overlapped();
        if let Err(e) = self.prompt_logprobs(logits, &prompt_rows) {
            // only the requests that asked for them fail
            tracing::error!("prompt logprobs failed: {e}");
            let mut ids: Vec<_> = prompt_rows
                .iter()
                .filter_map(|&(_, seq, _)| self.requests.owner(seq).map(|(rid, _)| rid))
                .collect();
            ids.sort_unstable();
            ids.dedup();
            for rid in ids {
                self.fail_request(rid, EngineError::Model(format!("prompt logprobs: {e}")));
            }
        }
        let host_jobs: Vec<&Job> = jobs.iter().filter(|j| !j.device).collect();
        let mut host = self.sample_on_host(logits, &host_jobs)?.into_iter();
        let mut device = match pending {
            Some(p) => p.wait(&mut self.readback)?.into_iter(),
            None => Vec::new().into_iter(),
        };
        self.timing.sampled = Some(Instant::now());
        let had_host = !host_jobs.is_empty() || !prompt_rows.is_empty();
        for (seq, d) in jobs.iter().map(|j| (j.seq, j.device)).collect::<Vec<_>>() {
            let tl = if d {
                device.next().map(|(token_id, logprob)| TokenLogprob {
                    token_id,
                    logprob,
                    top: Vec::new(),
                    rank: None,
                })
            } else {
                host.next()
            };
            if let Some(tl) = tl {
                self.accept_token(seq, tl);
            }
        }
        // with another step to come on a device, the text work overlaps it
        if had_host || !self.scheduler.has_work() {
            self.settle();
        }
        Ok(())
    }

    /// The step's tokens to sample, in row order, and whether a request forked: forks happen
    /// here (the children share their parent's row), and each completion's settings draw from
    /// its own random stream. On a GPU (`gpu`) a job that wants no top alternatives runs there.
    fn plan_jobs(&mut self, rows: &[LogitRow], gpu: bool) -> (Vec<Job>, bool) {
        let mut jobs = Vec::with_capacity(rows.len());
        let mut forked = false;
        for (row, r) in (0u32..).zip(rows) {
            let LogitRow::Sample(seq) = *r else {
                continue;
            };
            let forks = self.scheduler.seq(seq).map_or(0, |s| s.pending_forks);
            let mut seqs = vec![seq];
            if forks > 0 {
                forked = true;
                let children: Vec<SeqId> = (0..forks).map(|_| self.requests.new_seq_id()).collect();
                self.scheduler.fork(seq, &children);
                if let Some((rid, _)) = self.requests.owner(seq) {
                    for (k, &c) in children.iter().enumerate() {
                        self.requests.attach(rid, k + 1, c);
                    }
                    seqs.extend(&children);
                }
            }
            for s in seqs {
                if let Some(job) = self.job(row, s, gpu) {
                    jobs.push(job);
                }
            }
        }
        (jobs, forked)
    }

    fn job(&mut self, row: u32, seq: SeqId, gpu: bool) -> Option<Job> {
        let (rid, idx) = self.requests.owner(seq)?;
        let s = self.scheduler.seq(seq)?;
        let st = self.requests.get_mut(rid)?;
        let p = &st.params;
        let known = s.known_tokens();
        let (prompt, output) = known.split_at(s.prompt_len.min(known.len()));
        let suppress: Vec<u32> = if s.num_output_tokens() < p.min_tokens {
            let eos = &self.info.generation.eos_token_ids;
            p.stop_token_ids.iter().chain(eos).copied().collect()
        } else {
            Vec::new()
        };
        let c = st.completions.get_mut(idx)?;
        let sampling = sampler::row_sampling(p, prompt, output, &suppress, &mut c.rng);
        Some(Job {
            row,
            seq,
            sampling,
            logprobs: p.logprobs,
            device: gpu && p.logprobs.is_none(),
            penalized: st.meta.penalized,
        })
    }

    /// Masks the logits rows of constrained jobs with what their grammars allow next. The masks
    /// are computed on the host (over rayon's pool when there are several) while the device still
    /// runs the forward pass, then applied on the device; a forked row is masked once (its
    /// completions start from the same grammar state).
    fn mask_rows(&mut self, logits: &Tensor, jobs: &[Job]) -> candle_core::Result<()> {
        let started = Instant::now();
        let mut rows: Vec<u32> = Vec::new();
        let mut held: Vec<(RequestId, usize, RowMatcher)> = Vec::new();
        for j in jobs {
            if rows.contains(&j.row) {
                continue;
            }
            let Some((rid, idx)) = self.requests.owner(j.seq) else {
                continue;
            };
            let Some(m) = self
                .requests
                .get_mut(rid)
                .and_then(|st| st.completions.get_mut(idx))
                .and_then(|c| c.matcher.take())
            else {
                continue;
            };
            rows.push(j.row);
            held.push((rid, idx, m));
        }
        let words = logits.dim(1)?.div_ceil(32);
        let mut masks = vec![0u32; held.len() * words];
        if held.len() > 1 {
            masks
                .par_chunks_mut(words)
                .zip(held.par_iter_mut())
                .for_each(|(out, (_, _, m))| m.mask_into(out));
        } else if let Some((_, _, m)) = held.first_mut() {
            m.mask_into(&mut masks);
        }
        let n = held.len();
        for (rid, idx, m) in held {
            if let Some(c) = self
                .requests
                .get_mut(rid)
                .and_then(|st| st.completions.get_mut(idx))
            {
                c.matcher = Some(m);
            }
        }
        self.stats.record_masks(n, started.elapsed());
        rserve_kernels::sampling::apply_token_bitmask(
            logits,
            &rows,
            &masks,
            words,
            &mut self.readback,
        )
    }

    /// Reads the jobs' rows (a forked row once per job) and samples them on the host.
    fn sample_on_host(
        &self,
        logits: &Tensor,
        jobs: &[&Job],
    ) -> candle_core::Result<Vec<TokenLogprob>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<u32> = jobs.iter().map(|j| j.row).collect();
        let mut values = select_rows(logits, &rows)?.to_vec2::<f32>()?;
        let plans: Vec<(&RowSampling, usize)> = jobs
            .iter()
            .map(|j| (&j.sampling, j.logprobs.unwrap_or(0)))
            .collect();
        Ok(sampler::sample_rows_host(&mut values, &plans))
    }

    /// Prompt logprobs of the step's prompt rows: log-softmax on the device, then each row's next
    /// prompt token and top alternatives are read on the host.
    fn prompt_logprobs(
        &mut self,
        logits: &Tensor,
        rows: &[(u32, SeqId, usize)],
    ) -> candle_core::Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let idx: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let selected = select_rows(logits, &idx)?;
        let lp = candle_nn::ops::log_softmax(&selected, D::Minus1)?.to_vec2::<f32>()?;
        for (values, &(_, seq, pos)) in lp.iter().zip(rows) {
            let Some((rid, _)) = self.requests.owner(seq) else {
                continue;
            };
            let Some(next) = self
                .scheduler
                .seq(seq)
                .and_then(|s| s.tokens.get(pos + 1).copied())
            else {
                continue;
            };
            let Some(st) = self.requests.get_mut(rid) else {
                continue;
            };
            // a recomputed (preempted) prompt produces its rows again: each is taken once
            if st.prompt_logprobs_done == pos + 1 {
                st.prompt_logprobs_done += 1;
                let entry = sampler::prompt_logprob_of(values, next, st.params.prompt_logprobs);
                self.output.prompt_logprob(rid, entry);
            }
        }
        Ok(())
    }

    /// Whether the token being sampled for `seq` ends it by length whatever its value (so no step
    /// is planned past it).
    fn ends_by_length(&self, seq: SeqId) -> bool {
        let Some(s) = self.scheduler.seq(seq) else {
            return true;
        };
        let max_tokens = self.requests.of_seq(seq).map_or(0, |st| st.max_tokens);
        s.num_output_tokens() + 1 >= max_tokens || s.num_tokens() + 1 >= self.info.max_model_len
    }

    /// Appends a sampled token to its sequence.
    fn accept_token(&mut self, seq: SeqId, tl: TokenLogprob) {
        let at = self.scheduler.seq(seq).map_or(0, |s| s.tokens.len());
        self.accept_token_at(seq, at, tl);
    }

    /// Accepts the token at index `at` of a sequence (a placeholder's, or appended at the end):
    /// the stops that need no text end the completion now; the text waits for `settle`.
    pub(super) fn accept_token_at(&mut self, seq: SeqId, at: usize, tl: TokenLogprob) {
        let Some((rid, idx)) = self.requests.owner(seq) else {
            return;
        };
        self.scheduler.set_token(seq, at, tl.token_id);
        self.stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
        let eos = &self.info.generation.eos_token_ids;
        let max_len = self.info.max_model_len;
        let Some(counted) = self
            .requests
            .count_token(rid, idx, tl.token_id, eos, max_len)
        else {
            return;
        };
        let ended = counted.finish.is_some();
        if ended {
            self.scheduler.finish(seq);
            self.requests.release(seq);
        }
        self.output.token(rid, idx, tl, counted);
        if ended {
            self.requests.remove_if_finished(rid);
        }
    }
}
