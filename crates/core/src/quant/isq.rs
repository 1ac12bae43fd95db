//! In-situ quantization: each decoder projection is quantized as it is read from the checkpoint's
//! memory map, and its 16- or 32-bit copy dropped at once, so no more than one layer's
//! projections exist unquantized at any time. Records what it did for the startup line.

use super::fp8::Fp8Linear;
use super::ggml::GgmlLinear;
use super::{ggml_name, storage_type, IsqFormat};
use crate::load_error::LoadError;
use crate::models::layers::linear::{Dense, LinearMethod};
use candle_core::Tensor;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What in-situ quantization did to a model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IsqReport {
    pub format: Option<IsqFormat>,
    /// Projections quantized (in the format or its fallback).
    pub quantized: usize,
    /// Bytes of the projections before (in the model's dtype) and after.
    pub bytes_before: usize,
    pub bytes_after: usize,
    /// `(tensor, type stored in)` for each projection that could not take the format.
    pub fallbacks: Vec<(String, String)>,
    pub time: Duration,
    /// How the products run, where the device decides it (`fp8`).
    pub products: Option<String>,
}

impl IsqReport {
    /// One line for the log: the format, the sizes, the time and the fallbacks.
    pub fn summary(&self) -> String {
        let Some(f) = self.format else {
            return "no ISQ".into();
        };
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let mut s = format!(
            "ISQ {f}: {} projections, {:.1} MiB -> {:.1} MiB, quantized in {:.2} s",
            self.quantized,
            mib(self.bytes_before),
            mib(self.bytes_after),
            self.time.as_secs_f64()
        );
        if let Some(p) = &self.products {
            s.push_str(&format!("; products: {p}"));
        }
        if !self.fallbacks.is_empty() {
            let mut kinds: Vec<&str> = self.fallbacks.iter().map(|(_, t)| t.as_str()).collect();
            kinds.sort_unstable();
            kinds.dedup();
            s.push_str(&format!(
                "; {} tensors whose rows do not fit {f}'s blocks kept as {} (e.g. {})",
                self.fallbacks.len(),
                kinds.join("/"),
                self.fallbacks[0].0
            ));
        }
        s
    }
}

/// Quantizes the projections of one model as they load.
#[derive(Debug)]
pub struct Isq {
    format: IsqFormat,
    lm_head: bool,
    report: Mutex<IsqReport>,
}

impl Isq {
    /// Quantizes the decoder's projections, and the output head too when `lm_head`.
    pub fn new(format: IsqFormat, lm_head: bool) -> Arc<Self> {
        Arc::new(Self {
            format,
            lm_head,
            report: Mutex::new(IsqReport {
                format: Some(format),
                ..IsqReport::default()
            }),
        })
    }

    /// The linear method for projection `name` with `weight` `[out, in]`: quantized to the format
    /// (or its fallback), or kept dense when no GGML type fits its rows.
    pub fn linear(&self, name: &str, weight: Tensor) -> Result<Arc<dyn LinearMethod>, LoadError> {
        let start = Instant::now();
        let err = |e: candle_core::Error| LoadError::Tensor {
            name: name.to_string(),
            reason: format!("quantizing to {}: {e}", self.format),
        };
        let (_, cols) = weight.dims2().map_err(err)?;
        let before = weight.elem_count() * weight.dtype().size_in_bytes();
        // the method, its bytes, and the type it is kept in when not the format's own
        let (method, after, fallback): (Arc<dyn LinearMethod>, usize, Option<&str>) =
            if self.format == IsqFormat::Fp8 {
                let q = Fp8Linear::quantize(&weight).map_err(err)?;
                let bytes = q.size_in_bytes();
                (Arc::new(q), bytes, None)
            } else {
                match storage_type(self.format, cols) {
                    Some(t) => {
                        let q = GgmlLinear::quantize(&weight, t).map_err(err)?;
                        let bytes = q.size_in_bytes();
                        let fallback = (Some(t) != self.format.ggml()).then(|| ggml_name(t));
                        (Arc::new(q), bytes, fallback)
                    }
                    None => (Arc::new(Dense::new(weight.clone())), before, Some("dense")),
                }
            };
        // the kernels' time, not their launches'
        weight.device().synchronize().map_err(err)?;
        let mut r = self.report.lock().unwrap_or_else(|p| p.into_inner());
        r.bytes_before += before;
        r.bytes_after += after;
        r.time += start.elapsed();
        if fallback != Some("dense") {
            r.quantized += 1;
        }
        if let Some(t) = fallback {
            r.fallbacks.push((name.to_string(), t.to_string()));
        }
        if self.format == IsqFormat::Fp8 && r.products.is_none() {
            r.products = Some(Fp8Linear::products(weight.device()).to_string());
        }
        Ok(method)
    }

    /// Whether the output head is quantized too (`--isq-lm-head`).
    pub fn lm_head(&self) -> bool {
        self.lm_head
    }

    /// What was done so far.
    pub fn report(&self) -> IsqReport {
        self.report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
