//! Ranks 1..N of a tensor-parallel group: one thread per GPU, each holding its shard of the model
//! and of the KV cache in a [`ModelRunner`] of its own, running the steps rank 0's runner sends
//! (the same host arrays; the collectives inside the forward pass meet rank 0's). Only rank 0
//! samples: the other ranks' logits are dropped.

use super::nccl::NcclComm;
use super::nccl::UniqueId as Id;
use super::peer::{PeerExchange, TpComm};
use super::{TpGroup, TpPlan, TpShard};
use crate::engine::{EngineConfig, EngineError};
use crate::kv_cache::KvCache;
use crate::loader::{load_model_with, LoadOptions};
use crate::model_runner::graphs::GraphPlan;
use crate::model_runner::{Followers, HostBatch, ModelRunner};
use crate::models::{DecoderConfig, Model};
use candle_core::{DType, Device, Result};
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

type Reply<T> = mpsc::Sender<std::result::Result<T, String>>;
type Answer<T> = mpsc::Receiver<std::result::Result<T, String>>;

const ENDED: &str = "a tensor-parallel rank has ended";

/// What rank 0 asks of the others.
enum Command {
    /// How many KV blocks fit this rank (runs the profiling forward pass with rank 0).
    Size {
        cfg: Box<EngineConfig>,
        batched_tokens: usize,
        max_model_len: usize,
        reply: Reply<usize>,
    },
    /// Allocate the KV cache of `num_blocks` blocks and set up the runner.
    Start {
        num_blocks: usize,
        block_size: usize,
        kv_dtype: DType,
        graphs: Option<GraphPlan>,
        reply: Reply<()>,
    },
    Step(Box<(HostBatch, Vec<(usize, usize)>)>),
    /// Capture the decode graphs (a failure stops the group).
    Capture,
}

/// What every rank of a group shares: the communicators (to abort them all at once) and the
/// first failure, which ends the group for good.
#[derive(Default)]
struct Group {
    comms: Mutex<Vec<Arc<NcclComm>>>,
    failed: Mutex<Option<String>>,
}

impl Group {
    fn join(&self, comm: &Arc<NcclComm>) {
        if let Ok(mut g) = self.comms.lock() {
            g.push(comm.clone());
        }
    }

    /// Records the first failure and aborts every communicator: collectives waiting for a rank
    /// that will not come return (with an error) instead of spinning forever.
    fn fail(&self, why: String) {
        tracing::error!("tensor parallelism: {why}; the group is stopped");
        if let Ok(mut f) = self.failed.lock() {
            f.get_or_insert(why);
        }
        self.abort();
    }

    fn abort(&self) {
        if let Ok(g) = self.comms.lock() {
            for c in g.iter() {
                c.abort();
            }
        }
    }

    fn failure(&self) -> Option<String> {
        self.failed.lock().ok()?.clone()
    }
}

/// Ranks 1..N, driven by rank 0.
pub struct Workers {
    txs: Vec<mpsc::Sender<Command>>,
    /// Each rank's answer when it has loaded its shard (taken by [`Workers::wait_loaded`]).
    ready: Mutex<Option<mpsc::Receiver<std::result::Result<usize, String>>>>,
    group: Arc<Group>,
    handles: Vec<JoinHandle<()>>,
}

