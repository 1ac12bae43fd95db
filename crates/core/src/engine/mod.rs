//! The engine: one thread that owns the scheduler, the model runner, the KV cache and every
//! request's state, and steps them; and [`EngineHandle`], the cloneable way in for HTTP, Python and
//! the CLI (`submit` -> a stream of outputs, `abort`).
//!
//! One owner: nothing outside the engine thread touches engine state; callers talk to it through a
//! channel and receive [`RequestOutput`]s on a per-request channel. Requests are validated at
//! `submit` (before they reach the thread), so the loop only sees requests it can finish.
//!
//! Async scheduling (on a GPU, [`EngineConfig::async_scheduling`]): when a step's tokens are
//! sampled on the device and no row's sampling depends on earlier output values (penalties), each
//! sequence that goes on gets a placeholder token ([`crate::sequence::PENDING_TOKEN`]) and the
//! next step is planned and issued at once; the sampled ids reach its token ids on the device, and
//! the host reads them while that step runs. A sequence the tokens end (EOS, a stop token or
//! string) has had one more row computed, which is dropped; one that ends by length is not
//! planned past its last token.

use crate::engine_types::Command;
pub use crate::engine_types::{EngineConfig, EngineError, EngineInfo, EngineStats, KvBudget};
pub use crate::engine_types::{EngineHandle, OutputStream};
use crate::kv_cache::KvCache;
use crate::loader::{load_model, LoadedModel};
use crate::model_runner::graphs::GraphPlan;
use crate::model_runner::{LogitRow, ModelRunner};
use crate::request::{
    CompletionOutput, EngineRequest, FinishReason, RequestId, RequestOutput, StopReason,
    TokenLogprob,
};
use crate::sampler::{prompt_logprob, sample_batch, SampleInput, SeqRng};
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::sequence::{SeqId, Sequence};
use crate::tokenizer::IncrementalDetokenizer;
use candle_core::{DType, Device};
use rserve_kernels::sampling::{LogitEdit, PendingSample, ReadbackPool, RowSampling};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

struct Completion {
    seq: Option<SeqId>,
    rng: SeqRng,
    detok: IncrementalDetokenizer,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    cumulative_logprob: f32,
    finish: Option<FinishReason>,
    stop_reason: Option<StopReason>,
    delta: String,
}

struct RequestState {
    req: EngineRequest,
    tx: flume::Sender<Result<RequestOutput, EngineError>>,
    completions: Vec<Completion>,
    prompt_logprobs: Vec<Option<TokenLogprob>>,
    arrival: Instant,
    queue_time: Option<f64>,
    max_tokens: usize,
}

impl RequestState {
    fn finished(&self) -> bool {
        self.completions.iter().all(|c| c.finish.is_some())
    }
}

/// The state owned by the engine thread.
pub struct Engine {
    info: Arc<EngineInfo>,
    stats: Arc<EngineStats>,
    scheduler: Scheduler,
    runner: ModelRunner,
    requests: HashMap<RequestId, RequestState>,
    seq_owner: HashMap<SeqId, (RequestId, usize)>,
    next_seq: u64,
    seed_rng: SeqRng,
    timing: StepTiming,
    profile: StepProfile,
    /// Tokens accepted whose text is not worked out yet (see [`Engine::settle`]).
    pending: Vec<PendingToken>,
    /// A step whose tokens are still on their way from the device (async scheduling).
    in_flight: Option<InFlight>,
    readback: ReadbackPool,
    async_scheduling: bool,
}

/// Tokens sampled on the device and not read back yet. Their sequences that go on hold a
/// placeholder for them, so the next step is planned and issued before they arrive.
struct InFlight {
    sample: PendingSample,
    /// Per sampled row: its sequence and the index its token takes among the sequence's tokens.
    rows: Vec<(SeqId, usize)>,
}

/// A sampled token whose completion has it, waiting for detokenizing, stop strings and sending.
#[derive(Debug, Clone, Copy)]
struct PendingToken {
    rid: RequestId,
    idx: usize,
    token: u32,
    /// Whether the token is text (not a stop token or EOS that ended its completion).
    text: bool,
}

/// `RSERVE_CUDA_PROFILE_STEPS=START:COUNT` brackets engine steps START..START+COUNT with the CUDA
/// profiler's start and stop, so `ncu --profile-from-start off` sees exactly those steps.
#[derive(Debug, Default)]
struct StepProfile {
    step: u64,
    range: Option<(u64, u64)>,
}

impl StepProfile {
    fn from_env() -> Self {
        let range = std::env::var("RSERVE_CUDA_PROFILE_STEPS")
            .ok()
            .and_then(|v| {
                let (a, b) = v.split_once(':')?;
                Some((a.trim().parse().ok()?, b.trim().parse().ok()?))
            });
        Self { step: 0, range }
    }

