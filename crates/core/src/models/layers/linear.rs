//! The linear layer `y = x W^T + b` over flattened tokens (`x`: `[num_tokens, in]`): the one place
//! a weight is applied to activations, the LM head and the fused gate-up projection included.
//!
//! How the weight is stored and multiplied is a [`LinearMethod`]: [`Dense`] today; a quantized
//! format is another method, and a LoRA adapter wraps one ([`LoraLinear`], reading the rows'
//! adapter slots from the [`LayerCtx`]; every decoder projection is wrapped when the checkpoint
//! loads with LoRA slots). Model code only ever sees [`Linear`], so no model file changes for either.

use super::embedding::Embedding;
use crate::batch::LayerCtx;
use crate::load_error::LoadError;
use crate::lora::slots::target_of;
use crate::lora::LoraLinear;
use crate::quant::ggml::GgmlLinear;
use crate::weights::Weights;
use candle_core::quantized::GgmlDType;
use candle_core::{Result, Tensor};
use rserve_kernels::fp8::Fp8Rows;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// How a linear layer's weight multiplies its input rows.
pub trait LinearMethod: Send + Sync + fmt::Debug {
    /// `x`: `[num_tokens, in]` -> `x W^T`, `[num_tokens, out]` (the bias is the layer's).
    fn matmul(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor>;

    /// For a fused gate-up weight (gate rows, then up rows): `silu(x G^T) * (x U^T)`,
    /// `[num_tokens, out / 2]`. A method with a fused kernel overrides it.
    fn matmul_silu_glu(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        rserve_kernels::silu_and_mul(&self.matmul(x, ctx)?)
    }

    /// `x W^T + bias` (`bias` `[out]`). A method whose product can add the bias itself
    /// overrides it.
    fn matmul_bias(&self, x: &Tensor, bias: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        rserve_kernels::add_bias(&self.matmul(x, ctx)?, bias)
    }

    /// `(out, in)`.
    fn shape(&self) -> (usize, usize);

    /// The weight `[out, in]` when it is stored as loaded, in the model's dtype: fused kernels
    /// that stream it themselves (the LoRA decode product) take it; other methods have none.
    fn dense_weight(&self) -> Option<&Tensor> {
        None
    }

    /// Whether the product quantizes the rows of `x` to FP8 itself (an FP8 tensor-core product),
    /// so that the kernel before it may hand them over in that form as well
    /// ([`LinearMethod::matmul_fp8_rows`]).
    fn takes_fp8_rows(&self, _x: &Tensor) -> bool {
        false
    }

    /// [`LinearMethod::matmul`] (with `glu`, [`LinearMethod::matmul_silu_glu`]) of `x` whose FP8
    /// form `rows` came with it.
    fn matmul_fp8_rows(
        &self,
        x: &Tensor,
        _rows: &Fp8Rows,
        glu: bool,
        ctx: &LayerCtx<'_>,
    ) -> Result<Tensor> {
        if glu {
            self.matmul_silu_glu(x, ctx)
        } else {
            self.matmul(x, ctx)
        }
    }

    /// [`LinearMethod::matmul_silu_glu`] of `x` (with its FP8 form `rows` where it came), and the
    /// result's FP8 form where the product makes it in the same pass, for a next product that
    /// [takes FP8 rows](LinearMethod::takes_fp8_rows). Only the FP8 method makes it.
    fn matmul_silu_glu_rows(
        &self,
        x: &Tensor,
        rows: Option<&Fp8Rows>,
        ctx: &LayerCtx<'_>,
    ) -> Result<(Tensor, Option<Fp8Rows>)> {
        let y = match rows {
            Some(r) => self.matmul_fp8_rows(x, r, true, ctx)?,
            None => self.matmul_silu_glu(x, ctx)?,
        };
        Ok((y, None))
    }
}

/// A weight kept as it was loaded, `[out, in]` in the model's dtype.
#[derive(Debug, Clone)]
pub struct Dense {
    weight: Tensor,
}

impl Dense {
    pub fn new(weight: Tensor) -> Self {
        Self { weight }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

impl LinearMethod for Dense {
    fn matmul(&self, x: &Tensor, _ctx: &LayerCtx<'_>) -> Result<Tensor> {
        rserve_kernels::linear_rows(x, &self.weight)
    }

    /// One kernel for decode batches on CUDA.
    fn matmul_silu_glu(&self, x: &Tensor, _ctx: &LayerCtx<'_>) -> Result<Tensor> {
        rserve_kernels::silu_glu_rows(x, &self.weight)
    }

    /// The bias in the product's epilogue for prompt-sized batches on CUDA.
    fn matmul_bias(&self, x: &Tensor, bias: &Tensor, _ctx: &LayerCtx<'_>) -> Result<Tensor> {
        rserve_kernels::linear_bias(x, &self.weight, bias)
    }

    fn shape(&self) -> (usize, usize) {
        let d = self.weight.dims();
        (
            d.first().copied().unwrap_or(0),
            d.get(1).copied().unwrap_or(0),
        )
    }

    fn dense_weight(&self) -> Option<&Tensor> {
        Some(&self.weight)
    }
}

/// Several weights applied to the same input, their outputs side by side (a fused projection
/// whose parts are stored in different formats).
#[derive(Debug)]
pub struct Stacked(pub Vec<Arc<dyn LinearMethod>>);

impl LinearMethod for Stacked {
    fn matmul(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        let outs = self
            .0
            .iter()
            .map(|m| m.matmul(x, ctx))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&outs, 1)
    }

    fn shape(&self) -> (usize, usize) {
        let inp = self.0.first().map_or(0, |m| m.shape().1);
        (self.0.iter().map(|m| m.shape().0).sum(), inp)
    }
}

#[derive(Debug, Clone)]
pub struct Linear {
    method: Arc<dyn LinearMethod>,
    bias: Option<Tensor>, // [out]
}

impl Linear {
    /// A dense layer of `weight` `[out, in]`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::with_method(Arc::new(Dense::new(weight)), bias)
    }

