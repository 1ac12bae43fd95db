//! Bidirectional attention within segments of a flattened batch: each image, or each window of
//! one, attends to itself only (the vision encoders' blocks).
//!
//! On CUDA, with 16-bit activations and a head dim of 64, 80 or 128, one flash-style kernel per
//! call (`csrc/segment_attention.cu`) reads q, k and v straight from the qkv projection's output.
//! Elsewhere the candle composition runs, which is also the kernel's reference: the segments of
//! each length are gathered and batched into one product, scores are soft-maxed in f32.

use candle_core::{DType, Device, Result, Tensor};
use std::collections::BTreeMap;

/// Largest number of query rows whose scores the composition computes at once (bounds the score
/// matrix: heads x rows x segment length).
const QUERY_CHUNK: usize = 2048;

/// Query rows one kernel CTA takes.
const KERNEL_ROWS: usize = 64;

/// Whether the kernel takes `dtype` activations with heads of `head_dim` on `dev`.
pub fn kernel_fits(dev: &Device, dtype: DType, head_dim: usize) -> bool {
    dev.is_cuda()
        && cfg!(feature = "cuda")
        && matches!(dtype, DType::BF16 | DType::F16)
        && matches!(head_dim, 64 | 80 | 128)
        && std::env::var("RSERVE_SEGMENT_KERNEL").map_or(true, |v| v != "0")
}

/// How to attend within segments `[bounds[i], bounds[i + 1])` of a flattened batch of N rows,
/// built once per encoder pass (its index tensors are uploaded once, not per layer).
pub struct SegmentPlan {
    how: How,
}

enum How {
    /// The kernel's segment starts `[S + 1]` and work items `[W, 2]` (segment, first query).
    Kernel {
        starts: Tensor,
        work: Tensor,
        dtype: DType,
        head_dim: usize,
    },
    /// The composition: per segment length `(length, segments, rows)` with `rows`
    /// `[segments * length]` u32, and `unorder`: row `r` of the concatenated groups' output is
    /// token `unorder[r]`'s.
    Composed {
        groups: Vec<(usize, usize, Tensor)>,
        unorder: Tensor,
    },
}

impl SegmentPlan {
    /// The plan for activations of `dtype` with heads of `head_dim`: the kernel where
    /// [`kernel_fits`], else the composition.
    pub fn new(
        bounds: &[usize],
        n: usize,
        dev: &Device,
        dtype: DType,
        head_dim: usize,
    ) -> Result<Self> {
        check_bounds(bounds, n)?;
        if kernel_fits(dev, dtype, head_dim) {
            Self::kernel(bounds, dev, dtype, head_dim)
        } else {
            Self::composed(bounds, n, dev)
        }
    }

    /// The candle composition whatever the device (the kernel's reference).
    pub fn composed(bounds: &[usize], n: usize, dev: &Device) -> Result<Self> {
        check_bounds(bounds, n)?;
        let mut by_len: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for w in bounds.windows(2) {
            if w[1] > w[0] {
                by_len.entry(w[1] - w[0]).or_default().push(w[0]);
            }
        }
        let mut rows: Vec<u32> = Vec::with_capacity(n);
        let mut groups = Vec::with_capacity(by_len.len());
        for (&len, starts) in &by_len {
            let idx: Vec<u32> = starts
                .iter()
                .flat_map(|&s| (s..s + len).map(|r| r as u32))
                .collect();
            rows.extend_from_slice(&idx);
            groups.push((
                len,
                starts.len(),
                Tensor::from_vec(idx, starts.len() * len, dev)?,
            ));
        }
        let mut inv = vec![0u32; n];
        for (i, &r) in rows.iter().enumerate() {
            if let Some(slot) = inv.get_mut(r as usize) {
                *slot = i as u32;
            }
        }
        Ok(Self {
            how: How::Composed {
                groups,
                unorder: Tensor::from_vec(inv, n, dev)?,
            },
        })
    }

    fn kernel(bounds: &[usize], dev: &Device, dtype: DType, head_dim: usize) -> Result<Self> {
        let starts: Vec<u32> = bounds.iter().map(|&b| b as u32).collect();
        let mut work: Vec<u32> = Vec::new();
        for (s, w) in bounds.windows(2).enumerate() {
            for q in (0..w[1] - w[0]).step_by(KERNEL_ROWS) {
                work.extend_from_slice(&[s as u32, q as u32]);
            }
        }
        let items = work.len() / 2;
        Ok(Self {
            how: How::Kernel {
                starts: Tensor::from_vec(starts, bounds.len(), dev)?,
                work: Tensor::from_vec(work, (items, 2), dev)?,
                dtype,
                head_dim,
            },
        })
    }

