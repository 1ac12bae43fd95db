//! The device side of multi-adapter serving: for every adapted projection, the matrices of all
//! resident adapters stacked over a fixed number of slots (`--max-loras`), allocated once at load
//! time so that their addresses never change (a captured graph reads them as they are), and
//! written in place when an adapter moves into a slot.
//!
//! A projection is one linear layer of the model, possibly fused: q, k and v share an input and
//! one stack whose `A` holds the three parts' rows one after the other (`[slots, 3 * rank, in]`)
//! and whose `B` rows follow the fused output columns (`[slots, q + k + v, rank]`). Ranks below
//! the slot rank are zero-padded, and the adapter's scale is folded into `B`, so the kernels
//! ([`rserve_kernels::lora`]) need no per-adapter metadata. A slot written for an adapter that
//! does not target a projection (or one of its layers) holds zeros there.

use super::peft::{LoraAdapter, Target};
use candle_core::{DType, Device, Result, Tensor};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// One adapted projection's stacks.
#[derive(Debug)]
pub struct ProjectionSlots {
    pub layer: usize,
    /// The projection's parts, in output order, with their output widths.
    pub parts: Vec<(Target, usize)>,
    /// The widths alone (for the kernels).
    pub widths: Vec<usize>,
    pub in_dim: usize,
    pub rank: usize,
    pub a: Tensor, // [slots, parts * rank, in]
    pub b: Tensor, // [slots, out, rank]
    /// The base weight with `a` stored below it, `[out + slots * parts * rank, in]` (`a` is a
    /// view of its last rows), where the projection's decode rows take one product for both
    /// ([`rserve_kernels::lora_gemv::linear_rows_lora_stacked`]).
    pub stacked: Option<Tensor>,
}

impl ProjectionSlots {
    /// The base weight as stored above the slots (its first `out` rows), when it is.
    pub fn stacked_base(&self) -> Result<Option<Tensor>> {
        let n: usize = self.widths.iter().sum();
        self.stacked.as_ref().map(|w| w.narrow(0, 0, n)).transpose()
    }

    /// Writes `adapter`'s matrices for this projection into `slot` (zeros where it has none).
    /// The slot's block is assembled on the device: each part's matrices are copied up as
    /// stored, `B` scaled in f32 and both rounded once to the slots' dtype, ranks below the
    /// slot rank padded with zeros.
    fn write(&self, slot: usize, adapter: Option<&LoraAdapter>) -> Result<()> {
        let (r, k) = (self.rank, self.in_dim);
        let (dt, dev) = (self.a.dtype(), self.a.device());
        let mut a_parts = Vec::with_capacity(self.parts.len());
        let mut b_parts = Vec::with_capacity(self.parts.len());
        for &(t, w) in &self.parts {
            match adapter.and_then(|ad| ad.modules.get(&(self.layer, t))) {
                Some(m) => {
                    let mr = m.rank();
                    if mr > r {
                        candle_core::bail!("rank {mr} exceeds the slots' rank {r}");
                    }
                    let a = m.a.to_device(dev)?.to_dtype(dt)?; // [mr, k]
                    let b = (m.b.to_device(dev)?.to_dtype(DType::F32)? * m.scale)?.to_dtype(dt)?;
                    if mr < r {
                        a_parts.push(Tensor::cat(&[a, Tensor::zeros((r - mr, k), dt, dev)?], 0)?);
                        b_parts.push(Tensor::cat(&[b, Tensor::zeros((w, r - mr), dt, dev)?], 1)?);
                    } else {
                        a_parts.push(a);
                        b_parts.push(b);
                    }
                }
                None => {
                    a_parts.push(Tensor::zeros((r, k), dt, dev)?);
                    b_parts.push(Tensor::zeros((w, r), dt, dev)?);
                }
            }
        }
        let a = Tensor::cat(&a_parts, 0)?.unsqueeze(0)?; // [1, parts * r, k]
        let b = Tensor::cat(&b_parts, 0)?.unsqueeze(0)?; // [1, out, r]
        self.a.slice_set(&a, 0, slot)?;
        self.b.slice_set(&b, 0, slot)
    }
}

/// Every adapted projection of a model, registered while its layers load.
#[derive(Debug)]
pub struct LoraSlots {
    num_slots: usize,
    rank: usize,
    dtype: DType,
    device: Device,
    projections: Mutex<BTreeMap<(usize, Target), Arc<ProjectionSlots>>>,
}

