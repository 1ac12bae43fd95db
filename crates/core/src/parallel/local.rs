//! [`Collective`] between threads of this process over host tensors: the reference the NCCL
//! group is checked against, and what the sharding is tested with on machines without GPUs.

use super::Collective;
use candle_core::{Result, Tensor};
use std::sync::{Arc, Barrier, Mutex};

/// The shared side of a group of `world` ranks.
#[derive(Debug)]
struct Shared {
    barrier: Barrier,
    slots: Mutex<Vec<Option<Tensor>>>,
}

/// One rank of a group of threads.
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalComm {
    /// The `world` ranks of a new group, rank 0 first; each goes to its own thread.
    pub fn group(world: usize) -> Vec<LocalComm> {
        let shared = Arc::new(Shared {
            barrier: Barrier::new(world),
            slots: Mutex::new(vec![None; world]),
        });
        (0..world)
            .map(|rank| LocalComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Every rank's `x`, in rank order (all ranks call it together).
    fn exchange(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let poisoned = || candle_core::Error::Msg("a rank of the group panicked".into());
        self.shared.slots.lock().map_err(|_| poisoned())?[self.rank] = Some(x.clone());
        self.shared.barrier.wait();
        let all = self
            .shared
            .slots
            .lock()
            .map_err(|_| poisoned())?
            .iter()
            .map(|t| {
                t.clone()
                    .ok_or_else(|| candle_core::Error::Msg("a rank sent nothing".into()))
            })
            .collect::<Result<Vec<_>>>();
        // nobody overwrites a slot before every rank has read them all
        self.shared.barrier.wait();
        all
    }
}

impl Collective for LocalComm {
    fn broadcast_from_first(&self, x: &Tensor) -> Result<()> {
        let all = self.exchange(x)?;
        x.slice_set(&all[0], 0, 0)
    }

    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        let all = self.exchange(x)?;
        let mut sum = all[0].clone();
        for t in &all[1..] {
            sum = (sum + t)?;
        }
        Ok(sum)
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::stack(&self.exchange(x)?, 0)
    }
}