    /// A layer whose weight is applied by `method`.
    pub fn with_method(method: Arc<dyn LinearMethod>, bias: Option<Tensor>) -> Self {
        Self { method, bias }
    }

    /// Loads `weight` (and `bias` when `bias` is true) under `w`.
    pub fn load(
        w: &Weights,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        let layer = if let Some(q) = w.quantized_projection(&[out_dim, in_dim], "weight")? {
            let bias = Self::load_bias(w, out_dim, bias)?;
            Self::with_method(Arc::new(q), bias)
        } else {
            let (weight, bias) = Self::load_parts(w, in_dim, out_dim, bias)?;
            Self::build(w, &w.name_of("weight"), weight, bias)?
        };
        layer.with_lora(&[(w, out_dim)], in_dim)
    }

    /// The layer wrapped in a [`LoraLinear`] when the checkpoint is loaded with LoRA slots and
    /// every part (`parts`: prefix and output width) is a projection adapters can target.
    fn with_lora(
        self,
        parts: &[(&Weights, usize)],
        in_dim: usize,
    ) -> std::result::Result<Self, LoadError> {
        let Some(slots) = parts.first().and_then(|(w, _)| w.lora().cloned()) else {
            return Ok(self);
        };
        let mut layer = None;
        let mut targets = Vec::with_capacity(parts.len());
        for (w, out) in parts {
            let Some((l, t)) = target_of(w.prefix()) else {
                return Ok(self);
            };
            if layer.is_some_and(|x| x != l) {
                return Ok(self);
            }
            layer = Some(l);
            targets.push((t, *out));
        }
        let Some(layer) = layer else {
            return Ok(self);
        };
        let err = |e: candle_core::Error| LoadError::Tensor {
            name: format!("LoRA slots of {}", parts[0].0.prefix()),
            reason: e.to_string(),
        };
        let proj = slots
            .register(layer, &targets, in_dim, self.method.dense_weight())
            .map_err(err)?;
        // a weight copied above the slots is served from there
        let base: Arc<dyn LinearMethod> = match proj.stacked_base().map_err(err)? {
            Some(w) => Arc::new(Dense::new(w)),
            None => self.method,
        };
        Ok(Self::with_method(
            Arc::new(LoraLinear::new(base, proj)),
            self.bias,
        ))
    }

