//! In-situ quantization: each decoder projection is quantized as it is read from the checkpoint's
//! memory map, and its 16- or 32-bit copy dropped at once, so no more than one layer's
//! projections exist unquantized at any time. Records what it did for the startup line.

use super::fp8::Fp8Linear;
use super::ggml::{block_type, GgmlLinear};
use super::{ggml_name, storage_type, IsqFormat};
use crate::load_error::LoadError;
use crate::models::layers::linear::{Dense, LinearMethod};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Tensor};
use rserve_kernels::quantize;
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
    /// Wall time during which some projection was being quantized (layers that load side by
    /// side count once).
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

/// A projection quantized by [`Isq::quantize_stored`]: its GGML type and ggml's bytes, and what
/// the report will say of it.
#[derive(Debug)]
pub struct StoredQuant {
    pub dtype: GgmlDType,
    pub bytes: Vec<u8>,
    before: usize,
    fallback: Option<&'static str>,
    /// When its quantization started and ended.
    span: (Instant, Instant),
}

/// Quantizes the projections of one model as they load.
#[derive(Debug)]
pub struct Isq {
    format: IsqFormat,
    lm_head: bool,
    /// The report so far (its `time` filled in by [`Isq::report`]), and when each projection's
    /// quantization started and ended.
    report: Mutex<(IsqReport, Vec<(Instant, Instant)>)>,
}

