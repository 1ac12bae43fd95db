//! Pieces the vision encoders share: bidirectional attention within segments of a flattened
//! batch (each image, or each window of one), LayerNorm with a bias and the two-layer MLP of
//! ViTs (CLIP's, Qwen2-VL's).

use super::linear::Linear;
use crate::batch::LayerCtx;
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

    /// Normalises over the last dimension (one kernel on GPUs).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        rserve_kernels::layer_norm::layer_norm(x, &self.weight, &self.bias, f64::from(self.eps))
    }

    /// `(x + residual, norm(x + residual))` for `[tokens, hidden]` rows (one kernel on GPUs).
    pub fn forward_add(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        let eps = f64::from(self.eps);
        rserve_kernels::layer_norm::add_layer_norm(x, residual, &self.weight, &self.bias, eps)
    }
}

/// The activation between a ViT MLP's two layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VitAct {
    /// `x * sigmoid(1.702 x)` (CLIP's and Qwen2-VL's `quick_gelu`).
    QuickGelu,
    /// The exact (erf) GELU.
    Gelu,
}

impl VitAct {
    /// A config's `hidden_act`; anything else is a config error naming it.
    pub fn parse(name: &str) -> std::result::Result<Self, LoadError> {
        match name {
            "quick_gelu" => Ok(Self::QuickGelu),
            "gelu" => Ok(Self::Gelu),
            a => Err(LoadError::Config {
                field: "vision_config".into(),
                reason: format!("hidden_act `{a}` is not supported (quick_gelu, gelu)"),
            }),
        }
    }

    pub fn forward(self, h: &Tensor) -> Result<Tensor> {
        match self {
            Self::QuickGelu => rserve_kernels::activation::quick_gelu(h),
            Self::Gelu => h.gelu_erf(),
        }
    }
}

/// A ViT's MLP: `fc2(act(fc1(x)))`, both with biases.
pub struct VitMlp {
    fc1: Linear, // [intermediate, hidden]
    fc2: Linear, // [hidden, intermediate]
    act: VitAct,
}

impl VitMlp {
    /// `fc1` and `fc2` under `w`.
    pub fn load(
        w: &Weights,
        hidden: usize,
        intermediate: usize,
        act: VitAct,
    ) -> std::result::Result<Self, LoadError> {
        Ok(Self {
            fc1: Linear::load(&w.pp("fc1"), hidden, intermediate, true)?,
            fc2: Linear::load(&w.pp("fc2"), intermediate, hidden, true)?,
            act,
        })
    }

    pub fn forward(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        let h = self.act.forward(&self.fc1.forward(x, ctx)?)?;
        self.fc2.forward(&h, ctx)
    }
}
