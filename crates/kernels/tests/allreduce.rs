//! The one-shot peer all-reduce against the sum on the CPU: every rank gets the same bits, the
//! sum in rank order (f32 exactly; 16-bit types summed in f32 and rounded once), over enough
//! calls to use both halves of the buffers many times, for message sizes from one vector to the
//! buffers' size. Needs CUDA; with one GPU the group's ranks share it, each on a stream of its
//! own (the kernels of a call wait for each other, so they must run side by side).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)]

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::allreduce::{enable_peer_access, PeerAllReduce, PeerBuffers};

const MAX_BYTES: usize = 1 << 20;

fn gpus() -> usize {
    candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
        .map_or(0, |n| n.max(0) as usize)
}

/// The group of `world` ranks over GPUs 0..world (all on GPU 0 when there are fewer), or `None`
/// when two of them cannot reach each other.
fn group(world: usize) -> Option<(Vec<Device>, Vec<PeerAllReduce>)> {
    let n = gpus();
    let cuda: Vec<CudaDevice> = (0..world)
        .map(|r| CudaDevice::new_with_stream(if n >= world { r } else { 0 }).unwrap())
        .collect();
    let devs: Vec<Device> = cuda.iter().map(|c| Device::Cuda(c.clone())).collect();
    for a in &cuda {
        for b in &cuda {
            if !enable_peer_access(a, b).unwrap() {
                return None;
            }
        }
    }
    let bufs: Vec<PeerBuffers> = cuda
        .iter()
        .map(|d| PeerBuffers::new(d, MAX_BYTES).unwrap())
        .collect();
    let addrs: Vec<(u64, u64)> = bufs.iter().map(|b| b.addresses()).collect();
    let ranks = bufs
        .into_iter()
        .enumerate()
        .map(|(r, b)| PeerAllReduce::new(&cuda[r], b, r, &addrs).unwrap())
        .collect();
    Some((devs, ranks))
}

/// One round: a random input per rank (`elems` of `dtype`), every rank's sum against the CPU's.
fn round(devs: &[Device], ranks: &[PeerAllReduce], elems: usize, dtype: DType) -> Result<()> {
    let inputs: Vec<Tensor> = (0..devs.len())
        .map(|_| Tensor::randn(0f32, 1., elems, &Device::Cpu)?.to_dtype(dtype))
        .collect::<Result<_>>()?;
    let mut want = Tensor::zeros(elems, DType::F32, &Device::Cpu)?;
    for x in &inputs {
        want = (want + x.to_dtype(DType::F32)?)?;
    }
    let want = want
        .to_dtype(dtype)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    let on_device: Vec<Tensor> = inputs
        .iter()
        .zip(devs)
        .map(|(x, d)| x.to_device(d))
        .collect::<Result<_>>()?;
    for (d, x) in devs.iter().zip(&on_device) {
        d.synchronize()?;
        assert_eq!(x.dims(), &[elems]);
    }
    // every rank's kernel is launched before any result is read: they wait for each other
    let outs: Vec<Tensor> = ranks
        .iter()
        .zip(&on_device)
        .map(|(r, x)| {
            assert!(r.takes(x));
            r.all_reduce(x)
        })
        .collect::<Result<_>>()?;
    for (r, out) in outs.iter().enumerate() {
        let got = out.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        assert_eq!(got, want, "rank {r} of {}, {elems} x {dtype:?}", devs.len());
    }
    Ok(())
}

#[test]
fn one_rank_returns_its_input() -> Result<()> {
    if gpus() == 0 {
        eprintln!("no GPU: skipped");
        return Ok(());
    }
    let (devs, ranks) = group(1).unwrap();
    for elems in [4, 4096, MAX_BYTES / 4] {
        round(&devs, &ranks, elems, DType::F32)?;
    }
    Ok(())
}

