//! Pieces the vision encoders share: bidirectional attention within segments of a flattened
//! batch (each image, or each window of one) and LayerNorm with a bias.

use crate::load_error::LoadError;
use crate::weights::Weights;
use candle_core::{Device, Result, Tensor};

pub use rserve_kernels::segment_attention::SegmentPlan;

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