fn msg(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Workers {
    /// Starts ranks 1..`world` loading `model` (with `opts`) on GPUs 1..`world`, and joins rank
    /// 0 to their NCCL group on `device`; returns the workers (still loading: see
    /// [`Workers::wait_loaded`]) and rank 0's shard.
    pub fn start(
        model: PathBuf,
        opts: &LoadOptions,
        cfg: &DecoderConfig,
        world: usize,
        device: &Device,
    ) -> std::result::Result<(Self, TpShard), EngineError> {
        let Device::Cuda(dev) = device else {
            return Err(EngineError::InvalidConfig(
                "tensor parallelism needs CUDA devices".into(),
            ));
        };
        let gpus = candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
            .map_err(|e| EngineError::Model(format!("counting GPUs: {e:?}")))?;
        if (gpus.max(0) as usize) < world {
            return Err(EngineError::InvalidConfig(format!(
                "--tensor-parallel-size {world} needs {world} GPUs; {gpus} are visible"
            )));
        }
        let id = super::nccl::unique_id().map_err(|e| EngineError::Model(e.to_string()))?;
        let group = Arc::new(Group::default());
        let peers = PeerExchange::new(world);
        let (ready_tx, ready_rx) = mpsc::channel();
        let (opened_tx, opened_rx) = mpsc::channel();
        let mut txs = Vec::new();
        let mut gos = Vec::new();
        let mut handles = Vec::new();
        for rank in 1..world {
            let (tx, rx) = mpsc::channel();
            let (go_tx, go_rx) = mpsc::channel::<()>();
            let (model, opts, cfg) = (model.clone(), opts.clone(), cfg.clone());
            let (ready, grp, opened) = (ready_tx.clone(), group.clone(), opened_tx.clone());
            let peers = peers.clone();
            let h = std::thread::Builder::new()
                .name(format!("rserve-tp{rank}"))
                .spawn(move || {
                    // every GPU opens before any rank joins the group: joining blocks until all
                    // ranks have, so a rank that cannot start must say so first
                    let device = crate::device::parse_device(&format!("cuda:{rank}"));
                    let ok = device
                        .as_ref()
                        .map(|_| ())
                        .map_err(|e| format!("GPU {rank}: {e}"));
                    let _ = opened.send(ok);
                    let (Ok(device), Ok(())) = (device, go_rx.recv()) else {
                        return;
                    };
                    let joined = (id, grp.as_ref(), peers.as_ref());
                    let loaded = load_rank(&model, opts, &cfg, (rank, world), joined, device);
                    let runner = match loaded {
                        Ok(r) => {
                            let _ = ready.send(Ok(rank));
                            r
                        }
                        Err(e) => {
                            let _ = ready.send(Err(format!("rank {rank}: {e}")));
                            return;
                        }
                    };
                    serve(runner, rx, &grp, rank);
                })
                .map_err(|e| EngineError::Model(format!("starting rank {rank}: {e}")))?;
            txs.push(tx);
            gos.push(go_tx);
            handles.push(h);
        }
        drop(opened_tx);
        for _ in 1..world {
            let opened = opened_rx
                .recv()
                .map_err(|_| "a tensor-parallel rank ended while opening its GPU".to_string())
                .and_then(|r| r);
            if let Err(e) = opened {
                // the others see their go channel close and end
                drop(gos);
                return Err(EngineError::Model(format!("tensor parallelism: {e}")));
            }
        }
        for go in gos {
            let _ = go.send(());
        }
        let plan = TpPlan::new(cfg, 0, world).map_err(EngineError::InvalidConfig)?;
        let nccl = Arc::new(
            NcclComm::join(dev, 0, world, id).map_err(|e| EngineError::Model(e.to_string()))?,
        );
        group.join(&nccl);
        let peer = peers.join(0, dev);
        let shard = TpShard {
            plan,
            comm: Arc::new(TpComm::new(nccl, peer)),
        };
        drop(ready_tx);
        let workers = Self {
            txs,
            ready: Mutex::new(Some(ready_rx)),
            group,
            handles,
        };
        Ok((workers, shard))
    }

    /// Sends `make(reply)` to every worker; their answers come on the returned receivers.
    fn send_all<T>(
        &self,
        make: impl Fn(Reply<T>) -> Command,
    ) -> std::result::Result<Vec<Answer<T>>, String> {
        self.txs
            .iter()
            .map(|tx| {
                let (rtx, rrx) = mpsc::channel();
                tx.send(make(rtx)).map_err(|_| ENDED.to_string())?;
                Ok(rrx)
            })
            .collect()
    }

    /// Every worker's answer, in rank order.
    fn collect<T>(answers: Vec<Answer<T>>) -> std::result::Result<Vec<T>, String> {
        answers
            .into_iter()
            .map(|r| r.recv().map_err(|_| ENDED.to_string())?)
            .collect()
    }

    /// Sends a command without a reply to every worker.
    fn tell_all(&self, make: impl Fn() -> Command) -> Result<()> {
        for tx in &self.txs {
            tx.send(make())
                .map_err(|_| candle_core::Error::Msg(ENDED.into()))?;
        }
        Ok(())
    }
}

fn tp_err(e: String) -> EngineError {
    EngineError::Model(format!("tensor parallelism: {e}"))
}

impl TpGroup for Workers {
    fn wait_loaded(&self) -> std::result::Result<(), EngineError> {
        let ready = self.ready.lock().ok().and_then(|mut g| g.take());
        let Some(ready) = ready else {
            return Ok(());
        };
        for _ in 0..self.txs.len() {
            match ready.recv() {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(tp_err(e)),
                Err(_) => return Err(tp_err("a rank ended while loading".into())),
            }
        }
        Ok(())
    }

    fn kv_blocks(
        &self,
        cfg: &EngineConfig,
        batched_tokens: usize,
        max_model_len: usize,
        own: &mut dyn FnMut() -> std::result::Result<usize, EngineError>,
    ) -> std::result::Result<usize, EngineError> {
        // the other ranks' profiling passes run beside rank 0's, whose collectives they meet
        let others = self
            .send_all(|reply| Command::Size {
                cfg: Box::new(cfg.clone()),
                batched_tokens,
                max_model_len,
                reply,
            })
            .map_err(tp_err)?;
        let mine = own().inspect_err(|e| {
            // the other ranks' profiling passes wait in collectives rank 0 will not run
            self.group.fail(format!("rank 0 sizing its KV cache: {e}"));
        })?;
        let theirs =
            Self::collect(others).map_err(|e| tp_err(format!("sizing a rank's KV cache: {e}")))?;
        Ok(theirs.into_iter().fold(mine, usize::min))
    }

    fn allocate(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_dtype: DType,
        graphs: Option<GraphPlan>,
    ) -> std::result::Result<(), EngineError> {
        self.send_all(|reply| Command::Start {
            num_blocks,
            block_size,
            kv_dtype,
            graphs: graphs.clone(),
            reply,
        })
        .and_then(Self::collect)
        .map(|_| ())
        .map_err(tp_err)
    }
}

impl Followers for Workers {
    fn step(&self, host: &HostBatch, copies: &[(usize, usize)]) -> Result<()> {
        if let Some(e) = self.group.failure() {
            candle_core::bail!("a tensor-parallel rank failed: {e}");
        }
        self.tell_all(|| Command::Step(Box::new((host.clone(), copies.to_vec()))))
    }

    fn capture(&self) -> Result<()> {
        // the captures run at the same time as rank 0's; a rank whose capture fails stops the
        // group (its warm-up would leave the collectives out of step)
        self.tell_all(|| Command::Capture)
    }

    fn fail(&self, why: String) {
        self.group.fail(why);
    }
}

/// How long the other ranks get to let go of their graphs and shards at shutdown before the
/// group is aborted under them.
const RANKS_END_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

impl Drop for Workers {
    fn drop(&mut self) {
        // each rank's loop ends when its channel closes: it drops its graphs (which hold work of
        // the communicator) and its shard while the group is still whole; a rank that does not
        // end in time is waiting in a collective, and aborting the group releases it
        self.txs.clear();
        let deadline = std::time::Instant::now() + RANKS_END_WAIT;
        while self.handles.iter().any(|h| !h.is_finished()) && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        if self.handles.iter().any(|h| !h.is_finished()) {
            tracing::warn!(
                "tensor parallelism: ranks still running {RANKS_END_WAIT:?} after shutdown; \
                 aborting the group"
            );
        }
        self.group.abort();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// What a worker holds: its model until the KV cache is sized, then its runner.
enum Rank {
    Loaded(Box<dyn Model>, DType, Device),
    Running(Box<ModelRunner>),
    /// Between the two.
    Moving,
}

/// Joins the group as `rank` of `world` on `device` and loads this rank's shard.
fn load_rank(
    model: &std::path::Path,
    mut opts: LoadOptions,
    cfg: &DecoderConfig,
    (rank, world): (usize, usize),
    (id, group, peers): (Id, &Group, &PeerExchange),
    device: Device,
) -> std::result::Result<Rank, String> {
    let Device::Cuda(dev) = &device else {
        return Err("not a CUDA device".into());
    };
    let nccl = Arc::new(NcclComm::join(dev, rank, world, id).map_err(msg)?);
    group.join(&nccl);
    let peer = peers.join(rank, dev);
    opts.tp = Some(TpShard {
        plan: TpPlan::new(cfg, rank, world)?,
        comm: Arc::new(TpComm::new(nccl, peer)),
    });
    let loaded = load_model_with(model, &opts, &device).map_err(msg)?;
    device.synchronize().map_err(msg)?;
    Ok(Rank::Loaded(loaded.model, loaded.dtype, device))
}

fn serve(mut rank: Rank, rx: mpsc::Receiver<Command>, group: &Group, id: usize) {
    while let Ok(cmd) = rx.recv() {
        match (cmd, &mut rank) {
            (
                Command::Size {
                    cfg,
                    batched_tokens,
                    max_model_len,
                    reply,
                },
                Rank::Loaded(model, dtype, device),
            ) => {
                let r = crate::engine::kv_sizing::kv_blocks(
                    &cfg,
                    (model.as_ref(), *dtype),
                    device,
                    batched_tokens,
                    (max_model_len, &[]),
                );
                if let Err(e) = &r {
                    // rank 0's profiling pass waits in collectives this rank will not run
                    group.fail(format!("rank {id} sizing its KV cache: {e}"));
                }
                let _ = reply.send(r.map_err(msg));
            }
            (
                Command::Start {
                    num_blocks,
                    block_size,
                    kv_dtype,
                    graphs,
                    reply,
                },
                Rank::Loaded(..),
            ) => {
                let Rank::Loaded(model, _, device) = std::mem::replace(&mut rank, Rank::Moving)
                else {
                    return;
                };
                let mc = model.config();
                let kv = KvCache::new(
                    mc.num_layers,
                    num_blocks,
                    block_size,
                    model.cache_kv_heads(),
                    mc.head_dim,
                    kv_dtype,
                    &device,
                );
                match kv {
                    Ok(mut kv) => {
                        // a checkpoint's FP8 cache scales, as rank 0's cache takes them (only an
                        // FP8 cache reads them)
                        kv.set_scales(&model.kv_cache_scales());
                        rank = Rank::Running(Box::new(ModelRunner::new(
                            model,
                            kv,
                            device,
                            graphs,
                            Vec::new(),
                        )));
                        let _ = reply.send(Ok(()));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(msg(e)));
                        return;
                    }
                }
            }
            (Command::Step(step), Rank::Running(runner)) => {
                let (host, copies) = *step;
                if group.failure().is_some() {
                    continue;
                }
                // rows still being sampled on rank 0 get their tokens from it, as rank 0's
                // runner shares them
                let shared = !host.pending.is_empty();
                let r = runner.prepare_host(host, Vec::new()).and_then(|step| {
                    if shared {
                        runner.share_tokens(&step)?;
                    }
                    runner.execute_after(&copies, &step)
                });
                if let Err(e) = r {
                    group.fail(format!("rank {id}: {e}"));
                }
            }
            (Command::Capture, Rank::Running(runner)) => {
                if let Err(e) = runner.capture_graphs() {
                    group.fail(format!("rank {id}: capturing decode graphs: {e}"));
                }
            }
            (_, _) => {
                group.fail(format!("rank {id}: a command out of order"));
                return;
            }
        }
    }
}
