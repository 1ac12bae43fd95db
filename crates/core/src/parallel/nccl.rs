//! [`Collective`] over NCCL (loaded at run time from `libnccl.so.2`): one communicator per rank,
//! on the rank's device and the stream its kernels run on, so collectives order with them and
//! are captured into CUDA graphs with them.

use super::Collective;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DeviceSlice;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorageSlice};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// A new group's identity: rank 0 makes it and every rank joins with it.
pub fn unique_id() -> Result<Id> {
    Id::new().map_err(|e| {
        candle_core::Error::Msg(format!(
            "NCCL: {e:?} (is libnccl.so.2 on the library path?)"
        ))
    })
}

/// One rank's communicator.
#[derive(Debug)]
pub struct NcclComm {
    comm: Comm,
}

// SAFETY: a rank's communicator is used by one thread at a time (its loading thread, then its
// engine or worker thread, which takes over after the loading thread is done), never
// concurrently; NCCL permits a communicator to move between threads.
unsafe impl Send for NcclComm {}
// SAFETY: as above: calls on one communicator never overlap.
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins group `id` as `rank` of `world` on `dev`'s stream; blocks until every rank has
    /// joined.
    pub fn join(dev: &CudaDevice, rank: usize, world: usize, id: Id) -> Result<Self> {
        let comm = Comm::from_rank(dev.cuda_stream(), rank, world, id).map_err(|e| {
            candle_core::Error::Msg(format!("NCCL init of rank {rank}/{world}: {e:?}"))
        })?;
        Ok(Self { comm })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    AllReduce,
    AllGather,
}

struct Call<'a> {
    comm: &'a Comm,
    op: Op,
}

impl Call<'_> {
    fn run<T: NcclType + CudaDType + candle_core::WithDType>(
        &self,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("NCCL: the tensor must be contiguous".into()))?;
        let src = s.as_cuda_slice::<T>()?.slice(a..b);
        let dev = s.device().clone();
        let world = self.comm.world_size();
        let (n, shape) = match self.op {
            Op::AllReduce => (src.len(), l.shape().clone()),
            Op::AllGather => {
                let mut dims = vec![world];
                dims.extend_from_slice(l.dims());
                (src.len() * world, Shape::from(dims))
            }
        };
        // SAFETY: every element is written by the collective before any read
        let mut dst = unsafe { dev.alloc::<T>(n) }?;
        let r = match self.op {
            Op::AllReduce => self.comm.all_reduce(&src, &mut dst, &ReduceOp::Sum),
            Op::AllGather => self.comm.all_gather(&src, &mut dst),
        };
        r.map_err(|e| candle_core::Error::Msg(format!("NCCL: {e:?}")))?;
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), shape))
    }
}

impl CustomOp1 for Call<'_> {
    fn name(&self) -> &'static str {
        match self.op {
            Op::AllReduce => "nccl-all-reduce",
            Op::AllGather => "nccl-all-gather",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL collectives take CUDA tensors")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        match &s.slice {
            CudaStorageSlice::BF16(_) => self.run::<bf16>(s, l),
            CudaStorageSlice::F16(_) => self.run::<f16>(s, l),
            CudaStorageSlice::F32(_) => self.run::<f32>(s, l),
            _ => candle_core::bail!("NCCL: unsupported dtype {:?}", s.dtype()),
        }
    }
}

impl Collective for NcclComm {
    fn all_reduce(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(&Call {
            comm: &self.comm,
            op: Op::AllReduce,
        })
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(&Call {
            comm: &self.comm,
            op: Op::AllGather,
        })
    }
}

/// Whether `dt` can go through the collectives.
pub fn supported(dt: DType) -> bool {
    matches!(dt, DType::BF16 | DType::F16 | DType::F32)
}
