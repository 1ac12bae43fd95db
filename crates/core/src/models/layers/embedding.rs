//! The token embedding table `[vocab, hidden]`: a dense tensor, or (a GGUF checkpoint on the CPU)
//! the file's GGML blocks, read in place from its memory map and dequantized one looked-up row
//! at a time, as llama.cpp does. A 150k-token vocabulary then costs its quantized bytes instead of a
//! dequantized f32 table several times their size, and loading skips dequantizing it.

use crate::gguf::SharedBytes;
use crate::load_error::LoadError;
use crate::parallel::{embed_shard, TpShard};
use crate::weights::Weights;
use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::quantize::{self, BlockType};

/// An embedding table.
#[derive(Debug, Clone)]
pub enum Embedding {
    /// `[vocab, hidden]` in the model's dtype.
    Dense(Tensor),
    /// ggml's bytes (in the file's map) of `rows` rows of `hidden` values in `format`.
    Blocks {
        format: BlockType,
        bytes: SharedBytes,
        rows: usize,
        hidden: usize,
        dtype: DType,
        device: Device,
    },
}

impl Embedding {
    /// Loads `name` (`[vocab, hidden]`) under `w`.
    pub fn load(
        w: &Weights,
        shape: [usize; 2],
        name: &str,
    ) -> std::result::Result<Self, LoadError> {
        if let Some((format, bytes)) = w.block_table(&shape, name)? {
            return Ok(Self::Blocks {
                format,
                bytes,
                rows: shape[0],
                hidden: shape[1],
                dtype: w.dtype(),
                device: w.device().clone(),
            });
        }
        w.get(&shape, name).map(Self::Dense)
    }

    /// The dense table (`None` when kept in blocks).
    pub fn dense(&self) -> Option<&Tensor> {
        match self {
            Self::Dense(t) => Some(t),
            Self::Blocks { .. } => None,
        }
    }

    /// `(vocab, hidden)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match self {
            Self::Dense(t) => t.dims2(),
            Self::Blocks { rows, hidden, .. } => Ok((*rows, *hidden)),
        }
    }

    pub fn device(&self) -> &Device {
        match self {
            Self::Dense(t) => t.device(),
            Self::Blocks { device, .. } => device,
        }
    }

    /// The rows of `ids` (`[n]`, u32) -> `[n, hidden]`; under tensor parallelism this rank's
    /// share of them, summed over the group.
    pub fn forward(&self, ids: &Tensor, tp: Option<&TpShard>) -> Result<Tensor> {
        match (self, tp) {
            (Self::Dense(t), None) => t.index_select(ids, 0),
            (Self::Dense(t), Some(tp)) => {
                let part = embed_shard(t, ids, tp.plan.vocab().start)?;
                tp.comm.all_reduce(&part)
            }
            (Self::Blocks { .. }, Some(_)) => {
                candle_core::bail!("a quantized embedding table is not sharded")
            }
            (
                Self::Blocks {
                    format,
                    bytes,
                    rows,
                    hidden,
                    dtype,
                    device,
                },
                None,
            ) => {
                let ids = ids.to_vec1::<u32>()?;
                let rb = format.row_bytes(*hidden);
                let mut out = vec![0f32; ids.len() * hidden];
                for (o, &id) in out.chunks_exact_mut(*hidden).zip(&ids) {
                    let id = id as usize;
                    if id >= *rows {
                        candle_core::bail!("token id {id} is outside the vocabulary of {rows}");
                    }
                    quantize::dequantize_into(*format, &bytes[id * rb..][..rb], o);
                }
                Tensor::from_vec(out, (ids.len(), *hidden), device)?.to_dtype(*dtype)
            }
        }
    }
}
