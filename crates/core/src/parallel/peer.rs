//! The collectives of one rank: decode steps' small all-reduces through the one-shot peer kernel
//! (`rserve_kernels::allreduce`; one kernel reading the other GPUs' buffers over NVLink), the
//! rest through NCCL. The ranks set the kernel up together ([`PeerExchange`]); when any rank
//! cannot (no peer access, no memory), every rank uses NCCL alone.
//! After a row-parallel layer of a decode step of up to [`FUSED_ROWS`] rows the kernel also adds
//! the residual and takes the next RMS norm ([`Collective::all_reduce_add_rms_norm`]).
//!
//! On by default; `RSERVE_TP_PEER_ALLREDUCE=0` sends every all-reduce through NCCL, and
//! `RSERVE_TP_FUSED_NORM=0` leaves the residual add and norm to their own kernel.

use super::nccl::NcclComm;
use super::Collective;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{Result, Tensor};
use rserve_kernels::allreduce::{
    enable_peer_access, PeerAllReduce, PeerBuffers, DEFAULT_MAX_BYTES, FUSED_ROWS, MAX_WORLD,
};
use std::sync::{Arc, Barrier, Mutex, OnceLock};

/// Whether tensor-parallel groups use the peer kernel (on unless `RSERVE_TP_PEER_ALLREDUCE=0`).
fn peer_enabled() -> bool {
    std::env::var("RSERVE_TP_PEER_ALLREDUCE").map_or(true, |v| v.trim() != "0")
}

/// Whether the peer kernel also adds the residual and takes the RMS norm after a row-parallel
/// layer (on unless `RSERVE_TP_FUSED_NORM=0`, which leaves them to their own kernel).
fn fused_norm_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("RSERVE_TP_FUSED_NORM").map_or(true, |v| v.trim() != "0"))
}

type Posted = Option<(CudaDevice, (u64, u64))>;

/// What the ranks of one group (threads of this process) exchange to set the peer kernel up.
pub struct PeerExchange {
    world: usize,
    posted: Mutex<Vec<Posted>>,
    ready: Mutex<Vec<bool>>,
    barrier: Barrier,
}

impl PeerExchange {
    pub fn new(world: usize) -> Arc<Self> {
        Arc::new(Self {
            world,
            posted: Mutex::new(vec![None; world]),
            ready: Mutex::new(vec![false; world]),
            barrier: Barrier::new(world),
        })
    }

    /// Rank `rank`'s kernel on `dev`, or `None` when it is off or some rank could not set it up.
    /// When it is on, every rank of the group must call this (it waits for all of them), after
    /// joining the NCCL group; a rank that fails before then leaves the others waiting, as NCCL's
    /// own start does. A rank that fails while the others are inside a call leaves them waiting
    /// ~30 s, after which their kernels stop with a device error.
    pub fn join(&self, rank: usize, dev: &CudaDevice) -> Option<PeerAllReduce> {
        // the switch is the process's, so every rank leaves here alike
        if !(peer_enabled() && self.world > 1 && self.world <= MAX_WORLD) {
            return None;
        }
        let bufs = PeerBuffers::new(dev, DEFAULT_MAX_BYTES)
            .inspect_err(|e| tracing::warn!("peer all-reduce buffers on rank {rank}: {e}"))
            .ok();
        if let Ok(mut p) = self.posted.lock() {
            p[rank] = bufs.as_ref().map(|b| (dev.clone(), b.addresses()));
        }
        self.barrier.wait();
        let posted: Vec<Posted> = self.posted.lock().map(|p| p.clone()).unwrap_or_default();
        let mine = (|| {
            let mut addrs = Vec::with_capacity(self.world);
            for p in &posted {
                let (peer, a) = p.as_ref()?;
                if !enable_peer_access(dev, peer).ok()? {
                    return None;
                }
                addrs.push(*a);
            }
            PeerAllReduce::new(dev, bufs?, rank, &addrs)
                .inspect_err(|e| tracing::warn!("peer all-reduce on rank {rank}: {e}"))
                .ok()
        })();
        if let Ok(mut r) = self.ready.lock() {
            r[rank] = mine.is_some();
        }
        self.barrier.wait();
        let all = self
            .ready
            .lock()
            .map(|r| r.iter().all(|b| *b))
            .unwrap_or(false);
        if let Ok(mut p) = self.posted.lock() {
            p.clear(); // the other ranks' devices are not held past the setup
        }
        if rank == 0 {
            if all {
                tracing::info!(
                    "tensor parallelism: all-reduces of up to {} KiB through peer access, larger ones through NCCL",
                    DEFAULT_MAX_BYTES >> 10
                );
            } else {
                tracing::info!(
                    "tensor parallelism: the GPUs cannot all reach each other directly; every all-reduce goes through NCCL"
                );
            }
        }
        mine.filter(|_| all)
    }
}

/// A rank's collectives: the peer kernel where it takes the message, NCCL otherwise.
#[derive(Debug)]
pub struct TpComm {
    nccl: Arc<NcclComm>,
    peer: Option<PeerAllReduce>,
}

impl TpComm {
    pub fn new(nccl: Arc<NcclComm>, peer: Option<PeerAllReduce>) -> Self {
        Self { nccl, peer }
    }
}

impl Collective for TpComm {
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        match &self.peer {
            Some(p) if p.takes(x) => p.all_reduce(x),
            _ => self.nccl.all_reduce(x),
        }
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        self.nccl.all_gather(x)
    }

    fn broadcast_from_first(&self, x: &Tensor) -> Result<()> {
        self.nccl.broadcast_from_first(x)
    }

    fn all_reduce_add_rms_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        match &self.peer {
            Some(p)
                if fused_norm_enabled()
                    && x.dims().first().is_some_and(|&t| t <= FUSED_ROWS)
                    && p.takes_rows(x, residual, weight) =>
            {
                p.all_reduce_add_rms_norm(x, residual, weight, eps)
            }
            _ => super::reduce_then_add_rms_norm(self, x, residual, weight, eps),
        }
    }
}
