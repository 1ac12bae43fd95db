//! Quantized linear weights. A quantized weight is a [`LinearMethod`](crate::models::layers::linear::LinearMethod)
//! like any other: model files never change for it.
//!
//! - [`IsqFormat`]: the formats `--isq` takes, and the per-tensor fallback when a weight's rows do
//!   not fit the format's block (llama.cpp's rule: K-quants need rows that are a multiple of 256).
//! - [`isq`]: quantizing while the checkpoint streams in from its memory map, one tensor at a
//!   time, with a report of what was done.
//! - [`ggml`]: the GGML block formats (`q8_0`, `q4_0`, `q5_0`, `q4k`, `q6k`) applied to
//!   activations.
//! - [`fp8`]: FP8 E4M3 weights with one scale per output channel, quantized on the weight's
//!   device (the GPU when serving on one); on GPUs with FP8 tensor cores the products quantize
//!   the activations per token, as vLLM's `--quantization fp8` does.
//!
//! Which tensors: every linear projection of the decoder (`q/k/v/o`, `gate/up/down`). The
//! embeddings and `lm_head` stay in the model's dtype, as llama.cpp and mistral.rs keep their most
//! sensitive tensors at higher precision.

pub mod fp8;
pub mod ggml;
pub mod isq;

use candle_core::quantized::GgmlDType;
use std::fmt;
use std::str::FromStr;

/// A format `--isq` quantizes the decoder's projections to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IsqFormat {
    Q8_0,
    Q4_0,
    Q4K,
    Q6K,
    Fp8,
}

impl IsqFormat {
    pub const ALL: [IsqFormat; 5] = [Self::Q8_0, Self::Q4_0, Self::Q4K, Self::Q6K, Self::Fp8];

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::Q4K => "q4k",
            Self::Q6K => "q6k",
            Self::Fp8 => "fp8",
        }
    }

    /// The GGML block type (`None` for `fp8`).
    pub fn ggml(self) -> Option<GgmlDType> {
        Some(match self {
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q6K => GgmlDType::Q6K,
            Self::Fp8 => return None,
        })
    }
}

impl fmt::Display for IsqFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for IsqFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        Ok(match norm.as_str() {
            "q8_0" | "q8" => Self::Q8_0,
            "q4_0" | "q4" => Self::Q4_0,
            "q4k" | "q4_k" | "q4_k_m" => Self::Q4K,
            "q6k" | "q6_k" => Self::Q6K,
            "fp8" | "fp8_e4m3" | "e4m3" => Self::Fp8,
            _ => {
                let names: Vec<&str> = Self::ALL.iter().map(|f| f.name()).collect();
                return Err(format!(
                    "unknown ISQ format `{s}`; one of {}",
                    names.join(", ")
                ));
            }
        })
    }
}

/// The name of a GGML type as llama.cpp writes it.
pub fn ggml_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q8_1 => "q8_1",
        GgmlDType::Q2K => "q2k",
        GgmlDType::Q3K => "q3k",
        GgmlDType::Q4K => "q4k",
        GgmlDType::Q5K => "q5k",
        GgmlDType::Q6K => "q6k",
        GgmlDType::Q8K => "q8k",
    }
}

/// The type a weight with rows of `cols` values is stored in under `format`: the format itself
/// when its block divides the rows, else llama.cpp's fallback (`q4k` -> `q5_0`, `q6k` -> `q8_0`),
/// else `None` (the weight stays in the model's dtype).
pub fn storage_type(format: IsqFormat, cols: usize) -> Option<GgmlDType> {
    let fits = |t: GgmlDType| cols > 0 && cols.is_multiple_of(t.block_size());
    let first = format.ggml()?;
    if fits(first) {
        return Some(first);
    }
    let fallback = match format {
        IsqFormat::Q4K => GgmlDType::Q5_0,
        IsqFormat::Q6K => GgmlDType::Q8_0,
        IsqFormat::Q8_0 | IsqFormat::Q4_0 | IsqFormat::Fp8 => return None,
    };
    fits(fallback).then_some(fallback)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_by_their_names_and_aliases() {
        for f in IsqFormat::ALL {
            assert_eq!(f.name().parse::<IsqFormat>(), Ok(f));
        }
        assert_eq!("Q4_K_M".parse::<IsqFormat>(), Ok(IsqFormat::Q4K));
        assert_eq!("FP8".parse::<IsqFormat>(), Ok(IsqFormat::Fp8));
        let e = "q3".parse::<IsqFormat>().unwrap_err();
        assert!(e.contains("q4k") && e.contains("`q3`"), "{e}");
    }

    #[test]
    fn rows_that_do_not_fit_the_block_fall_back_as_llama_cpp_does() {
        assert_eq!(storage_type(IsqFormat::Q4K, 4096), Some(GgmlDType::Q4K));
        // Qwen2.5-0.5B's hidden size
        assert_eq!(storage_type(IsqFormat::Q4K, 896), Some(GgmlDType::Q5_0));
        assert_eq!(storage_type(IsqFormat::Q6K, 896), Some(GgmlDType::Q8_0));
        assert_eq!(storage_type(IsqFormat::Q8_0, 896), Some(GgmlDType::Q8_0));
        assert_eq!(storage_type(IsqFormat::Q4_0, 100), None);
        assert_eq!(storage_type(IsqFormat::Q4K, 100), None);
    }
}