impl LoraSlots {
    /// `num_slots` adapters of ranks up to `rank` at once, in `dtype` on `device`.
    pub fn new(num_slots: usize, rank: usize, dtype: DType, device: &Device) -> Self {
        Self {
            num_slots,
            rank,
            dtype,
            device: device.clone(),
            projections: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Allocates the (zeroed) stacks of the projection of `layer` made of `parts` over an input
    /// of `in_dim`. With `base` (the projection's dense weight `[out, in_dim]`), `A` is stored
    /// below a copy of it where [`rserve_kernels::lora_gemv::stacked_applies`] says so
    /// ([`ProjectionSlots::stacked`]).
    pub fn register(
        &self,
        layer: usize,
        parts: &[(Target, usize)],
        in_dim: usize,
        base: Option<&Tensor>,
    ) -> Result<Arc<ProjectionSlots>> {
        let (s, r) = (self.num_slots, self.rank);
        let n: usize = parts.iter().map(|(_, w)| w).sum();
        let first = parts
            .first()
            .ok_or_else(|| candle_core::Error::Msg("a projection without parts".into()))?
            .0;
        let pr = parts.len() * r;
        let stacked = match base {
            Some(w)
                if w.dims2()? == (n, in_dim)
                    && w.dtype() == self.dtype
                    && w.device().same_device(&self.device)
                    && rserve_kernels::lora_gemv::stacked_applies(w, s * pr) =>
            {
                let zeros = Tensor::zeros((s * pr, in_dim), self.dtype, &self.device)?;
                Some(Tensor::cat(&[w, &zeros], 0)?)
            }
            _ => None,
        };
        let a = match &stacked {
            Some(w) => w.narrow(0, n, s * pr)?.reshape((s, pr, in_dim))?,
            None => Tensor::zeros((s, pr, in_dim), self.dtype, &self.device)?,
        };
        let proj = Arc::new(ProjectionSlots {
            layer,
            parts: parts.to_vec(),
            widths: parts.iter().map(|(_, w)| *w).collect(),
            in_dim,
            rank: r,
            a,
            b: Tensor::zeros((s, n, r), self.dtype, &self.device)?,
            stacked,
        });
        self.projections
            .lock()
            .map_err(|_| candle_core::Error::Msg("LoRA slots poisoned".into()))?
            .insert((layer, first), proj.clone());
        Ok(proj)
    }

    /// Writes `adapter` into `slot` of every projection (`None`: clears the slot).
    pub fn write(&self, slot: usize, adapter: Option<&LoraAdapter>) -> Result<()> {
        if slot >= self.num_slots {
            candle_core::bail!("LoRA slot {slot} of {}", self.num_slots);
        }
        let projections = self
            .projections
            .lock()
            .map_err(|_| candle_core::Error::Msg("LoRA slots poisoned".into()))?;
        for p in projections.values() {
            p.write(slot, adapter)?;
        }
        Ok(())
    }

    /// Bytes of the stacks on the device.
    pub fn bytes(&self) -> usize {
        self.projections.lock().map_or(0, |ps| {
            ps.values()
                .map(|p| (p.a.elem_count() + p.b.elem_count()) * self.dtype.size_in_bytes())
                .sum()
        })
    }

    /// Whether any projection stores its slots' `A` below its weight (its decode products then
    /// read the `A` rows of every slot they cover).
    pub fn any_stacked(&self) -> bool {
        self.projections
            .lock()
            .is_ok_and(|ps| ps.values().any(|p| p.stacked.is_some()))
    }

    /// The projections registered so far.
    pub fn num_projections(&self) -> usize {
        self.projections.lock().map_or(0, |ps| ps.len())
    }
}

/// The layer and projection a weight prefix names (`model.layers.3.self_attn.q_proj` -> (3, Q)).
pub fn target_of(prefix: &str) -> Option<(usize, Target)> {
    let mut segs = prefix.rsplit('.');
    let module = segs.next()?;
    let parent = segs.next()?;
    let layer = segs.next()?.parse().ok()?;
    if segs.next()? != "layers" {
        return None;
    }
    let t = Target::from_module(module)?;
    (t.parent() == parent).then_some((layer, t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_name_their_layer_and_projection() {
        assert_eq!(
            target_of("model.layers.3.self_attn.q_proj"),
            Some((3, Target::Q))
        );
        assert_eq!(
            target_of("model.layers.12.mlp.down_proj"),
            Some((12, Target::Down))
        );
        assert_eq!(target_of("model.layers.3.mlp.q_proj"), None);
        assert_eq!(target_of("lm_head"), None);
        assert_eq!(target_of("model.layers.x.mlp.up_proj"), None);
    }
}
