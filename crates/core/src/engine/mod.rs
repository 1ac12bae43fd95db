//! The engine: one thread that owns the scheduler, the model runner, the KV cache and every
//! request's state, and steps them; and [`EngineHandle`], the cloneable way in for HTTP, Python and
//! the CLI (`submit` -> a stream of deltas, `abort`).
//!
//! One owner: nothing outside the engine thread touches engine state; callers talk to it through a
//! channel and receive [`crate::request::RequestDelta`]s through a per-request coalescing mailbox
//! ([`crate::stream`]). Requests are validated at `submit` (before they reach the thread), so the
//! loop only sees requests it can finish.
//!
//! The parts: this file starts the engine and runs its thread (commands, admission, abort);
//! [`step`] plans, runs and samples one step; [`requests`] keeps each request's bookkeeping;
//! [`crate::output`] turns accepted tokens into text and deltas; [`in_flight`] holds a step whose
//! tokens are still on the device (async scheduling); [`kv_sizing`] sizes the cache at start;
//! [`trace`] records where each step's time goes.

mod in_flight;
pub(crate) mod kv_sizing;
mod requests;
mod startup;
mod step;
mod trace;

use crate::engine_types::Command;
pub use crate::engine_types::EngineHandle;
pub use crate::engine_types::{
    EngineConfig, EngineError, EngineInfo, EngineStats, KvBudget, LoraActivity,
};
use crate::kv_cache::KvCache;
use crate::loader::{load_model_with, LoadOptions, LoadedModel};
use crate::lora::{BaseShape, LoraRegistry, LoraSlots, ResolvedLora, SlotTable};
use crate::model_runner::graphs::{lora_graph_covers, GraphPlan};
use crate::model_runner::ModelRunner;
use crate::output::OutputProcessor;
use crate::request::{EngineRequest, RequestId};
use crate::sampler::SeqRng;
use crate::scheduler::{prompt_logprob_rows_for, Scheduler, SchedulerConfig};
use crate::sequence::Sequence;
use crate::stream::Sink;
use crate::structured::CompiledGrammar;
use candle_core::{DType, Device};
use in_flight::InFlight;
pub use kv_sizing::default_batched_tokens;
use requests::Requests;
use rserve_kernels::sampling::ReadbackPool;
pub use startup::{mark_process_start, since_process_start, StartupPhase};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;
use trace::{StepProfile, StepTiming};

pub use crate::device::parse_device;

/// The state owned by the engine thread.
pub struct Engine {
    info: Arc<EngineInfo>,
    stats: Arc<EngineStats>,
    scheduler: Scheduler,
    runner: ModelRunner,
    requests: Requests,
    output: OutputProcessor,
    seed_rng: SeqRng,
    timing: StepTiming,
    profile: StepProfile,
    /// A step whose tokens are still on their way from the device (async scheduling).
    in_flight: Option<InFlight>,
    readback: ReadbackPool,
    async_scheduling: bool,
    /// See [`EngineConfig::lookahead_on_host`].
    host_lookahead: bool,
    /// The device slots of LoRA adapters and which adapter holds each (adapters enabled).
    adapters: Option<DeviceAdapters>,
}

/// The LoRA adapters on the device.
struct DeviceAdapters {
    slots: Arc<LoraSlots>,
    table: SlotTable,
}

impl Engine {
    /// Loads the model, sizes the KV cache and starts the engine thread.
    pub fn start(mut cfg: EngineConfig) -> Result<EngineHandle, EngineError> {
        cfg.lora = cfg
            .lora
            .map(|l| l.validated().map_err(EngineError::InvalidConfig))
            .transpose()?;
        let mut clock = startup::PhaseClock::new();
        let device = parse_device(&cfg.device)?;
        clock.done("device init");
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
        let mut opts = LoadOptions {
            max_positions: Some(max_model_len.max(dcfg.max_position_embeddings)),
            isq: cfg.isq,
            isq_lm_head: cfg.isq_lm_head,
            tokenizer: cfg.tokenizer.clone(),
            lora: cfg.lora,
            ..LoadOptions::new(&cfg.dtype)
        };
        let world = cfg.tensor_parallel_size;
        let vision = crate::models::architecture(&hf)?.processor.is_some();
        if let Some(why) =
            crate::parallel::refusal(&cfg, &dcfg, crate::gguf::is_gguf(&cfg.model), vision)
        {
            return Err(EngineError::InvalidConfig(why));
        }
        let group = if world > 1 {
            let (group, shard) =
                crate::parallel::start_group(&cfg.model, &opts, &dcfg, world, &device)?;
            opts.tp = Some(shard);
            Some(group)
        } else {
            None
        };
        let loaded = load_model_with(&cfg.model, &opts, &device)?;
        if let Some(g) = &group {
            g.wait_loaded()?;
            tracing::info!("tensor parallelism: {world} ranks loaded their shards");
        }
        if let Some(r) = &loaded.isq {
            tracing::info!("{}", r.summary());
        }
        clock.done("config, tokenizer and weights");
        Self::from_loaded(cfg, loaded, device, max_model_len, clock, group)
    }