impl Isq {
    /// Quantizes the decoder's projections, and the output head too when `lm_head`.
    pub fn new(format: IsqFormat, lm_head: bool) -> Arc<Self> {
        Arc::new(Self {
            format,
            lm_head,
            report: Mutex::new((
                IsqReport {
                    format: Some(format),
                    ..IsqReport::default()
                },
                Vec::new(),
            )),
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
        let products = (self.format == IsqFormat::Fp8)
            .then(|| Fp8Linear::products(weight.device()).to_string());
        let span = (start, Instant::now());
        self.record(name, (before, after), fallback, &[span], products);
        Ok(method)
    }

    /// Projection `name` `[out, cols]` quantized on the CPU straight from its rows as stored
    /// (`data`, little-endian `stored` values: bf16, f16 or f32), each row converted to f32 as
    /// it is quantized, with no f32 copy of the tensor; reported by [`Isq::report_stored`] once
    /// the projection (maybe fused from several) is whole. `None` where this path does not apply
    /// (FP8, rows no GGML type fits, another stored type): the caller loads the tensor and calls
    /// [`Isq::linear`] then. `dtype` is the model's, for the report's sizes.
    pub fn quantize_stored(
        &self,
        name: &str,
        data: &[u8],
        stored: DType,
        (out, cols): (usize, usize),
        dtype: DType,
    ) -> Result<Option<StoredQuant>, LoadError> {
        let Some(t) = storage_type(self.format, cols) else {
            return Ok(None);
        };
        let Some(bt) = block_type(t) else {
            return Ok(None);
        };
        let width = match stored {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
            _ => return Ok(None),
        };
        let err = |reason: String| LoadError::Tensor {
            name: name.to_string(),
            reason: format!("quantizing to {}: {reason}", self.format),
        };
        let rb = cols * width;
        if data.len() != out * rb {
            return Err(err(format!(
                "{} bytes do not hold [{out}, {cols}] in {stored:?}",
                data.len()
            )));
        }
        let start = Instant::now();
        let bf16 = stored == DType::BF16;
        let bytes = quantize::quantize_rows(bt, out, cols, |r, buf| {
            let row = &data[r * rb..(r + 1) * rb];
            if width == 4 {
                for (o, b) in buf.iter_mut().zip(row.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            } else {
                for (o, b) in buf.iter_mut().zip(row.chunks_exact(2)) {
                    *o = crate::host::widen(b, bf16);
                }
            }
        })
        .map_err(err)?;
        Ok(Some(StoredQuant {
            dtype: t,
            bytes,
            before: out * cols * dtype.size_in_bytes(),
            fallback: (Some(t) != self.format.ggml()).then(|| ggml_name(t)),
            span: (start, Instant::now()),
        }))
    }

    /// Reports `parts`, quantized by [`Isq::quantize_stored`], as the one projection `name`
    /// (fused when there are several parts).
    pub fn report_stored(&self, name: &str, parts: &[&StoredQuant]) {
        let before = parts.iter().map(|p| p.before).sum();
        let after = parts.iter().map(|p| p.bytes.len()).sum();
        let fallback = parts.iter().find_map(|p| p.fallback);
        let spans: Vec<_> = parts.iter().map(|p| p.span).collect();
        self.record(name, (before, after), fallback, &spans, None);
    }

    /// Adds one projection to the report, quantized over `spans`.
    fn record(
        &self,
        name: &str,
        (before, after): (usize, usize),
        fallback: Option<&str>,
        spans: &[(Instant, Instant)],
        products: Option<String>,
    ) {
        let mut guard = self.report.lock().unwrap_or_else(|p| p.into_inner());
        let (r, all) = &mut *guard;
        all.extend_from_slice(spans);
        r.bytes_before += before;
        r.bytes_after += after;
        if fallback != Some("dense") {
            r.quantized += 1;
        }
        if let Some(t) = fallback {
            r.fallbacks.push((name.to_string(), t.to_string()));
        }
        if r.products.is_none() {
            r.products = products;
        }
    }

    /// Whether the output head is quantized too (`--isq-lm-head`).
    pub fn lm_head(&self) -> bool {
        self.lm_head
    }

    /// What was done so far, the fallbacks in the model's order (layers may load side by side).
    pub fn report(&self) -> IsqReport {
        let guard = self.report.lock().unwrap_or_else(|p| p.into_inner());
        let mut r = guard.0.clone();
        r.fallbacks
            .sort_by_cached_key(|(name, _)| natural_key(name));
        r.time = covered(&guard.1);
        r
    }
}

/// The time covered by at least one of `spans`.
fn covered(spans: &[(Instant, Instant)]) -> Duration {
    let mut sorted = spans.to_vec();
    sorted.sort_unstable();
    let mut total = Duration::ZERO;
    let mut open: Option<(Instant, Instant)> = None;
    for (a, b) in sorted {
        open = match open {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + open.map_or(Duration::ZERO, |(s, e)| e - s)
}

/// `name` cut into runs of digits (compared as numbers) and of other characters, so that
/// `layers.2` sorts before `layers.10`.
fn natural_key(name: &str) -> Vec<(u64, String)> {
    let mut key = Vec::new();
    let mut rest = name;
    while let Some(c) = rest.chars().next() {
        let digit = c.is_ascii_digit();
        let end = rest
            .find(|ch: char| ch.is_ascii_digit() != digit)
            .unwrap_or(rest.len());
        let (run, tail) = rest.split_at(end);
        key.push(match run.parse::<u64>() {
            Ok(n) if digit => (n, String::new()),
            _ => (u64::MAX, run.to_string()),
        });
        rest = tail;
    }
    key
}

#[cfg(test)]
mod tests {
    #[test]
    fn overlapping_spans_count_once() {
        let t = std::time::Instant::now();
        let at = |ms: u64| t + std::time::Duration::from_millis(ms);
        let spans = [
            (at(0), at(10)),
            (at(5), at(20)),
            (at(30), at(40)),
            (at(32), at(35)),
        ];
        assert_eq!(super::covered(&spans).as_millis(), 30);
        assert_eq!(super::covered(&[]).as_millis(), 0);
    }

    #[test]
    fn fallbacks_sort_in_layer_order() {
        let mut names = vec![
            "m.layers.10.q",
            "m.layers.2.q",
            "m.layers.2.k",
            "m.layers.1.q",
        ];
        names.sort_by_cached_key(|n| super::natural_key(n));
        assert_eq!(
            names,
            [
                "m.layers.1.q",
                "m.layers.2.k",
                "m.layers.2.q",
                "m.layers.10.q"
            ]
        );
    }
}