    /// Whether [`Self::attend`] runs the kernel.
    pub fn uses_kernel(&self) -> bool {
        matches!(self.how, How::Kernel { .. })
    }

    /// Bidirectional attention of `qkv` (`[N, 3 * heads, head_dim]`: q heads, k heads, v heads)
    /// within the segments; `[N, heads * head_dim]`.
    pub fn attend(&self, qkv: &Tensor, heads: usize) -> Result<Tensor> {
        let (n, all, hd) = qkv.dims3()?;
        if all != 3 * heads {
            candle_core::bail!("segment attention: qkv {:?} for {heads} heads", qkv.shape());
        }
        match &self.how {
            How::Kernel {
                starts,
                work,
                dtype,
                head_dim,
            } => {
                // the plan was made for the kernel: only the operands' match is left to check
                if hd != *head_dim || qkv.dtype() != *dtype || !qkv.device().is_cuda() {
                    candle_core::bail!(
                        "segment attention: planned for head dim {head_dim}, got {:?} {:?}",
                        qkv.dtype(),
                        qkv.shape()
                    );
                }
                if n == 0 || work.dim(0)? == 0 {
                    return Tensor::zeros((n, heads * hd), qkv.dtype(), qkv.device());
                }
                launch(qkv, heads, starts, work)
            }
            How::Composed { groups, unorder } => composed(qkv, heads, groups, unorder),
        }
    }
}

/// Bounds that start at 0, never decrease and end at `n`.
fn check_bounds(bounds: &[usize], n: usize) -> Result<()> {
    let ordered = bounds.windows(2).all(|w| w[0] <= w[1]);
    if bounds.first() != Some(&0) || bounds.last() != Some(&n) || !ordered {
        candle_core::bail!("segment bounds {bounds:?} do not cover 0..{n} in order");
    }
    if n > u32::MAX as usize {
        candle_core::bail!("{n} rows are too many for segment attention");
    }
    Ok(())
}

fn composed(
    qkv: &Tensor,
    heads: usize,
    groups: &[(usize, usize, Tensor)],
    unorder: &Tensor,
) -> Result<Tensor> {
    let hd = qkv.dim(2)?;
    let scale = (hd as f64).powf(-0.5);
    let mut parts = Vec::with_capacity(groups.len());
    for (len, g, rows) in groups {
        let (len, g) = (*len, *g);
        // [g, 3 * heads, len, hd]
        let sel = qkv
            .index_select(rows, 0)?
            .reshape((g, len, 3 * heads, hd))?
            .transpose(1, 2)?;
        let q = sel.narrow(1, 0, heads)?.contiguous()?;
        let kt = sel.narrow(1, heads, heads)?.transpose(2, 3)?.contiguous()?;
        let v = sel.narrow(1, 2 * heads, heads)?.contiguous()?;
        let mut outs = Vec::new();
        let mut q0 = 0;
        while q0 < len {
            let ql = QUERY_CHUNK.min(len - q0);
            let s = (q.narrow(2, q0, ql)?.matmul(&kt)? * scale)?;
            let p =
                candle_nn::ops::softmax_last_dim(&s.to_dtype(DType::F32)?)?.to_dtype(q.dtype())?;
            outs.push(p.matmul(&v)?);
            q0 += ql;
        }
        let o = if outs.len() == 1 {
            outs.remove(0)
        } else {
            Tensor::cat(&outs, 2)?
        };
        parts.push(o.transpose(1, 2)?.reshape((g * len, heads * hd))?);
    }
    let o = match parts.len() {
        0 => return Tensor::zeros((0, heads * hd), qkv.dtype(), qkv.device()),
        1 => parts.remove(0),
        _ => Tensor::cat(&parts, 0)?,
    };
    o.index_select(unorder, 0)
}

#[cfg(feature = "cuda")]
fn launch(qkv: &Tensor, heads: usize, starts: &Tensor, work: &Tensor) -> Result<Tensor> {
    qkv.contiguous()?.apply_op1_no_bwd(&cuda::SegmentAttention {
        heads,
        starts,
        work,
    })
}