    /// Called before each step with the device; switches the profiler at the range's edges.
    fn tick(&mut self, device: &Device) {
        let step = self.step;
        self.step += 1;
        let on = match self.range {
            Some((start, _)) if step == start => true,
            Some((start, count)) if step == start + count => false,
            _ => return,
        };
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            if let Err(e) = crate::device::gpu::profiler(d, on) {
                tracing::warn!("{e}");
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (device, on);
    }
}

/// Where a step's time goes, averaged and logged at debug level every 200 steps: host work up to
/// the last kernel issued (schedule and batch inputs, then the forward pass's launches), waiting
/// for the device and reading the sampled tokens (or logits), of which the previous step's
/// detokenizing and sending done while the device runs, and the host work after (token stops, and
/// the text work of a step with nothing after it). With async scheduling a step issued ahead waits
/// for the tokens of the step before it, and its text work comes after. At trace level every step
/// is logged with its shape and the host time since the previous step ended
/// (`rserve_core::engine=trace`).
#[derive(Debug, Default)]
struct StepTiming {
    steps: u32,
    tokens: usize,
    /// This step's sequences, tokens and one-token (decode) rows, for the trace.
    shape: (usize, usize, usize),
    /// When the previous step ended and how many steps ran so far, for the trace.
    last_end: Option<Instant>,
    count: u64,
    prepare_s: f64,
    issue_s: f64,
    wait_s: f64,
    after_s: f64,
    settle_s: f64,
    prepared: Option<Instant>,
    issued: Option<Instant>,
    sampled: Option<Instant>,
}

impl StepTiming {
    fn finish(&mut self, started: Instant) {
        let end = Instant::now();
        let (Some(prepared), Some(issued), Some(sampled)) = (
            self.prepared.take(),
            self.issued.take(),
            self.sampled.take(),
        ) else {
            return;
        };
        let (seqs, tokens, decodes) = std::mem::take(&mut self.shape);
        tracing::trace!(
            "step {}: {seqs} seqs, {tokens} tokens, {decodes} decode rows; {:.2} ms since the last step, {:.2} ms issue, {:.2} ms wait, {:.2} ms after",
            self.count,
            self.last_end
                .map_or(0.0, |t| started.duration_since(t).as_secs_f64() * 1e3),
            issued.duration_since(started).as_secs_f64() * 1e3,
            sampled.duration_since(issued).as_secs_f64() * 1e3,
            end.duration_since(sampled).as_secs_f64() * 1e3
        );
        self.count += 1;
        self.last_end = Some(end);
        self.steps += 1;
        self.prepare_s += prepared.duration_since(started).as_secs_f64();
        self.issue_s += issued.duration_since(started).as_secs_f64();
        self.wait_s += sampled.duration_since(issued).as_secs_f64();
        self.after_s += end.duration_since(sampled).as_secs_f64();
        if self.steps == 200 {
            let n = f64::from(self.steps);
            tracing::debug!(
                "steps: {:.1} tokens/step; per step {:.2} ms host issue (of which {:.2} ms schedule + inputs), {:.2} ms device wait + read (of which {:.2} ms detokenize + send), {:.2} ms host after",
                self.tokens as f64 / n,
                self.issue_s / n * 1e3,
                self.prepare_s / n * 1e3,
                self.wait_s / n * 1e3,
                self.settle_s / n * 1e3,
                self.after_s / n * 1e3
            );
            *self = Self {
                last_end: self.last_end,
                count: self.count,
                ..Self::default()
            };
        }
    }
}

pub use crate::device::parse_device;

/// The step token budget when none is given, as vLLM's server chooses it: 8192 tokens on GPUs
/// of 70 GiB or more (H100, H200: fewer, larger prompt chunks keep the products at their
/// ceiling), 2048 elsewhere (smaller GPUs, the CPU).
pub fn default_batched_tokens(device: &Device) -> usize {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => match crate::device::gpu::memory(dev) {
            Ok(m) if m.total >= 70 << 30 => 8192,
            _ => 2048,
        },
        _ => 2048,
    }
}

/// Bytes of KV cache a GPU can hold: `gpu_memory_utilization` of the card, less what is in use
/// after loading (weights, context, other processes) and the activation peak of a forward pass over
/// `batched_tokens` tokens (the step budget), measured on the pool's high-water mark.
#[cfg(feature = "cuda")]
fn gpu_kv_budget(
    cfg: &EngineConfig,
    batched_tokens: usize,
    loaded: &LoadedModel,
    device: &Device,
    max_model_len: usize,
) -> Result<usize, EngineError> {
    use crate::device::gpu;
    let Device::Cuda(dev) = device else {
        return Err(EngineError::InvalidConfig("not a CUDA device".into()));
    };
    let err = |e: String| EngineError::Model(format!("sizing the KV cache: {e}"));
    let before = gpu::memory(dev).map_err(err)?;
    gpu::reset_peak(dev).map_err(err)?;
    let tokens = batched_tokens.min(max_model_len.max(1));
    let rows = cfg.max_num_seqs.min(tokens);
    let scratch = crate::model_runner::profile_forward(
        loaded.model.as_ref(),
        loaded.dtype,
        device,
        tokens,
        rows,
        cfg.block_size,
    )
    .map_err(|e| err(e.to_string()))?;
    let peak = gpu::peak(dev)
        .map_err(err)?
        .saturating_sub(before.pool_used + scratch);
    let in_use = before.total - before.free;
    let allowed = (before.total as f64 * cfg.gpu_memory_utilization) as usize;
    // decode graphs: the shared f32 logits buffer, the largest bucket's logits inside its graph
    // (model dtype, then f32) and its other activations
    let graphs = if cfg.enforce_eager {
        0
    } else {
        let largest = GraphPlan::new(cfg.max_num_seqs, max_model_len, cfg.block_size)
            .buckets
            .last()
            .copied()
            .unwrap_or(0);
        let logits = largest * loaded.model.config().vocab_size;
        logits * (8 + loaded.dtype.size_in_bytes()) + peak * largest / tokens.max(1)
    };
    let budget = allowed.saturating_sub(in_use + peak + graphs);
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "GPU memory: {:.2} GiB total, {:.2} GiB in use after loading, activation peak {:.2} GiB for {tokens} tokens, {:.2} GiB kept for decode graphs; KV cache budget {:.2} GiB at utilization {}",
        gib(before.total),
        gib(in_use),
        gib(peak),
        gib(graphs),
        gib(budget),
        cfg.gpu_memory_utilization
    );
    Ok(budget)
}