#[test]
fn ranks_sum_on_every_gpu() -> Result<()> {
    let n = gpus();
    if n == 0 {
        eprintln!("no GPU: skipped");
        return Ok(());
    }
    let world = n.clamp(2, 8);
    let Some((devs, ranks)) = group(world) else {
        eprintln!("the GPUs cannot reach each other: skipped");
        return Ok(());
    };
    let big = Tensor::zeros(MAX_BYTES / 2 + 8, DType::BF16, &devs[0])?;
    assert!(!ranks[0].takes(&big), "above the buffers: NCCL's");
    for i in 0..40 {
        let (elems, dtype) = match i % 5 {
            0 => (4, DType::F32),
            1 => (4096, DType::BF16),
            2 => (8 * 4096, DType::F16),
            3 => (MAX_BYTES / 2, DType::BF16),
            _ => (3 * 4096 + 8, DType::F32),
        };
        round(&devs, &ranks, elems, dtype)?;
    }
    Ok(())
}

/// One round of the fused form: a random partial, residual and weight per rank (`rows` x
/// `hidden` of `dtype`); every rank's (sum, norm) against the plain all-reduce then
/// `add_rms_norm` on rank 0's device, bit for bit.
fn round_norm(
    devs: &[Device],
    ranks: &[PeerAllReduce],
    (rows, hidden): (usize, usize),
    dtype: DType,
) -> Result<()> {
    let make = |r: usize| -> Result<Tensor> {
        Tensor::randn(0f32, 1., (rows, hidden), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(&devs[r])
    };
    let partials: Vec<Tensor> = (0..devs.len()).map(make).collect::<Result<_>>()?;
    let residual = Tensor::randn(0f32, 1., (rows, hidden), &Device::Cpu)?.to_dtype(dtype)?;
    let weight = Tensor::randn(1f32, 0.1, hidden, &Device::Cpu)?.to_dtype(dtype)?;
    let on = |d: &Device| -> Result<(Tensor, Tensor)> {
        Ok((residual.to_device(d)?, weight.to_device(d)?))
    };
    let inputs: Vec<(Tensor, Tensor)> = devs.iter().map(on).collect::<Result<_>>()?;
    for d in devs {
        d.synchronize()?;
    }
    // the plain all-reduce, then the fused one, each launched on every rank before any is read
    let reduced: Vec<Tensor> = ranks
        .iter()
        .zip(&partials)
        .map(|(r, x)| r.all_reduce(x))
        .collect::<Result<_>>()?;
    let fused: Vec<(Tensor, Tensor)> = ranks
        .iter()
        .zip(&partials)
        .zip(&inputs)
        .map(|((r, x), (res, w))| {
            assert!(r.takes_rows(x, res, w));
            r.all_reduce_add_rms_norm(x, res, w, 1e-5)
        })
        .collect::<Result<_>>()?;
    let (res0, w0) = &inputs[0];
    let (want_sum, want_norm) = rserve_kernels::add_rms_norm(&reduced[0], res0, w0, 1e-5)?;
    let host = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    let (want_sum, want_norm) = (host(&want_sum)?, host(&want_norm)?);
    for (r, (sum, norm)) in fused.iter().enumerate() {
        let what = format!("rank {r} of {}, {rows} x {hidden} {dtype:?}", devs.len());
        assert_eq!(host(sum)?, want_sum, "sum, {what}");
        assert_eq!(host(norm)?, want_norm, "norm, {what}");
    }
    Ok(())
}

#[test]
fn fused_norm_matches_the_all_reduce_then_add_rms_norm() -> Result<()> {
    let n = gpus();
    if n == 0 {
        eprintln!("no GPU: skipped");
        return Ok(());
    }
    for world in [1, n.clamp(2, 8)] {
        let Some((devs, ranks)) = group(world) else {
            eprintln!("the GPUs cannot reach each other: skipped");
            return Ok(());
        };
        let wide = Tensor::zeros((2, 4100), DType::BF16, &devs[0])?;
        let w = Tensor::zeros(4100, DType::BF16, &devs[0])?;
        assert!(
            !ranks[0].takes_rows(&wide, &wide, &w),
            "rows of part vectors"
        );
        // interleaved with plain calls (above), so both kernels advance the same epochs
        for i in 0..24 {
            let (shape, dtype) = match i % 4 {
                0 => ((1, 4096), DType::BF16),
                1 => ((37, 4096), DType::BF16), // blocks taking two rows
                2 => ((5, 1024), DType::F16),
                _ => ((3, 8192), DType::F32),
            };
            round_norm(&devs, &ranks, shape, dtype)?;
        }
    }
    Ok(())
}
