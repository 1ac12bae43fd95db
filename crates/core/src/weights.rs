//! Named access to a checkpoint's tensors with Hugging Face names (`pp("self_attn").pp("q_proj")`),
//! shape-checked, converted to the engine's dtype and device.
//!
//! Owns the memory-mapped safetensors files. Every failure is a typed [`LoadError`] that names the
//! tensor (and file where known); nothing here panics on a bad checkpoint.

use crate::load_error::LoadError;
use crate::quant::isq::Isq;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::path::PathBuf;
use std::sync::Arc;

struct Inner {
    st: MmapedSafetensors,
    dtype: DType,
    device: Device,
    files: Vec<PathBuf>,
    /// Quantizes the decoder's projections as they load (`--isq`).
    isq: Option<Arc<Isq>>,
}

/// A view of the checkpoint under a name prefix.
#[derive(Clone)]
pub struct Weights {
    inner: Arc<Inner>,
    prefix: String,
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
                st,
                dtype,
                device: device.clone(),
                files: files.to_vec(),
                isq,
            }),
            prefix: String::new(),
        })
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
        }
    }

    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// The in-situ quantizer of the decoder's projections, when asked for.
    pub fn isq(&self) -> Option<&Arc<Isq>> {
        self.inner.isq.as_ref()
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
        self.inner.st.get(&self.full(name)).is_ok()
    }

    /// The tensor `name`, which must have `shape`, in the engine's dtype on its device.
    pub fn get(&self, shape: &[usize], name: &str) -> Result<Tensor, LoadError> {
        let full = self.full(name);
        let view = self
            .inner
            .st
            .get(&full)
            .map_err(|_| LoadError::MissingTensor {
                name: full.clone(),
                files: self.inner.files.clone(),
            })?;
        if view.shape() != shape {
            return Err(LoadError::TensorShape {
                name: full,
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        let t = self
            .inner
            .st
            .load(&full, &self.inner.device)
            .and_then(|t| t.to_dtype(self.inner.dtype))
            .map_err(|e| LoadError::Tensor {
                name: full.clone(),
                reason: e.to_string(),
            })?;
        Ok(t)
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
