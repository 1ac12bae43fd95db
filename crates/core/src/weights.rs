//! Named access to a checkpoint's tensors with Hugging Face names (`pp("self_attn").pp("q_proj")`),
//! shape-checked, converted to the engine's dtype and device.
//!
//! Owns the memory-mapped safetensors files or GGUF file. Every failure is a typed [`LoadError`]
//! that names the tensor (and file where known); nothing here panics on a bad checkpoint.

use crate::gguf::{self, GgufFile};
use crate::load_error::LoadError;
use crate::lora::LoraSlots;
use crate::parallel::{Split, TpShard};
use crate::quant::ggml::GgmlLinear;
use crate::quant::isq::{Isq, StoredQuant};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::GgmlDType;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use rserve_kernels::quantize::BlockType;
use std::path::PathBuf;
use std::sync::Arc;

enum Source {
    Safetensors(MmapedSafetensors),
    Gguf(Arc<GgufFile>),
}

struct Inner {
    source: Source,
    dtype: DType,
    device: Device,
    files: Vec<PathBuf>,
    /// Quantizes the decoder's projections as they load (`--isq`).
    isq: Option<Arc<Isq>>,
    /// Device slots for LoRA adapters: each decoder projection that loads registers its stacks.
    lora: Option<Arc<LoraSlots>>,
    /// Under tensor parallelism: this rank's shard, read from the memory map alone.
    tp: Option<TpShard>,
    /// Pinned buffers that carry tensors to the GPU (made on first use).
    #[cfg(feature = "cuda")]
    staging: crate::staging::Shared,
}

/// A view of the checkpoint under a name prefix.
#[derive(Clone)]
pub struct Weights {
    inner: Arc<Inner>,
    prefix: String,
    /// Loads every linear dense, without ISQ or LoRA slots (a vision tower).
    dense: bool,
}

impl Weights {
    /// Memory-maps the given safetensors files (a lone file or every shard).
    pub fn open(files: &[PathBuf], dtype: DType, device: &Device) -> Result<Self, LoadError> {
        Self::open_with(files, dtype, device, None)
    }