#[cfg(not(feature = "cuda"))]
fn launch(_: &Tensor, _: usize, _: &Tensor, _: &Tensor) -> Result<Tensor> {
    candle_core::bail!("segment attention kernel without CUDA")
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::{dtype_suffix, function, storage_view, view};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaStorage, DType, Layout, Result, Shape, Tensor, WithDType};
    use half::{bf16, f16};

    pub struct SegmentAttention<'a> {
        pub heads: usize,
        pub starts: &'a Tensor,
        pub work: &'a Tensor,
    }

    /// Shared bytes of the kernel for head dim `d` (see csrc/segment_attention.cu).
    fn shared_bytes(d: usize) -> usize {
        let bk = if d <= 80 { 64 } else { 32 };
        2 * 2 * bk * (d + 8) * 2
    }

    fn run<T: CudaDType + WithDType + DeviceRepr>(
        op: &SegmentAttention<'_>,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, _, d) = l.shape().dims3()?;
        let dev = s.device().clone();
        let qkv = view::<T>(s, l, "qkv")?;
        let (sg, sl) = op.starts.storage_and_layout();
        let starts = storage_view::<u32>(&sg, sl, "segment starts")?;
        let (wg, wl) = op.work.storage_and_layout();
        let work = storage_view::<u32>(&wg, wl, "segment work")?;
        let items = op.work.dim(0)?;
        // SAFETY: every row of every segment is written; the bounds cover all N rows.
        let mut out = unsafe { crate::cuda::alloc::<T>(&dev, n * op.heads * d) }?;
        let func = function(
            &dev,
            &format!("segment_attention_d{d}_{}", dtype_suffix(T::DTYPE)?),
        )?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&func);
        let heads = op.heads as i32;
        let scale = (d as f32).powf(-0.5);
        b.arg(&mut out)
            .arg(&qkv)
            .arg(&starts)
            .arg(&work)
            .arg(&heads)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (items as u32, op.heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: shared_bytes(d) as u32,
        };
        // SAFETY: argument order and types match `segment_attention_d<D>_<dtype>` in
        // csrc/segment_attention.cu; qkv is contiguous [n, 3 * heads, d] with d in {64, 80, 128}
        // (checked by the caller), the work items lie within the segments.
        unsafe { b.launch(cfg) }.w()?;
        Ok((T::wrap_cuda_slice(out, dev), Shape::from((n, op.heads * d))))
    }

    impl candle_core::CustomOp1 for SegmentAttention<'_> {
        fn name(&self) -> &'static str {
            "segment-attention"
        }

        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &Layout,
        ) -> Result<(candle_core::CpuStorage, Shape)> {
            candle_core::bail!("segment attention: the CPU path is the composition")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            match s.dtype() {
                DType::BF16 => run::<bf16>(self, s, l),
                DType::F16 => run::<f16>(self, s, l),
                dt => candle_core::bail!("segment attention kernel: unsupported dtype {dt:?}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composition_equals_per_segment_softmax() -> Result<()> {
        let dev = Device::Cpu;
        let (n, heads, hd) = (7, 2, 4);
        let qkv = Tensor::randn(0f32, 1.0, (n, 3 * heads, hd), &dev)?;
        let got = SegmentPlan::new(&[0, 3, 5, 7], n, &dev, DType::F32, hd)?.attend(&qkv, heads)?;
        for (s, e) in [(0, 3), (3, 5), (5, 7)] {
            for h in 0..heads {
                let part = |i: usize| -> Result<Tensor> {
                    qkv.narrow(0, s, e - s)?
                        .narrow(1, i * heads + h, 1)?
                        .squeeze(1)
                };
                let (q, k, v) = (part(0)?, part(1)?, part(2)?);
                let p = candle_nn::ops::softmax_last_dim(&(q.matmul(&k.t()?)? * 0.5)?)?;
                let want = p.matmul(&v)?;
                let g = got.narrow(0, s, e - s)?.narrow(1, h * hd, hd)?;
                let d = (g - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(d < 1e-5, "segment {s}..{e} head {h}: {d}");
            }
        }
        Ok(())
    }

    #[test]
    fn bounds_must_cover_the_rows_in_order() {
        let dev = Device::Cpu;
        for bad in [&[0, 3][..], &[1, 7], &[0, 5, 3, 7], &[]] {
            assert!(SegmentPlan::composed(bad, 7, &dev).is_err(), "{bad:?}");
        }
    }
}
