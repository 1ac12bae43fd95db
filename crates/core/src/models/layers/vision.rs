//! Pieces the vision encoders share: bidirectional attention within segments of a flattened
//! batch (each image, or each window of one) and LayerNorm with a bias.

use crate::load_error::LoadError;
use crate::weights::Weights;
use candle_core::{DType, Device, Result, Tensor};
use std::collections::BTreeMap;

/// Largest number of query rows whose scores are computed at once (bounds the score matrix:
/// heads x rows x segment length).
const QUERY_CHUNK: usize = 2048;

/// How to attend within segments `[bounds[i], bounds[i + 1])` of a flattened batch of N rows:
/// the rows of the segments of each length (batched as one product), and the way back to row
/// order. Built once per encoder pass (the index tensors are uploaded once, not per layer).
pub struct SegmentPlan {
    /// Per segment length: `(length, segments, rows)` with `rows` `[segments * length]` u32.
    groups: Vec<(usize, usize, Tensor)>,
    /// Row `r` of the concatenated groups' output is token `unorder[r]`'s.
    unorder: Tensor, // [N] u32
}

impl SegmentPlan {
    pub fn new(bounds: &[usize], n: usize, dev: &Device) -> Result<Self> {
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
        if rows.len() != n {
            candle_core::bail!("segments cover {} of {n} rows", rows.len());
        }
        let mut inv = vec![0u32; n];
        for (i, &r) in rows.iter().enumerate() {
            if let Some(slot) = inv.get_mut(r as usize) {
                *slot = i as u32;
            }
        }
        Ok(Self {
            groups,
            unorder: Tensor::from_vec(inv, n, dev)?,
        })
    }

    /// Bidirectional attention of `qkv` (`[N, 3 * heads, head_dim]`: q heads, k heads, v heads)
    /// within the segments; `[N, heads * head_dim]`. Scores are soft-maxed in f32.
    pub fn attend(&self, qkv: &Tensor, heads: usize) -> Result<Tensor> {
        let hd = qkv.dim(2)?;
        let scale = (hd as f64).powf(-0.5);
        let mut parts = Vec::with_capacity(self.groups.len());
        for (len, g, rows) in &self.groups {
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
                let p = candle_nn::ops::softmax_last_dim(&s.to_dtype(DType::F32)?)?
                    .to_dtype(q.dtype())?;
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
        let o = if parts.len() == 1 {
            parts.remove(0)
        } else {
            Tensor::cat(&parts, 0)?
        };
        o.index_select(&self.unorder, 0)
    }
}

/// [`SegmentPlan::attend`] for one call.
pub fn segment_attention(qkv: &Tensor, heads: usize, bounds: &[usize]) -> Result<Tensor> {
    let n = qkv.dim(0)?;
    SegmentPlan::new(bounds, n, qkv.device())?.attend(qkv, heads)
}

/// Where an encoder pass spends its time, when `RSERVE_VISION_PROFILE` is set: the device is
/// synchronized at each mark and the time since the previous mark is added to the mark's name;
/// the totals are logged at the end. Costs nothing when unset.
pub struct Profile {
    dev: Option<Device>,
    last: std::cell::Cell<std::time::Instant>,
    totals: std::cell::RefCell<Vec<(&'static str, f64)>>,
}

impl Profile {
    pub fn from_env(dev: &Device) -> Self {
        Self {
            dev: std::env::var_os("RSERVE_VISION_PROFILE").map(|_| dev.clone()),
            last: std::cell::Cell::new(std::time::Instant::now()),
            totals: std::cell::RefCell::new(Vec::new()),
        }
    }

    pub fn mark(&self, what: &'static str) -> Result<()> {
        let Some(dev) = &self.dev else {
            return Ok(());
        };
        dev.synchronize()?;
        let now = std::time::Instant::now();
        let ms = (now - self.last.replace(now)).as_secs_f64() * 1e3;
        let mut t = self.totals.borrow_mut();
        match t.iter_mut().find(|(n, _)| *n == what) {
            Some((_, v)) => *v += ms,
            None => t.push((what, ms)),
        }
        Ok(())
    }

    pub fn report(&self, patches: usize) {
        if self.dev.is_some() {
            let parts: Vec<String> = self
                .totals
                .borrow()
                .iter()
                .map(|(n, ms)| format!("{n} {ms:.2} ms"))
                .collect();
            tracing::info!("vision encoder, {patches} patches: {}", parts.join(", "));
        }
    }
}

/// LayerNorm with weight and bias (CLIP's).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor, // [dim]
    bias: Tensor,   // [dim]
    eps: f32,
}

impl LayerNorm {
    pub fn load(w: &Weights, dim: usize, eps: f64) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            weight: w.get(&[dim], "weight")?,
            bias: w.get(&[dim], "bias")?,
            eps: eps as f32,
        })
    }

    /// Normalises over the last dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm(&x.contiguous()?, &self.weight, &self.bias, self.eps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_attention_equals_per_segment_softmax() -> Result<()> {
        let dev = Device::Cpu;
        let (n, heads, hd) = (7, 2, 4);
        let qkv = Tensor::randn(0f32, 1.0, (n, 3 * heads, hd), &dev)?;
        let got = segment_attention(&qkv, heads, &[0, 3, 5, 7])?;
        for (s, e) in [(0, 3), (3, 5), (5, 7)] {
            for h in 0..heads {
                let q = qkv.narrow(0, s, e - s)?.narrow(1, h, 1)?.squeeze(1)?;
                let k = qkv
                    .narrow(0, s, e - s)?
                    .narrow(1, heads + h, 1)?
                    .squeeze(1)?;
                let v = qkv
                    .narrow(0, s, e - s)?
                    .narrow(1, 2 * heads + h, 1)?
                    .squeeze(1)?;
                let p = candle_nn::ops::softmax_last_dim(&(q.matmul(&k.t()?)? * 0.5)?)?;
                let want = p.matmul(&v)?;
                let g = got.narrow(0, s, e - s)?.narrow(1, h * hd, hd)?;
                let d = (g - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(d < 1e-5, "segment {s}..{e} head {h}: {d}");
            }
        }
        Ok(())
    }
}