    fn from_loaded(
        cfg: EngineConfig,
        loaded: LoadedModel,
        device: Device,
        mut max_model_len: usize,
        mut clock: startup::PhaseClock,
        group: Option<Box<dyn crate::parallel::TpGroup>>,
    ) -> Result<EngineHandle, EngineError> {
        let batched_tokens = cfg
            .max_num_batched_tokens
            .unwrap_or_else(|| default_batched_tokens(&device));
        if cfg.block_size == 0 || cfg.max_num_seqs == 0 || batched_tokens == 0 {
            return Err(EngineError::InvalidConfig(
                "block_size, max_num_seqs and max_num_batched_tokens must be positive".into(),
            ));
        }
        if !(cfg.gpu_memory_utilization > 0.0 && cfg.gpu_memory_utilization <= 1.0) {
            return Err(EngineError::InvalidConfig(format!(
                "gpu_memory_utilization must be in (0, 1], got {}",
                cfg.gpu_memory_utilization
            )));
        }
        let mc = loaded.model.config().clone();
        let kv_dtype: DType = cfg.kv_cache_dtype.storage(loaded.dtype);
        // the encoder budget: image tokens a step may encode, at least the largest image
        let encoder_tokens = loaded.processor.as_ref().map_or(usize::MAX, |p| {
            batched_tokens.max(p.max_image_tokens().min(max_model_len))
        });
        // profiled only where the cache takes what the GPU leaves
        let profile_images = match &loaded.processor {
            Some(p) if !device.is_cpu() && matches!(cfg.kv_cache, KvBudget::Auto) => {
                p.profile_images(encoder_tokens)
            }
            _ => Vec::new(),
        };
        let mut own = || {
            kv_sizing::kv_blocks(
                &cfg,
                (loaded.model.as_ref(), loaded.dtype),
                &device,
                batched_tokens,
                (max_model_len, &profile_images),
            )
        };
        let num_blocks = match &group {
            Some(g) => g.kv_blocks(&cfg, batched_tokens, max_model_len, &mut own)?,
            None => own()?,
        };
        clock.done("profiling pass (KV cache sizing)");
        max_model_len = kv_sizing::fit_context(
            max_model_len,
            cfg.max_model_len.is_some(),
            num_blocks * cfg.block_size,
        )?;
        let mut kv = KvCache::new(
            mc.num_layers,
            num_blocks,
            cfg.block_size,
            loaded.model.cache_kv_heads(),
            mc.head_dim,
            kv_dtype,
            &device,
        )
        .map_err(|e| EngineError::Model(e.to_string()))?;
        let kv_kind = match cfg.kv_cache_dtype {
            crate::kv_cache::KvCacheDtype::Auto => format!("{kv_dtype:?}"),
            other => match kv.set_scales(&loaded.model.kv_cache_scales()) {
                0 => format!("{}, unit scales", other.name()),
                n => format!("{}, the checkpoint's scales in {n} layers", other.name()),
            },
        };
        tracing::info!(
            "KV cache ({kv_kind}): {num_blocks} blocks of {} tokens = {} tokens; max concurrency at {max_model_len} tokens: {:.2}",
            cfg.block_size,
            num_blocks * cfg.block_size,
            (num_blocks * cfg.block_size) as f64 / max_model_len as f64
        );
        clock.done("KV cache allocation");
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: batched_tokens,
            max_model_len,
            block_size: cfg.block_size,
            num_blocks,
            max_prompt_logprob_rows: prompt_logprob_rows_for(mc.vocab_size),
            max_loras: cfg.lora.map_or(usize::MAX, |l| l.max_loras),
            enable_prefix_caching: cfg.enable_prefix_caching,
            max_num_encoder_tokens: encoder_tokens,
        };
        let lora = match (cfg.lora, &loaded.lora) {
            (Some(opts), Some(slots)) => {
                let base = BaseShape::from_config(&loaded.hf_config)
                    .map_err(|e| EngineError::InvalidConfig(format!("LoRA: {e}")))?;
                let registry = Arc::new(LoraRegistry::new(opts, base));
                for (name, path) in &cfg.lora_modules {
                    registry.load(name, path)?;
                }
                tracing::info!(
                    "LoRA: {} slots of rank {} over {} projections ({:.1} MiB), {} adapters registered",
                    slots.num_slots(),
                    slots.rank(),
                    slots.num_projections(),
                    slots.bytes() as f64 / (1 << 20) as f64,
                    cfg.lora_modules.len()
                );
                Some((registry, slots.clone()))
            }
            _ if !cfg.lora_modules.is_empty() => {
                return Err(EngineError::InvalidConfig(
                    "LoRA modules were given but LoRA is not enabled (--enable-lora)".into(),
                ))
            }
            _ => None,
        };
        let tokenizer = Arc::new(loaded.tokenizer);
        let grammars = crate::structured::Grammars::new(
            tokenizer.clone(),
            mc.vocab_size,
            loaded.generation.eos_token_ids.clone(),
        )
        .with_any_whitespace(cfg.json_any_whitespace);
        let info = Arc::new(EngineInfo {
            model_dir: loaded.dir.clone(),
            model_config: mc.clone(),
            tokenizer,
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
            isq: loaded.isq.clone(),
            stored: loaded.stored.clone(),
            max_model_len,
            num_blocks,
            block_size: cfg.block_size,
            dtype: loaded.dtype,
            kv_cache_dtype: cfg.kv_cache_dtype,
            device: match device.location() {
                candle_core::DeviceLocation::Cuda { .. } if cfg.tensor_parallel_size > 1 => {
                    format!("cuda:0-{}, tensor parallel", cfg.tensor_parallel_size - 1)
                }
                candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
                candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
                candle_core::DeviceLocation::Cpu => "cpu".into(),
            },
            lora: lora.as_ref().map(|(r, _)| r.clone()),
            grammars: Arc::new(grammars),
            processor: loaded.processor.clone(),
            startup: std::sync::OnceLock::new(),
        });
        info.grammars.warm_up_in_background();
        let stats = Arc::new(EngineStats::default());
        // the engine thread runs on its own stream: everything queued here must be done first
        device
            .synchronize()
            .map_err(|e| EngineError::Model(e.to_string()))?;
        let graphs = (!cfg.enforce_eager).then(|| GraphPlan {
            detach: cfg.tensor_parallel_size <= 1,
            ..GraphPlan::new(cfg.max_num_seqs, max_model_len, cfg.block_size)
        });
        if let Some(g) = &group {
            g.allocate(num_blocks, cfg.block_size, kv_dtype, graphs.clone())?;
        }
        let lora_covers = lora.as_ref().map_or_else(Vec::new, |(_, slots)| {
            lora_graph_covers(slots.num_slots(), slots.any_stacked())
        });
        let followers = group.map(|g| -> Box<dyn crate::model_runner::Followers> { g });
        let runner = ModelRunner::new(loaded.model, kv, device, graphs, lora_covers)
            .with_followers(followers);
        let engine = Engine {
            output: OutputProcessor::new(info.tokenizer.clone(), stats.clone()),
            info: info.clone(),
            stats: stats.clone(),
            scheduler: Scheduler::new(sched_cfg),
            runner,
            requests: Requests::default(),
            seed_rng: SeqRng::new(cfg.seed),
            timing: StepTiming::default(),
            profile: StepProfile::from_env(),
            in_flight: None,
            readback: ReadbackPool::default(),
            async_scheduling: cfg.async_scheduling,
            host_lookahead: cfg.lookahead_on_host,
            adapters: lora.map(|(_, slots)| DeviceAdapters {
                table: SlotTable::new(slots.num_slots()),
                slots,
            }),
        };
        clock.done("engine setup");
        let preload: Vec<String> = cfg.lora_modules.iter().map(|(n, _)| n.clone()).collect();
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let (ended_tx, ended_rx) = mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("rserve-engine".into())
            .spawn(move || {
                // dropped last, after everything the engine holds
                let _ended = ended_tx;
                let mut engine = engine;
                engine.preload_adapters(&preload);
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
        clock.done("adapters and graph capture");
        #[cfg(feature = "cuda")]
        tracing::info!(
            "candle's CUDA modules loaded as SASS (no JIT): {}",
            rserve_kernels::candle_sass::modules_loaded_as_sass()
        );
        let _ = info.startup.set(clock.finish());
        Ok(EngineHandle::new(tx, info, stats, ended_rx))
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
        let prefix = self.scheduler.prefix_cache_counts();
        self.stats
            .prefix_cache_queries
            .store(prefix.queries, Ordering::Relaxed);
        self.stats
            .prefix_cache_hits
            .store(prefix.hits, Ordering::Relaxed);
        if let Some(dev) = &self.adapters {
            let (running, waiting) = self.scheduler.adapter_names();
            if let Ok(mut l) = self.stats.lora.lock() {
                *l = Some(crate::engine_types::LoraActivity {
                    max_loras: dev.slots.num_slots(),
                    running,
                    waiting,
                });
            }
        }
    }

    /// Handles one command; false means shut down.
    fn handle(&mut self, c: Command) -> bool {
        match c {
            Command::Submit {
                id,
                req,
                lora,
                grammar,
                sink,
            } => self.admit(id, *req, lora, grammar, sink),
            Command::Abort(id) => self.abort(id),
            Command::Shutdown => return false,
            Command::Check(reply) => {
                let _ = reply.send(self.scheduler.check_integrity());
            }
            Command::EncodeImages(images, reply) => {
                let _ = reply.send(
                    self.runner
                        .encode_images(&images)
                        .map_err(|e| e.to_string()),
                );
            }
            Command::ResetPrefixCache(reply) => {
                let n = self.scheduler.reset_prefix_cache();
                tracing::info!("prefix cache reset: {n} cached blocks forgotten");
                let _ = reply.send(n);
            }
        }
        true
    }

    fn admit(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        lora: Option<ResolvedLora>,
        grammar: Option<Box<CompiledGrammar>>,
        sink: Sink,
    ) {
        let prompt_len = req.prompt_token_ids.len();
        let seed = req.params.seed.unwrap_or_else(|| self.seed_rng.next_u64());
        self.stats
            .prompt_tokens
            .fetch_add(prompt_len as u64, Ordering::Relaxed);
        self.output
            .add(id, sink, &req.prompt_token_ids, &req.params);
        let sid = self.requests.new_seq_id();
        let n = req.params.n;
        let prompt = req.prompt_token_ids.clone();
        let st = self.requests.admit(
            id,
            req,
            sid,
            seed,
            self.info.max_model_len,
            requests::Attached {
                lora,
                grammar: grammar.map(|g| *g),
            },
        );
        let seq = Sequence::new(sid, id, prompt, n).with_meta(st.meta.clone());
        self.scheduler.add(seq);
    }

    fn abort(&mut self, id: RequestId) {
        // tokens already accepted count (and may have finished the request) before the abort
        self.settle();
        for s in self.scheduler.abort_request(id) {
            self.requests.release(s);
        }
        self.requests.remove(id);
        self.output.abort(id);
    }

    /// Ends one request with an error; the others go on.
    fn fail_request(&mut self, id: RequestId, err: EngineError) {
        for s in self.scheduler.abort_request(id) {
            self.requests.release(s);
        }
        self.requests.remove(id);
        self.output.fail(id, err);
    }

    fn fail_all(&mut self, err: EngineError) {
        // tokens of the step before the failure are good: they go out first
        self.in_flight = None;
        self.settle();
        // blocks registered for the failed step (or a step in flight) may never have been
        // written: no later request may start from them
        let forgotten = self.scheduler.reset_prefix_cache();
        if forgotten > 0 {
            tracing::warn!("the failed step's prefix cache ({forgotten} blocks) was dropped");
        }
        for id in self.requests.ids() {
            for s in self.scheduler.abort_request(id) {
                self.requests.release(s);
            }
            self.requests.remove(id);
        }
        for id in self.output.ids() {
            self.output.fail(id, err.clone());
        }
    }

    /// Sends the text of the accepted tokens, ends the completions a stop string ended, and
    /// aborts requests whose reader went away.
    fn settle(&mut self) {
        if !self.output.has_pending() {
            return;
        }
        let settled = self.output.settle();
        for (rid, idx) in settled.stopped {
            if let Some(seq) = self.requests.end_completion(rid, idx) {
                self.scheduler.finish(seq);
            }
            self.requests.remove_if_finished(rid);
        }
        for rid in settled.gone {
            self.abort(rid);
        }
    }

    /// [`Engine::settle`] while the device runs a step, timed for the step log.
    fn settle_overlapped(&mut self) {
        let started = Instant::now();
        self.settle();
        self.timing.settle_s += started.elapsed().as_secs_f64();
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