#[cfg(not(feature = "cuda"))]
fn gpu_kv_budget(
    _cfg: &EngineConfig,
    _batched_tokens: usize,
    _loaded: &LoadedModel,
    _device: &Device,
    _max_model_len: usize,
) -> Result<usize, EngineError> {
    Err(EngineError::InvalidConfig(
        "this build has no GPU support".into(),
    ))
}

impl Engine {
    /// Loads the model, sizes the KV cache and starts the engine thread.
    pub fn start(cfg: EngineConfig) -> Result<EngineHandle, EngineError> {
        let device = parse_device(&cfg.device)?;
        let hf = crate::loader::read_config(&cfg.model)?;
        let dcfg = crate::models::decoder_config(&hf)?;
        let max_model_len = match cfg.max_model_len {
            Some(0) => {
                return Err(EngineError::InvalidConfig(
                    "max_model_len must be positive".into(),
                ))
            }
            Some(m) => m,
            None => dcfg.max_position_embeddings,
        };
        let loaded = load_model(
            &cfg.model,
            &cfg.dtype,
            &device,
            Some(max_model_len.max(dcfg.max_position_embeddings)),
        )?;
        Self::from_loaded(cfg, loaded, device, max_model_len)
    }

    fn from_loaded(
        cfg: EngineConfig,
        loaded: LoadedModel,
        device: Device,
        max_model_len: usize,
    ) -> Result<EngineHandle, EngineError> {
        let batched_tokens = cfg
            .max_num_batched_tokens
            .unwrap_or_else(|| default_batched_tokens(&device));
        if cfg.block_size == 0 || cfg.max_num_seqs == 0 || batched_tokens == 0 {
            return Err(EngineError::InvalidConfig(
                "block_size, max_num_seqs and max_num_batched_tokens must be positive".into(),
            ));
        }
        let mc = loaded.model.config().clone();
        let kv_dtype: DType = loaded.dtype;
        let per_block = KvCache::bytes_per_block(
            mc.num_layers,
            cfg.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            kv_dtype,
        );
        let useful = cfg.max_num_seqs * max_model_len.div_ceil(cfg.block_size);
        if !(cfg.gpu_memory_utilization > 0.0 && cfg.gpu_memory_utilization <= 1.0) {
            return Err(EngineError::InvalidConfig(format!(
                "gpu_memory_utilization must be in (0, 1], got {}",
                cfg.gpu_memory_utilization
            )));
        }
        let num_blocks = match cfg.kv_cache {
            KvBudget::Bytes(b) => b / per_block,
            KvBudget::Blocks(n) => n,
            KvBudget::Auto if !device.is_cpu() => {
                let budget = gpu_kv_budget(&cfg, batched_tokens, &loaded, &device, max_model_len)?;
                (budget / per_block).min(useful)
            }
            KvBudget::Auto => ((1usize << 30) / per_block).min(useful),
        };
        if num_blocks == 0 {
            return Err(EngineError::InvalidConfig(format!(
                "the KV cache budget holds no block (one block of {} tokens takes {per_block} bytes)",
                cfg.block_size
            )));
        }
        let kv = KvCache::new(
            mc.num_layers,
            num_blocks,
            cfg.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            kv_dtype,
            &device,
        )
        .map_err(|e| EngineError::Model(e.to_string()))?;
        tracing::info!(
            "KV cache: {num_blocks} blocks of {} tokens = {} tokens; max concurrency at {max_model_len} tokens: {:.2}",
            cfg.block_size,
            num_blocks * cfg.block_size,
            (num_blocks * cfg.block_size) as f64 / max_model_len as f64
        );
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: batched_tokens,
            max_model_len,
            block_size: cfg.block_size,
            num_blocks,
        };
        let info = Arc::new(EngineInfo {
            model_dir: loaded.dir.clone(),
            model_config: mc.clone(),
            tokenizer: Arc::new(loaded.tokenizer),
            chat_template: match &cfg.chat_template {
                Some(src) => Some(Arc::new(
                    crate::chat_template::ChatTemplate::new(
                        src,
                        loaded.bos_token.clone(),
                        loaded.eos_token.clone(),
                    )
                    .map_err(|e| EngineError::InvalidConfig(format!("chat template: {e}")))?,
                )),
                None => loaded.chat_template.map(Arc::new),
            },
            generation: loaded.generation,
            max_model_len,
            num_blocks,
            block_size: cfg.block_size,
            dtype: loaded.dtype,
            device: match device.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
                candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
                candle_core::DeviceLocation::Cpu => "cpu".into(),
            },
        });
        let stats = Arc::new(EngineStats::default());
        // the engine thread runs on its own stream: everything queued here must be done first
        device
            .synchronize()
            .map_err(|e| EngineError::Model(e.to_string()))?;
        let graphs = (!cfg.enforce_eager)
            .then(|| GraphPlan::new(cfg.max_num_seqs, max_model_len, cfg.block_size));
        let runner = ModelRunner::new(loaded.model, kv, device, graphs);
        let engine = Engine {
            info: info.clone(),
            stats: stats.clone(),
            scheduler: Scheduler::new(sched_cfg),
            runner,
            requests: HashMap::new(),
            seq_owner: HashMap::new(),
            next_seq: 0,
            seed_rng: SeqRng::new(cfg.seed),
            timing: StepTiming::default(),
            profile: StepProfile::from_env(),
            pending: Vec::new(),
            in_flight: None,
            readback: ReadbackPool::default(),
            async_scheduling: cfg.async_scheduling,
        };
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("rserve-engine".into())
            .spawn(move || {
                let mut engine = engine;
                // graphs are captured and launched on the engine thread's stream
                engine.capture_graphs();
                let _ = ready_tx.send(());
                engine.run(rx)
            })
            .map_err(|e| {
                EngineError::InvalidConfig(format!("cannot start the engine thread: {e}"))
            })?;
        ready_rx.recv().map_err(|_| {
            EngineError::Model("the engine thread ended while capturing its graphs".into())
        })?;
        Ok(EngineHandle::new(tx, info, stats))
    }

    /// Captures the decode graphs before the first request, so no step pays for a capture.
    fn capture_graphs(&mut self) {
        let started = Instant::now();
        match self.runner.capture_graphs() {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                "captured {n} decode graphs in {:.2} s",
                started.elapsed().as_secs_f64()
            ),
            Err(e) => tracing::warn!(
                "capturing the decode graphs failed ({e}); steps capture them as they come"
            ),
        }
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            if !self.scheduler.has_work() {
                // nothing to overlap with: what the last steps produced goes out before waiting
                self.collect_in_flight();
                self.settle();
                match rx.recv() {
                    Ok(c) => {
                        if !self.handle(c) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => {
                        if !self.handle(c) {
                            return;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        if !self.scheduler.has_work() {
                            return;
                        }
                        break;
                    }
                }
            }
            if self.scheduler.has_work() {
                self.step();
            }
            self.publish_stats();
        }
    }

    fn publish_stats(&self) {
        self.stats
            .running
            .store(self.scheduler.num_running(), Ordering::Relaxed);
        self.stats
            .waiting
            .store(self.scheduler.num_waiting(), Ordering::Relaxed);
        let usage = (self.scheduler.kv().usage() * 1e6) as u64;
        self.stats.kv_usage_ppm.store(usage, Ordering::Relaxed);
    }

    /// Handles one command; false means shut down.
    fn handle(&mut self, c: Command) -> bool {
        match c {
            Command::Submit { id, req, tx } => self.admit(id, *req, tx),
            Command::Abort(id) => self.abort(id),
            Command::Shutdown => return false,
            Command::Check(reply) => {
                let _ = reply.send(self.scheduler.check_integrity());
            }
        }
        true
    }

    fn admit(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        tx: flume::Sender<Result<RequestOutput, EngineError>>,
    ) {
        let p = &req.params;
        let prompt_len = req.prompt_token_ids.len();
        let max_tokens = p
            .max_tokens
            .unwrap_or(usize::MAX)
            .min(self.info.max_model_len.saturating_sub(prompt_len));
        let base_seed = p.seed.unwrap_or_else(|| self.seed_rng.next_u64());
        let completions = (0..p.n)
            .map(|i| Completion {
                seq: None,
                rng: SeqRng::for_sample(base_seed, i),
                detok: IncrementalDetokenizer::new(
                    &req.prompt_token_ids,
                    p.skip_special_tokens,
                    p.stop.clone(),
                    p.include_stop_str_in_output,
                ),
                token_ids: Vec::new(),
                logprobs: Vec::new(),
                cumulative_logprob: 0.0,
                finish: None,
                stop_reason: None,
                delta: String::new(),
            })
            .collect();
        self.stats
            .prompt_tokens
            .fetch_add(prompt_len as u64, Ordering::Relaxed);
        let sid = self.new_seq_id();
        let mut state = RequestState {
            tx,
            completions,
            prompt_logprobs: Vec::new(),
            arrival: Instant::now(),
            queue_time: None,
            max_tokens,
            req,
        };
        state.completions[0].seq = Some(sid);
        if state.req.params.prompt_logprobs.is_some() {
            state.prompt_logprobs.push(None);
        }
        self.scheduler.add(Sequence::new(
            sid,
            id,
            state.req.prompt_token_ids.clone(),
            state.req.params.n,
        ));
        self.seq_owner.insert(sid, (id, 0));
        self.requests.insert(id, state);
    }

    fn new_seq_id(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    fn abort(&mut self, id: RequestId) {
        // tokens already accepted count (and may have finished the request) before the abort
        self.settle();
        for s in self.scheduler.abort_request(id) {
            self.seq_owner.remove(&s);
        }
        if let Some(mut st) = self.requests.remove(&id) {
            for c in &mut st.completions {
                if c.finish.is_none() {
                    c.finish = Some(FinishReason::Abort);
                }
            }
            self.stats.record_finish(FinishReason::Abort);
            let out = Self::snapshot(id, &mut st, true);
            let _ = st.tx.send(Ok(out));
        }
    }

    fn fail_all(&mut self, err: EngineError) {
        // tokens of the step before the failure are good: they go out first
        self.in_flight = None;
        self.settle();
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            for s in self.scheduler.abort_request(id) {
                self.seq_owner.remove(&s);
            }
            if let Some(st) = self.requests.remove(&id) {
                let _ = st.tx.send(Err(err.clone()));
            }
        }
    }

    fn step(&mut self) {
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
            if let Some((rid, _)) = self.seq_owner.get(&s.seq_id) {
                if let Some(st) = self.requests.get_mut(rid) {
                    if st.queue_time.is_none() {
                        st.queue_time = Some(now.duration_since(st.arrival).as_secs_f64());
                    }
                }
            }
        }
        // field by field: the runner is borrowed mutably beside it
        let wants = |seq: SeqId| -> bool {
            self.seq_owner
                .get(&seq)
                .and_then(|(rid, _)| self.requests.get(rid))
                .is_some_and(|st| st.req.params.prompt_logprobs.is_some())
        };
        let prepared = self.runner.prepare(&self.scheduler, &out, wants);
        self.timing.prepared = Some(Instant::now());
        let result = prepared.and_then(|(step, rows, pending)| {
            self.feed_pending(&step, &pending)?;
            Ok((self.runner.execute(&out, &step)?, rows))
        });
        self.timing.issued = Some(Instant::now());
        self.timing.tokens += out.num_batched_tokens;
        self.timing.shape = (
            out.scheduled.len(),
            out.num_batched_tokens,
            out.scheduled.iter().filter(|s| s.num_new == 1).count(),
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
        let settings = self
            .device_sampling_applies(&rows)
            .then(|| self.device_settings(&rows));
        if let Some(settings) = settings {
            let ahead = self.async_scheduling && self.lookahead_applies(&rows);
            let sample =
                rserve_kernels::sampling::sample_rows_async(&logits, &settings, &mut self.readback);
            let sample = match sample {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!("sampling on the device failed: {e}");
                    self.fail_all(EngineError::Model(e.to_string()));
                    return;
                }
            };
            let targets: Vec<(SeqId, usize)> = rows
                .iter()
                .filter_map(|row| match *row {
                    LogitRow::Sample(seq) => {
                        Some((seq, self.scheduler.seq(seq).map_or(0, |s| s.tokens.len())))
                    }
                    LogitRow::PromptLogprob { .. } => None,
                })
                .collect();
            // sequences that go on hold a placeholder, so the next step can be planned now
            let mut reserved = false;
            if ahead {
                for &(seq, _) in &targets {
                    if !self.ends_by_length(seq) {
                        self.scheduler.reserve_token(seq);
                        reserved = true;
                    }
                }
            }
            let this = InFlight {
                sample,
                rows: targets,
            };
            // the device runs this step while the step before's tokens are taken in and become
            // text
            self.collect_in_flight();
            if reserved {
                self.in_flight = Some(this);
                self.timing.sampled = Some(Instant::now());
                self.settle_overlapped();
            } else {
                self.settle_overlapped();
                self.collect(this);
                self.timing.sampled = Some(Instant::now());
                // with another step to come, the text work overlaps it
                if !self.scheduler.has_work() {
                    self.settle();
                }
            }
            return;
        }
        // sampled on the host: the tokens of the step before come first
        self.collect_in_flight();
        self.settle_overlapped();
        let logits = logits.to_vec2::<f32>();
        self.timing.sampled = Some(Instant::now());
        let mut logits = match logits {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("reading logits failed: {e}");
                self.fail_all(EngineError::Model(e.to_string()));
                return;
            }
        };
        // prompt logprobs
        for (row, kind) in logits.iter().zip(&rows) {
            if let LogitRow::PromptLogprob { seq, pos } = *kind {
                let Some(&(rid, _)) = self.seq_owner.get(&seq) else {
                    continue;
                };
                let Some(st) = self.requests.get_mut(&rid) else {
                    continue;
                };
                if st.prompt_logprobs.len() == pos + 1 {
                    if let Some(&next) = st.req.prompt_token_ids.get(pos + 1) {
                        st.prompt_logprobs.push(Some(prompt_logprob(
                            row,
                            next,
                            st.req.params.prompt_logprobs,
                        )));
                    }
                }
            }
        }
        // forks: a first sample of an n > 1 request fans out into its other completions
        let mut jobs: Vec<(usize, SeqId)> = Vec::new();
        for (i, kind) in rows.iter().enumerate() {
            let LogitRow::Sample(seq) = *kind else {
                continue;
            };
            let pending = self.scheduler.seq(seq).map_or(0, |s| s.pending_forks);
            if pending > 0 {
                let children: Vec<SeqId> = (0..pending).map(|_| self.new_seq_id()).collect();
                self.scheduler.fork(seq, &children);
                if let Some(&(rid, _)) = self.seq_owner.get(&seq) {
                    if let Some(st) = self.requests.get_mut(&rid) {
                        for (k, &c) in children.iter().enumerate() {
                            st.completions[k + 1].seq = Some(c);
                            self.seq_owner.insert(c, (rid, k + 1));
                        }
                    }
                    for &c in &children {
                        jobs.push((i, c));
                    }
                }
            }
            jobs.push((i, seq));
        }
        jobs.sort_by_key(|&(i, s)| (i, s));
        // rows shared by forked samples are copied so each sample sees the raw logits
        let mut extra: Vec<Vec<f32>> = Vec::new();
        let mut row_of: Vec<(usize, bool)> = Vec::with_capacity(jobs.len());
        let mut used = vec![false; logits.len()];
        for &(i, _) in &jobs {
            if used[i] {
                extra.push(logits[i].clone());
                row_of.push((extra.len() - 1, true));
            } else {
                used[i] = true;
                row_of.push((i, false));
            }
        }
        let sampled = self.sample_jobs(&jobs, &row_of, &mut logits, &mut extra);
        for ((_, seq), tl) in jobs.iter().zip(sampled) {
            self.accept_token(*seq, tl);
        }
        self.settle();
    }

    /// [`Engine::settle`] while the device runs a step, timed for the step log.
    fn settle_overlapped(&mut self) {
        let started = Instant::now();
        self.settle();
        self.timing.settle_s += started.elapsed().as_secs_f64();
    }

    /// Writes the tokens of `pending` rows (still being sampled by the step in flight) into the
    /// step's token ids on the device.
    fn feed_pending(
        &self,
        step: &crate::model_runner::PreparedStep,
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
        f.sample.write_tokens(&self.runner.token_ids(step)?, &pairs)
    }

    /// Takes in the tokens of the step in flight, if any (waiting for them).
    fn collect_in_flight(&mut self) {
        if let Some(f) = self.in_flight.take() {
            self.collect(f);
        }
    }

    /// Waits for a step's sampled tokens and accepts them where their placeholders are.
    fn collect(&mut self, f: InFlight) {
        match f.sample.wait(&mut self.readback) {
            Ok(picked) => {
                for (&(seq, at), (token_id, logprob)) in f.rows.iter().zip(picked) {
                    let tl = TokenLogprob {
                        token_id,
                        logprob,
                        top: Vec::new(),
                    };
                    self.accept_token_at(seq, at, tl);
                }
            }
            Err(e) => {
                tracing::error!("reading sampled tokens failed: {e}");
                self.fail_all(EngineError::Model(e.to_string()));
            }
        }
    }

    /// The request a sequence belongs to.
    fn request_of(&self, seq: SeqId) -> Option<&RequestState> {
        self.seq_owner
            .get(&seq)
            .and_then(|(rid, _)| self.requests.get(rid))
    }

    /// Whether the next step may be planned before this step's tokens are read: no row's sampling
    /// depends on the values of earlier output tokens (repetition, presence and frequency
    /// penalties do), which placeholders stand in for until then.
    fn lookahead_applies(&self, rows: &[LogitRow]) -> bool {
        rows.iter().all(|row| {
            let LogitRow::Sample(seq) = *row else {
                return false;
            };
            self.request_of(seq).is_some_and(|st| {
                let p = &st.req.params;
                p.repetition_penalty == 1.0
                    && p.presence_penalty == 0.0
                    && p.frequency_penalty == 0.0
            })
        })
    }

    /// Whether the token being sampled for `seq` ends it by length whatever its value (so no step
    /// is planned past it).
    fn ends_by_length(&self, seq: SeqId) -> bool {
        let Some(s) = self.scheduler.seq(seq) else {
            return true;
        };
        let max_tokens = self.request_of(seq).map_or(0, |st| st.max_tokens);
        s.num_output_tokens() + 1 >= max_tokens || s.num_tokens() + 1 >= self.info.max_model_len
    }

    /// Whether this step's tokens can be picked on the device: a GPU, and every row a sample of a
    /// sequence without pending forks whose request wants no logprobs, so only the chosen ids and
    /// their log-probs cross to the host.
    fn device_sampling_applies(&self, rows: &[LogitRow]) -> bool {
        if self.runner.device().is_cpu() || rows.is_empty() {
            return false;
        }
        rows.iter().all(|row| {
            let LogitRow::Sample(seq) = *row else {
                return false;
            };
            let forks = self.scheduler.seq(seq).map_or(1, |s| s.pending_forks);
            let wants_logprobs = self
                .request_of(seq)
                .is_none_or(|st| st.req.params.logprobs.is_some());
            forks == 0 && !wants_logprobs
        })
    }

    /// Each row's sampling settings for the device sampler: the request's parameters, its logit
    /// edits (bias, EOS and stop ids before `min_tokens`, penalties over the prompt and output), and
    /// a seed drawn from the completion's own generator (random rows only).
    fn device_settings(&mut self, rows: &[LogitRow]) -> Vec<RowSampling> {
        let eos = self.info.generation.eos_token_ids.clone();
        rows.iter()
            .map(|row| {
                let LogitRow::Sample(seq) = *row else {
                    return RowSampling::default();
                };
                let Some(&(rid, idx)) = self.seq_owner.get(&seq) else {
                    return RowSampling::default();
                };
                let Some(st) = self.requests.get_mut(&rid) else {
                    return RowSampling::default();
                };
                let p = &st.req.params;
                let (prompt, output): (&[u32], &[u32]) = match self.scheduler.seq(seq) {
                    Some(s) => (&s.tokens[..s.prompt_len], s.output_tokens()),
                    None => (&[], &[]),
                };
                let mut edits: BTreeMap<u32, LogitEdit> = BTreeMap::new();
                let blank = |token| LogitEdit {
                    token,
                    bias: 0.0,
                    repetition_penalty: 1.0,
                    subtract: 0.0,
                };
                for (&t, &b) in &p.logit_bias {
                    edits.entry(t).or_insert_with(|| blank(t)).bias = b;
                }
                let rp = p.repetition_penalty;
                if rp != 1.0 && rp > 0.0 {
                    for &t in prompt.iter().chain(output) {
                        edits
                            .entry(t)
                            .or_insert_with(|| blank(t))
                            .repetition_penalty = rp;
                    }
                }
                if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
                    let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
                    for &t in output {
                        *counts.entry(t).or_default() += 1;
                    }
                    for (t, c) in counts {
                        edits.entry(t).or_insert_with(|| blank(t)).subtract +=
                            p.presence_penalty + p.frequency_penalty * c as f32;
                    }
                }
                if output.len() < p.min_tokens {
                    for &t in p.stop_token_ids.iter().chain(&eos) {
                        edits.entry(t).or_insert_with(|| blank(t)).subtract = f32::INFINITY;
                    }
                }
                let greedy = p.is_greedy();
                let mut s = RowSampling {
                    temperature: if greedy { 0.0 } else { p.temperature },
                    top_k: p.top_k,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    seed: 0,
                    edits: edits.into_values().collect(),
                };
                if !greedy {
                    s.seed = st.completions[idx].rng.next_u64();
                }
                s
            })
            .collect()
    }

    fn sample_jobs(
        &mut self,
        jobs: &[(usize, SeqId)],
        row_of: &[(usize, bool)],
        logits: &mut [Vec<f32>],
        extra: &mut [Vec<f32>],
    ) -> Vec<TokenLogprob> {
        // Take each completion's rng out while sampling, then put it back.
        let mut rngs: Vec<SeqRng> = Vec::with_capacity(jobs.len());
        let mut meta: Vec<(RequestId, usize)> = Vec::with_capacity(jobs.len());
        for &(_, seq) in jobs {
            let (rid, idx) = self
                .seq_owner
                .get(&seq)
                .copied()
                .unwrap_or((RequestId(u64::MAX), 0));
            let rng = self
                .requests
                .get_mut(&rid)
                .map(|st| std::mem::replace(&mut st.completions[idx].rng, SeqRng::new(0)))
                .unwrap_or_else(|| SeqRng::new(0));
            rngs.push(rng);
            meta.push((rid, idx));
        }
        let empty = crate::request::SamplingParams::default();
        let mut suppress: Vec<Vec<u32>> = Vec::with_capacity(jobs.len());
        for (k, &(_, seq)) in jobs.iter().enumerate() {
            let st = self.requests.get(&meta[k].0);
            let out_len = self.scheduler.seq(seq).map_or(0, |s| s.num_output_tokens());
            let s = match st {
                Some(st) if out_len < st.req.params.min_tokens => {
                    let mut v = st.req.params.stop_token_ids.clone();
                    v.extend(&self.info.generation.eos_token_ids);
                    v
                }
                _ => Vec::new(),
            };
            suppress.push(s);
        }
        let results = {
            let mut main_rows: Vec<Option<&mut Vec<f32>>> = logits.iter_mut().map(Some).collect();
            let mut extra_rows: Vec<Option<&mut Vec<f32>>> = extra.iter_mut().map(Some).collect();
            let mut inputs = Vec::with_capacity(jobs.len());
            for ((k, &(_, seq)), rng) in jobs.iter().enumerate().zip(rngs.iter_mut()) {
                let (r, is_extra) = row_of[k];
                let row = if is_extra {
                    extra_rows[r].take()
                } else {
                    main_rows[r].take()
                };
                let Some(row) = row else { continue };
                let params = self
                    .requests
                    .get(&meta[k].0)
                    .map_or(&empty, |st| &st.req.params);
                let (prompt, output): (&[u32], &[u32]) = match self.scheduler.seq(seq) {
                    Some(s) => (&s.tokens[..s.prompt_len], s.output_tokens()),
                    None => (&[], &[]),
                };
                inputs.push(SampleInput {
                    logits: row.as_mut_slice(),
                    params,
                    prompt_ids: prompt,
                    output_ids: output,
                    suppress: &suppress[k],
                    rng,
                });
            }
            sample_batch(inputs)
        };
        for (k, rng) in rngs.into_iter().enumerate() {
            let (rid, idx) = meta[k];
            if let Some(st) = self.requests.get_mut(&rid) {
                st.completions[idx].rng = rng;
            }
        }
        results
    }

    /// Appends a sampled token to its sequence and completion and applies the stops that need no
    /// text (stop token ids, EOS, length); the token's text waits in `pending` for `settle`.
    fn accept_token(&mut self, seq: SeqId, tl: TokenLogprob) {
        let at = self.scheduler.seq(seq).map_or(0, |s| s.tokens.len());
        self.accept_token_at(seq, at, tl);
    }

    /// [`Engine::accept_token`] for the token at index `at` of the sequence (a placeholder's, or
    /// appended at the end).
    fn accept_token_at(&mut self, seq: SeqId, at: usize, tl: TokenLogprob) {
        let Some(&(rid, idx)) = self.seq_owner.get(&seq) else {
            return;
        };
        self.scheduler.set_token(seq, at, tl.token_id);
        self.stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
        let Some(st) = self.requests.get_mut(&rid) else {
            return;
        };
        let p = &st.req.params;
        let Some(c) = st.completions.get_mut(idx) else {
            return;
        };
        let tok = tl.token_id;
        c.token_ids.push(tok);
        c.cumulative_logprob += tl.logprob;
        if p.logprobs.is_some() {
            c.logprobs.push(tl);
        }
        let n_out = c.token_ids.len();
        let is_eos = self.info.generation.eos_token_ids.contains(&tok);
        let mut finish = None;
        if n_out >= p.min_tokens && p.stop_token_ids.contains(&tok) {
            finish = Some((FinishReason::Stop, Some(StopReason::Token(tok))));
        } else if n_out >= p.min_tokens && is_eos && !p.ignore_eos {
            finish = Some((FinishReason::Stop, None));
        }
        // EOS and stop tokens are not part of the text.
        let text = finish.is_none();
        let total = st.req.prompt_token_ids.len() + n_out;
        if finish.is_none() && (n_out >= st.max_tokens || total >= self.info.max_model_len) {
            finish = Some((FinishReason::Length, None));
        }
        if let Some((reason, stop)) = finish {
            c.finish = Some(reason);
            c.stop_reason = stop;
            self.scheduler.finish(seq);
            self.seq_owner.remove(&seq);
        }
        self.pending.push(PendingToken {
            rid,
            idx,
            token: tok,
            text,
        });
    }

    /// Works out the text of the accepted tokens (a stop string found now ends its completion,
    /// also when the token reached the length limit), and sends every request concerned its
    /// output. Runs while the device computes the next step, so a completion ended by a stop
    /// string may have been scheduled once more; that token is dropped.
    fn settle(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let info = self.info.clone();
        let mut touched: Vec<RequestId> = Vec::new();
        for p in std::mem::take(&mut self.pending) {
            let Some(st) = self.requests.get_mut(&p.rid) else {
                continue;
            };
            let min_tokens = st.req.params.min_tokens;
            let Some(c) = st.completions.get_mut(p.idx) else {
                continue;
            };
            if p.text {
                match c.detok.push(&info.tokenizer, p.token) {
                    Ok(Some(stop)) if c.token_ids.len() >= min_tokens => {
                        if c.finish.is_none() {
                            if let Some(seq) = c.seq {
                                self.scheduler.finish(seq);
                                self.seq_owner.remove(&seq);
                            }
                        }
                        c.finish = Some(FinishReason::Stop);
                        c.stop_reason = Some(StopReason::Text(stop));
                    }
                    Ok(_) => {}
                    Err(e) => tracing::debug!("detokenizer: {e}"),
                }
            }
            if let Some(reason) = c.finish {
                let _ = c.detok.flush(&info.tokenizer);
                self.stats.record_finish(reason);
            }
            let finished = c.finish.is_some();
            c.delta.push_str(&c.detok.take_delta(finished));
            if !touched.contains(&p.rid) {
                touched.push(p.rid);
            }
        }
        for rid in touched {
            self.emit(rid);
        }
    }

    fn snapshot(id: RequestId, st: &mut RequestState, finished: bool) -> RequestOutput {
        let outputs = st
            .completions
            .iter_mut()
            .enumerate()
            .map(|(i, c)| CompletionOutput {
                index: i,
                text: c.detok.text().to_string(),
                delta: std::mem::take(&mut c.delta),
                token_ids: c.token_ids.clone(),
                cumulative_logprob: c.cumulative_logprob,
                logprobs: st.req.params.logprobs.map(|_| c.logprobs.clone()),
                finish_reason: c.finish,
                stop_reason: c.stop_reason.clone(),
            })
            .collect();
        RequestOutput {
            request_id: id,
            prompt_token_ids: st.req.prompt_token_ids.clone(),
            prompt_logprobs: st
                .req
                .params
                .prompt_logprobs
                .map(|_| st.prompt_logprobs.clone()),
            outputs,
            finished,
            queue_time: st.queue_time,
        }
    }

    fn emit(&mut self, rid: RequestId) {
        let Some(st) = self.requests.get_mut(&rid) else {
            return;
        };
        let finished = st.finished();
        let out = Self::snapshot(rid, st, finished);
        let gone = st.tx.send(Ok(out)).is_err();
        if finished {
            self.requests.remove(&rid);
        } else if gone {
            // the caller dropped its stream: free everything now
            self.abort(rid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_budget_defaults_to_the_small_one_off_large_gpus() {
        assert_eq!(default_batched_tokens(&Device::Cpu), 2048);
    }
}