    /// [`Weights::open`], with the decoder's projections quantized by `isq` as they load.
    pub fn open_with(
        files: &[PathBuf],
        dtype: DType,
        device: &Device,
        isq: Option<Arc<Isq>>,
    ) -> Result<Self, LoadError> {
        for f in files {
            if !f.is_file() {
                return Err(LoadError::MissingFile(f.clone()));
            }
        }
        // SAFETY: the files are mapped read-only; rserve never writes to them, and the mapping
        // lives as long as any tensor view borrowed from it.
        let st =
            unsafe { MmapedSafetensors::multi(files) }.map_err(|e| LoadError::Safetensors {
                file: files.first().cloned().unwrap_or_default(),
                reason: format!("{e} (the file may be truncated or not a safetensors file)"),
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                source: Source::Safetensors(st),
                dtype,
                device: device.clone(),
                files: files.to_vec(),
                isq,
                lora: None,
                tp: None,
                #[cfg(feature = "cuda")]
                staging: crate::staging::Shared::default(),
            }),
            prefix: String::new(),
            dense: false,
        })
    }

    /// A GGUF checkpoint: tensors stored in a GGML block format stay in it.
    pub fn from_gguf(
        file: Arc<GgufFile>,
        dtype: DType,
        device: &Device,
        isq: Option<Arc<Isq>>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                files: vec![file.path.clone()],
                source: Source::Gguf(file),
                dtype,
                device: device.clone(),
                isq,
                lora: None,
                tp: None,
                #[cfg(feature = "cuda")]
                staging: crate::staging::Shared::default(),
            }),
            prefix: String::new(),
            dense: false,
        }
    }

    /// The same checkpoint under `prefix.name`.
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        };
        Self {
            inner: self.inner.clone(),
            prefix,
            dense: self.dense,
        }
    }

    /// The same view with its linears loaded dense: in-situ quantization and LoRA slots are for
    /// the decoder's projections, not for a vision tower.
    pub fn dense(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            prefix: self.prefix.clone(),
            dense: true,
        }
    }

    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// The same checkpoint whose decoder projections get LoRA slots (before any view is taken).
    pub fn with_lora(mut self, slots: Option<Arc<LoraSlots>>) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.lora = slots;
        }
        self
    }

    /// The same checkpoint read as one rank's shard (before any view is taken): every tensor
    /// [`TpPlan::split_of`] names is read as that rank's part.
    pub fn with_tp(mut self, shard: Option<TpShard>) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.tp = shard;
        }
        self
    }

    /// This rank's shard under tensor parallelism.
    pub fn tp(&self) -> Option<&TpShard> {
        self.inner.tp.as_ref()
    }

    /// The LoRA slots of the decoder's projections, when adapters are enabled.
    pub fn lora(&self) -> Option<&Arc<LoraSlots>> {
        self.inner.lora.as_ref().filter(|_| !self.dense)
    }

    /// The prefix these weights are under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The in-situ quantizer of the decoder's projections, when asked for.
    pub fn isq(&self) -> Option<&Arc<Isq>> {
        self.inner.isq.as_ref().filter(|_| !self.dense)
    }

    /// The full name of tensor `name` under this prefix.
    pub fn name_of(&self, name: &str) -> String {
        self.full(name)
    }

    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    pub fn contains(&self, name: &str) -> bool {
        let full = self.full(name);
        match &self.inner.source {
            Source::Safetensors(st) => st.get(&full).is_ok(),
            Source::Gguf(g) => gguf::tensor_name(&full).is_some_and(|n| g.tensor(&n).is_some()),
        }
    }

    fn missing(&self, full: String) -> LoadError {
        LoadError::MissingTensor {
            name: full,
            files: self.inner.files.clone(),
        }
    }

    /// A GGUF tensor by its Hugging Face name: its entry and bytes, shape-checked, with the file
    /// rows of Hugging Face row order when the file permutes them (`None` when not).
    #[allow(clippy::type_complexity)]
    fn gguf_tensor<'a>(
        &self,
        g: &'a GgufFile,
        shape: &[usize],
        full: &str,
    ) -> Result<(&'a gguf::TensorInfo, &'a [u8], Option<Vec<usize>>), LoadError> {
        let gname = gguf::tensor_name(full).ok_or_else(|| self.missing(full.to_string()))?;
        let (info, bytes) = g
            .tensor(&gname)
            .ok_or_else(|| self.missing(format!("{full} ({gname})")))?;
        if info.shape() != shape {
            return Err(LoadError::TensorShape {
                name: format!("{full} ({gname})"),
                expected: shape.to_vec(),
                found: info.shape(),
            });
        }
        let rows = gguf::permuted_heads(g, &gname)
            .and_then(|heads| gguf::unpermuted_rows(shape[0], heads));
        Ok((info, bytes, rows))
    }

    /// A GGUF tensor as a dense tensor (dequantized when stored in blocks).
    fn gguf_dense(&self, g: &GgufFile, shape: &[usize], full: &str) -> Result<Tensor, LoadError> {
        let (info, bytes, rows) = self.gguf_tensor(g, shape, full)?;
        let err = |e: candle_core::Error| LoadError::Tensor {
            name: full.to_string(),
            reason: e.to_string(),
        };
        let cpu = Device::Cpu;
        let t = match info.dtype {
            GgmlDType::F32 => Tensor::from_raw_buffer(bytes, DType::F32, shape, &cpu),
            GgmlDType::F16 => Tensor::from_raw_buffer(bytes, DType::F16, shape, &cpu),
            GgmlDType::BF16 => Tensor::from_raw_buffer(bytes, DType::BF16, shape, &cpu),
            t => qtensor_from_ggml(t, &aligned(bytes), shape.to_vec(), &cpu)
                .and_then(|q| q.dequantize(&cpu)),
        }
        .map_err(err)?;
        let t = match rows {
            Some(order) => {
                let idx = Tensor::from_vec(
                    order.into_iter().map(|r| r as u32).collect::<Vec<_>>(),
                    shape[0],
                    &cpu,
                )
                .map_err(err)?;
                t.index_select(&idx, 0).map_err(err)?
            }
            None => t,
        };
        t.to_device(&self.inner.device)
            .and_then(|t| t.to_dtype(self.inner.dtype))
            .map_err(err)
    }

    /// The GGML type and bytes (rows in Hugging Face order) of linear weight `name` `[out, in]`
    /// when the checkpoint stores it in a block format (GGUF); `None` for a dense weight.
    #[allow(clippy::type_complexity)]
    pub fn stored_blocks(
        &self,
        shape: &[usize],
        name: &str,
    ) -> Result<Option<(GgmlDType, std::borrow::Cow<'_, [u8]>)>, LoadError> {
        let Source::Gguf(g) = &self.inner.source else {
            return Ok(None);
        };
        let full = self.full(name);
        let (info, bytes, rows) = self.gguf_tensor(g, shape, &full)?;
        if matches!(
            info.dtype,
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
        ) || shape.len() != 2
        {
            return Ok(None);
        }
        let bytes = match rows {
            Some(order) => {
                let rb = bytes.len() / shape[0];
                order
                    .iter()
                    .flat_map(|&r| &bytes[r * rb..(r + 1) * rb])
                    .copied()
                    .collect::<Vec<u8>>()
                    .into()
            }
            None => aligned(bytes),
        };
        Ok(Some((info.dtype, bytes)))
    }

    /// The linear weights `tensor` `[out, in_dim]` under each of `parts` (a view and its `out`),
    /// quantized by ISQ on the CPU straight from the memory map's rows ([`Isq::quantize_stored`]:
    /// no f32 copy of a tensor) and reported as the one projection `report_as`: each part's GGML
    /// type and bytes, `None` for a part ISQ loads its usual way or not at all (no ISQ, a GPU,
    /// FP8, tensor parallelism, a GGUF source, rows no GGML type fits, a view loaded dense).
    #[allow(clippy::type_complexity)]
    pub fn isq_streamed(
        parts: &[(&Weights, usize)],
        in_dim: usize,
        tensor: &str,
        report_as: &str,
    ) -> Result<Vec<Option<(GgmlDType, std::borrow::Cow<'static, [u8]>)>>, LoadError> {
        let done = parts
            .iter()
            .map(|(w, out)| w.isq_stored(&[*out, in_dim], tensor))
            .collect::<Result<Vec<_>, _>>()?;
        let quantized: Vec<&StoredQuant> = done.iter().flatten().collect();
        if let Some(isq) = parts.first().and_then(|(w, _)| w.isq()) {
            if !quantized.is_empty() {
                isq.report_stored(report_as, &quantized);
            }
        }
        Ok(done
            .into_iter()
            .map(|q| q.map(|q| (q.dtype, q.bytes.into())))
            .collect())
    }

    /// [`Weights::isq_streamed`] of one tensor, unreported.
    fn isq_stored(&self, shape: &[usize], name: &str) -> Result<Option<StoredQuant>, LoadError> {
        let (Some(isq), Source::Safetensors(st)) = (self.isq(), &self.inner.source) else {
            return Ok(None);
        };
        let &[out, cols] = shape else {
            return Ok(None);
        };
        if !self.inner.device.is_cpu() || self.inner.tp.is_some() {
            return Ok(None);
        }
        let full = self.full(name);
        let view = st.get(&full).map_err(|_| self.missing(full.clone()))?;
        if view.shape() != shape {
            return Err(LoadError::TensorShape {
                name: full,
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        let Ok(stored) = DType::try_from(view.dtype()) else {
            return Ok(None);
        };
        isq.quantize_stored(&full, view.data(), stored, (out, cols), self.inner.dtype)
    }

    /// The linear weight `name` `[out, in]` as stored in a GGML block format, when the
    /// checkpoint stores it so (GGUF); `None` for a dense weight.
    pub fn quantized(&self, shape: &[usize], name: &str) -> Result<Option<GgmlLinear>, LoadError> {
        let stored = self.stored_blocks(shape, name)?;
        self.ggml_linear(stored, shape, name)
    }

    /// [`Weights::quantized`] for a decoder projection, which ISQ on the CPU also quantizes
    /// straight from the memory map ([`Weights::isq_stored`]).
    pub fn quantized_projection(
        &self,
        shape: &[usize],
        name: &str,
    ) -> Result<Option<GgmlLinear>, LoadError> {
        if let Some(s) = self.stored_blocks(shape, name)? {
            return self.ggml_linear(Some(s), shape, name);
        }
        let &[out, inp] = shape else {
            return Ok(None);
        };
        let streamed = Self::isq_streamed(&[(self, out)], inp, name, &self.full(name))?;
        self.ggml_linear(streamed.into_iter().flatten().next(), shape, name)
    }

    fn ggml_linear(
        &self,
        stored: Option<(GgmlDType, std::borrow::Cow<'_, [u8]>)>,
        shape: &[usize],
        name: &str,
    ) -> Result<Option<GgmlLinear>, LoadError> {
        let (Some((dtype, bytes)), &[out, inp]) = (stored, shape) else {
            return Ok(None);
        };
        GgmlLinear::from_bytes(dtype, &bytes, (out, inp), &self.inner.device)
            .map(Some)
            .map_err(|e| LoadError::Tensor {
                name: self.full(name),
                reason: e.to_string(),
            })
    }

    /// A table `name` `[rows, cols]` as ggml's bytes in the file, when a GGUF file stores it in a
    /// block format rserve reads and the model runs on the CPU (an embedding table whose rows are
    /// dequantized as they are looked up); `None` otherwise.
    pub fn block_table(
        &self,
        shape: &[usize],
        name: &str,
    ) -> Result<Option<(BlockType, gguf::SharedBytes)>, LoadError> {
        let Source::Gguf(g) = &self.inner.source else {
            return Ok(None);
        };
        if !self.inner.device.is_cpu() || self.inner.tp.is_some() || shape.len() != 2 {
            return Ok(None);
        }
        let full = self.full(name);
        let (info, _, rows) = self.gguf_tensor(g, shape, &full)?;
        let shared = gguf::tensor_name(&full).and_then(|n| g.tensor_shared(&n));
        match (crate::quant::ggml::block_type(info.dtype), rows, shared) {
            (Some(t), None, Some(bytes)) => Ok(Some((t, bytes))),
            _ => Ok(None),
        }
    }

    /// The tensor `name`, which must have `shape`, in the engine's dtype on its device.
    pub fn get(&self, shape: &[usize], name: &str) -> Result<Tensor, LoadError> {
        let full = self.full(name);
        let st = match &self.inner.source {
            Source::Safetensors(st) => st,
            Source::Gguf(g) => return self.gguf_dense(g, shape, &full),
        };
        let view = st.get(&full).map_err(|_| LoadError::MissingTensor {
            name: full.clone(),
            files: self.inner.files.clone(),
        })?;
        if let Some(split) = self.inner.tp.as_ref().and_then(|t| t.plan.split_of(&full)) {
            let rank = self.inner.tp.as_ref().map_or(0, |t| t.plan.rank);
            let dtype = DType::try_from(view.dtype()).map_err(|e| LoadError::Tensor {
                name: full.clone(),
                reason: e.to_string(),
            })?;
            let stored = (view.shape().to_vec(), dtype, view.data());
            return self.shard_of(stored, &full, shape, &split, rank);
        }
        if view.shape() != shape {
            return Err(LoadError::TensorShape {
                name: full,
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        #[cfg(feature = "cuda")]
        if let Ok(stored) = DType::try_from(view.dtype()) {
            let staged = self.staged(view.data(), stored, shape);
            if let Some(t) = staged.map_err(|e| LoadError::Tensor {
                name: full.clone(),
                reason: e.to_string(),
            })? {
                return Ok(t);
            }
        }
        let stored = DType::try_from(view.dtype()).ok();
        if let Some(t) = stored.and_then(|d| self.widened(view.data(), d, shape)) {
            return t.map_err(|e| LoadError::Tensor {
                name: full.clone(),
                reason: e.to_string(),
            });
        }
        let t = st
            .load(&full, &self.inner.device)
            .and_then(|t| t.to_dtype(self.inner.dtype))
            .map_err(|e| LoadError::Tensor {
                name: full.clone(),
                reason: e.to_string(),
            })?;
        Ok(t)
    }

    /// A 16-bit tensor for an f32 model on the CPU, converted straight from the memory map on
    /// every core ([`crate::host::widen_to_f32`]); `None` for any other case.
    fn widened(
        &self,
        data: &[u8],
        stored: DType,
        shape: &[usize],
    ) -> Option<candle_core::Result<Tensor>> {
        if !self.inner.device.is_cpu() || self.inner.dtype != DType::F32 {
            return None;
        }
        let bf16 = match stored {
            DType::BF16 => true,
            DType::F16 => false,
            _ => return None,
        };
        let values = crate::host::widen_to_f32(data, bf16)?;
        Some(Tensor::from_vec(values, shape, &Device::Cpu))
    }

    /// A large tensor stored in the engine's dtype, carried to the GPU through pinned staging
    /// buffers; `None` when it takes the plain path (the CPU, a conversion, a small tensor).
    #[cfg(feature = "cuda")]
    fn staged(
        &self,
        data: &[u8],
        stored: DType,
        shape: &[usize],
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(dev) = &self.inner.device else {
            return Ok(None);
        };
        match stored {
            dt if dt == self.inner.dtype && data.len() >= crate::staging::MIN_BYTES => self
                .inner
                .staging
                .with(dev, |s| s.upload(dev, data, dt, shape))
                .map(Some),
            _ => Ok(None),
        }
    }

    /// Rank `rank`'s `split` of a checkpoint tensor (`full`; its stored shape, dtype and bytes),
    /// of local `shape`: only its own bytes are copied out of the memory map.
    fn shard_of(
        &self,
        (stored, dtype, data): (Vec<usize>, DType, &[u8]),
        full: &str,
        shape: &[usize],
        split: &Split,
        rank: usize,
    ) -> Result<Tensor, LoadError> {
        let err = |reason: String| LoadError::Tensor {
            name: full.to_string(),
            reason,
        };
        let esize = dtype.size_in_bytes();
        let mismatch = |expected: Vec<usize>| LoadError::TensorShape {
            name: full.to_string(),
            expected,
            found: stored.clone(),
        };
        // a contiguous run of rows is uploaded straight from the map; other shards are gathered
        // (one move per row, rows in parallel) into a buffer first
        let gathered: Vec<u8>;
        let bytes: &[u8] = match split {
            Split::Rows {
                rows,
                full: n,
                padded,
            } => {
                let rest: usize = shape.iter().skip(1).product();
                let want: Vec<usize> = std::iter::once(*n)
                    .chain(shape.iter().skip(1).copied())
                    .collect();
                if stored != want || shape.first() != Some(padded) {
                    return Err(mismatch(want));
                }
                if rows.end > *n || rows.len() > *padded {
                    return Err(err(format!("rows {rows:?} of {n} do not fit {padded}")));
                }
                let row = rest * esize;
                let own = &data[rows.start * row..rows.end * row];
                if rows.len() == *padded {
                    own
                } else {
                    gathered = [own, &vec![0; (padded - rows.len()) * row]].concat();
                    &gathered
                }
            }
            Split::Cols { cols, full: n } => {
                let want = vec![shape.first().copied().unwrap_or(0), *n];
                if stored != want || shape.len() != 2 || shape[1] != cols.len() {
                    return Err(mismatch(want));
                }
                if cols.end > *n {
                    return Err(err(format!("columns {cols:?} of {n}")));
                }
                gathered = gather_cols(data, n * esize, cols.start * esize..cols.end * esize);
                &gathered
            }
            Split::RankZero => {
                if stored != shape {
                    return Err(mismatch(shape.to_vec()));
                }
                if rank == 0 {
                    data
                } else {
                    gathered = vec![0; data.len()];
                    &gathered
                }
            }
        };
        #[cfg(feature = "cuda")]
        if let Some(t) = self
            .staged(bytes, dtype, shape)
            .map_err(|e| err(e.to_string()))?
        {
            return Ok(t);
        }
        Tensor::from_raw_buffer(bytes, dtype, shape, &Device::Cpu)
            .and_then(|t| t.to_device(&self.inner.device))
            .and_then(|t| t.to_dtype(self.inner.dtype))
            .map_err(|e| err(e.to_string()))
    }

    /// The value of the one-element tensor `name` (shape `[]` or `[1]`), or `None` when absent.
    pub fn scalar_opt(&self, name: &str) -> Result<Option<f32>, LoadError> {
        if !self.contains(name) {
            return Ok(None);
        }
        let t = match self.get(&[], name) {
            Err(LoadError::TensorShape { .. }) => self.get(&[1], name)?,
            other => other?,
        };
        let v = t
            .flatten_all()
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| LoadError::Tensor {
                name: self.full(name),
                reason: e.to_string(),
            })?;
        Ok(v.first().copied())
    }

    /// Like [`Weights::get`] but `None` when the tensor is absent.
    pub fn get_opt(&self, shape: &[usize], name: &str) -> Result<Option<Tensor>, LoadError> {
        if self.contains(name) {
            self.get(shape, name).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// `bytes` where they lie when aligned for any GGML block (candle reads the blocks in place),
/// else a copy (a file with a small `general.alignment`).
fn aligned(bytes: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if (bytes.as_ptr() as usize).is_multiple_of(8) {
        std::borrow::Cow::Borrowed(bytes)
    } else {
        std::borrow::Cow::Owned(bytes.to_vec())
    }
}

/// The byte columns `cols` of every `row`-byte row of `data`, row after row.
fn gather_cols(data: &[u8], row: usize, cols: std::ops::Range<usize>) -> Vec<u8> {
    use rayon::prelude::*;
    let width = cols.len();
    let mut out = vec![0u8; data.len() / row.max(1) * width];
    if width > 0 {
        out.par_chunks_mut(width)
            .zip(data.par_chunks_exact(row))
            .for_each(|(o, r)| o.copy_from_slice(&r[cols.clone()]));
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn column_shards_take_each_rows_own_bytes() {
        let data: Vec<u8> = (0..24).collect(); // 3 rows of 8 bytes
        assert_eq!(
            super::gather_cols(&data, 8, 2..5),
            vec![2, 3, 4, 10, 11, 12, 18, 19, 20]
        );
        assert!(super::gather_cols(&data, 8, 4..4).is_empty());
    }
}