    /// The output head `[vocab, hidden]`: `lm_head.weight`, or the input embeddings when tied.
    /// A head stored quantized (GGUF) stays so; a dense one is quantized only when ISQ is asked
    /// to take the head too (`--isq-lm-head`).
    pub fn load_head(
        w: &Weights,
        embed: &Embedding,
        tied: bool,
    ) -> std::result::Result<Self, LoadError> {
        let (vocab, hidden) = embed.dims().map_err(|e| LoadError::Tensor {
            name: "embeddings".into(),
            reason: e.to_string(),
        })?;
        let name = if tied && !w.contains("lm_head.weight") {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        if let Some(q) = w.quantized(&[vocab, hidden], name)? {
            return Ok(Self::with_method(Arc::new(q), None));
        }
        let weight = match (name, embed.dense()) {
            ("model.embed_tokens.weight", Some(dense)) => dense.clone(),
            _ => w.get(&[vocab, hidden], name)?,
        };
        match w.isq().filter(|q| q.lm_head()) {
            Some(isq) => Ok(Self::with_method(isq.linear(name, weight)?, None)),
            None => Ok(Self::new(weight, None)),
        }
    }

    /// A loaded projection: quantized when the checkpoint is loaded with ISQ, else dense.
    fn build(
        w: &Weights,
        name: &str,
        weight: Tensor,
        bias: Option<Tensor>,
    ) -> std::result::Result<Self, LoadError> {
        match w.isq() {
            Some(isq) => Ok(Self::with_method(isq.linear(name, weight)?, bias)),
            None => Ok(Self::new(weight, bias)),
        }
    }

    /// `weight` `[out_dim, in_dim]` (and `bias` `[out_dim]` when `bias`) under `w`, dense.
    pub(crate) fn load_parts(
        w: &Weights,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> std::result::Result<(Tensor, Option<Tensor>), LoadError> {
        let weight = w.get(&[out_dim, in_dim], "weight")?;
        Ok((weight, Self::load_bias(w, out_dim, bias)?))
    }

    fn load_bias(
        w: &Weights,
        out_dim: usize,
        bias: bool,
    ) -> std::result::Result<Option<Tensor>, LoadError> {
        if bias {
            w.get(&[out_dim], "bias").map(Some)
        } else {
            Ok(None)
        }
    }

    /// Several projections of the same input as one: the weights (and biases) of `parts` (each a
    /// prefix and its output width) stacked along the output dimension, in order.
    pub fn load_fused(
        parts: &[(&Weights, usize)],
        in_dim: usize,
        bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        let mut stored = parts
            .iter()
            .map(|(w, out)| w.stored_blocks(&[*out, in_dim], "weight"))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if let (true, Some((first, _))) = (stored.iter().all(Option::is_none), parts.first()) {
            // ISQ on the CPU quantizes each part from the memory map
            let fused = first.name_of("weight (fused)");
            stored = Weights::isq_streamed(parts, in_dim, "weight", &fused)?;
        }
        if stored.iter().any(Option::is_some) {
            return Self::fuse_stored(parts, stored, in_dim, bias)?.with_lora(parts, in_dim);
        }
        let loaded = parts
            .iter()
            .map(|(w, out)| Self::load_parts(w, in_dim, *out, bias))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let fuse = |ts: Vec<&Tensor>| {
            if ts.len() == 1 {
                return Ok(ts[0].clone());
            }
            Tensor::cat(&ts, 0).map_err(|e| LoadError::Tensor {
                name: "fused projection".into(),
                reason: e.to_string(),
            })
        };
        let weight = fuse(loaded.iter().map(|(w, _)| w).collect())?;
        let bias = if bias {
            Some(fuse(
                loaded.iter().filter_map(|(_, b)| b.as_ref()).collect(),
            )?)
        } else {
            None
        };
        let (first, _) = parts.first().ok_or_else(|| LoadError::Tensor {
            name: "fused projection".into(),
            reason: "no parts".into(),
        })?;
        Self::build(first, &first.name_of("weight (fused)"), weight, bias)?.with_lora(parts, in_dim)
    }

    /// [`Linear::load_fused`] of weights a checkpoint stores quantized: one packed weight when
    /// every part has the same GGML type, else the parts side by side.
    fn fuse_stored(
        parts: &[(&Weights, usize)],
        stored: Vec<Option<(GgmlDType, Cow<'_, [u8]>)>>,
        in_dim: usize,
        bias: bool,
    ) -> std::result::Result<Self, LoadError> {
        let mut biases = Vec::new();
        for (w, out) in parts {
            biases.extend(Self::load_bias(w, *out, bias)?);
        }
        let Some((first, _)) = parts.first() else {
            return Err(LoadError::Tensor {
                name: "fused projection".into(),
                reason: "no parts".into(),
            });
        };
        let name = first.name_of("weight");
        let err = |e: candle_core::Error| LoadError::Tensor {
            name: format!("{name} (fused)"),
            reason: e.to_string(),
        };
        let bias = if biases.is_empty() {
            None
        } else {
            Some(Tensor::cat(&biases, 0).map_err(err)?)
        };
        let same = stored.first().and_then(|s| s.as_ref()).map(|(t, _)| *t);
        if let Some(t) = same.filter(|t| {
            stored
                .iter()
                .all(|s| s.as_ref().is_some_and(|(u, _)| u == t))
        }) {
            let bytes: Vec<&[u8]> = stored.iter().flatten().map(|(_, b)| b.as_ref()).collect();
            let one = GgmlLinear::from_parts(t, &bytes, in_dim, first.device()).map_err(err)?;
            return Ok(Self::with_method(Arc::new(one), bias));
        }
        let mut methods: Vec<Arc<dyn LinearMethod>> = Vec::with_capacity(parts.len());
        for ((w, out), s) in parts.iter().zip(stored) {
            methods.push(match s {
                Some((t, bytes)) => Arc::new(
                    GgmlLinear::from_bytes(t, &bytes, (*out, in_dim), w.device()).map_err(err)?,
                ),
                None => {
                    let weight = w.get(&[*out, in_dim], "weight")?;
                    Self::build(w, &w.name_of("weight"), weight, None)?.method
                }
            });
        }
        Ok(Self::with_method(Arc::new(Stacked(methods)), bias))
    }

    pub fn method(&self) -> &Arc<dyn LinearMethod> {
        &self.method
    }

    /// `(out, in)`.
    pub fn shape(&self) -> (usize, usize) {
        self.method.shape()
    }

    /// For a fused gate-up projection (gate rows, then up rows): `silu(gate) * up`,
    /// `[num_tokens, out / 2]`.
    pub fn forward_silu_glu(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        self.forward_silu_glu_with(x, None, ctx)
    }

    /// `x`: `[num_tokens, in]` -> `[num_tokens, out]`.
    pub fn forward(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
        self.forward_with(x, None, ctx)
    }

    /// Whether the product would take `x`'s rows in FP8 form ([`Linear::forward_with`]).
    pub fn takes_fp8_rows(&self, x: &Tensor) -> bool {
        self.method.takes_fp8_rows(x)
    }

    /// [`Linear::forward`] of `x`, whose FP8 form `rows` (made by the kernel before, the same
    /// bits the product's own quantization gives) may come with it.
    pub fn forward_with(
        &self,
        x: &Tensor,
        rows: Option<&Fp8Rows>,
        ctx: &LayerCtx<'_>,
    ) -> Result<Tensor> {
        match (rows, &self.bias) {
            (None, Some(b)) => self.method.matmul_bias(x, b, ctx),
            (None, None) => self.method.matmul(x, ctx),
            (Some(r), b) => {
                let y = self.method.matmul_fp8_rows(x, r, false, ctx)?;
                match b {
                    Some(b) => rserve_kernels::add_bias(&y, b),
                    None => Ok(y),
                }
            }
        }
    }

    /// [`Linear::forward_silu_glu_with`], with the result's FP8 form where the product makes it
    /// ([`LinearMethod::matmul_silu_glu_rows`]; never with a bias).
    pub fn forward_silu_glu_rows(
        &self,
        x: &Tensor,
        rows: Option<&Fp8Rows>,
        ctx: &LayerCtx<'_>,
    ) -> Result<(Tensor, Option<Fp8Rows>)> {
        match &self.bias {
            None => self.method.matmul_silu_glu_rows(x, rows, ctx),
            Some(_) => Ok((self.forward_silu_glu_with(x, rows, ctx)?, None)),
        }
    }

    /// [`Linear::forward_silu_glu`] of `x` with its FP8 form `rows`, as [`Linear::forward_with`].
    pub fn forward_silu_glu_with(
        &self,
        x: &Tensor,
        rows: Option<&Fp8Rows>,
        ctx: &LayerCtx<'_>,
    ) -> Result<Tensor> {
        match (&self.bias, rows) {
            (None, Some(r)) => self.method.matmul_fp8_rows(x, r, true, ctx),
            (None, None) => self.method.matmul_silu_glu(x, ctx),
            (Some(_), _) => rserve_kernels::silu_and_mul(&self.forward_with(x, rows, ctx)?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// A method that scales a dense product: stands for any other way of applying a weight.
    #[derive(Debug)]
    struct Scaled(Dense, f64);

    impl LinearMethod for Scaled {
        fn matmul(&self, x: &Tensor, ctx: &LayerCtx<'_>) -> Result<Tensor> {
            self.0.matmul(x, ctx)? * self.1
        }

        fn shape(&self) -> (usize, usize) {
            self.0.shape()
        }
    }

    #[test]
    fn a_layer_applies_its_method_and_bias() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, 12.0, &dev)?.reshape((4, 3))?; // [out 4, in 3]
        let b = Tensor::new(&[1f32, 2.0, 3.0, 4.0], &dev)?;
        let x = Tensor::new(&[[1f32, 0.0, -1.0], [0.5, 0.5, 0.5]], &dev)?;
        let ctx = LayerCtx::default();
        let dense = Linear::new(w.clone(), Some(b.clone()));
        let want = x.matmul(&w.t()?)?.broadcast_add(&b)?;
        let got = dense.forward(&x, &ctx)?;
        assert_eq!(got.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
        assert_eq!(dense.shape(), (4, 3));
        let scaled = Linear::with_method(Arc::new(Scaled(Dense::new(w.clone()), 2.0)), None);
        let got = scaled.forward(&x, &ctx)?;
        assert_eq!(
            got.to_vec2::<f32>()?,
            (x.matmul(&w.t()?)? * 2.0)?.to_vec2::<f32>()?
        );
        // the fused gate-up path of a method without its own kernel: silu(gate) * up
        let glu = scaled.forward_silu_glu(&x, &ctx)?;
        let full = (x.matmul(&w.t()?)? * 2.0)?;
        let (gate, up) = (full.narrow(1, 0, 2)?, full.narrow(1, 2, 2)?);
        let want = (gate.silu()? * up)?;
        let diff = (&glu - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        assert_eq!(glu.dtype(), DType::F32);
        Ok(())
    }
}
