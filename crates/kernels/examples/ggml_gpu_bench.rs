//! Times the GPU dequantizers and the products of larger batches for GGML block weights on the
//! projection shapes of a Llama-3.1-8B-shaped model: the direct and the tiled dequantizer (bytes
//! read and written per second), and at 256 activation rows the bf16 product against the block
//! weight's (dequantize, then the same cuBLAS product). The last lines add the shapes up to a
//! decode step of the 32-layer model.
//!
//!     cargo run --release --features cuda -p rserve-kernels --example ggml_gpu_bench
//!
//! `GGML_GPU_BENCH=q4k,q8_0` picks formats (default q4k, q8_0, q6k, q4_0); `GGML_GPU_BENCH_ROWS`
//! the activation rows (default 256).

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::ggml::BlockWeight;
use rserve_kernels::quantize::BlockType;
mod common;
use common::time;

const SHAPES: [(&str, usize, usize); 4] = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
];
const LAYERS: f64 = 32.0;

/// `q4k`, `q8_0`, ... as the `--isq` names are written.
fn format(name: &str) -> Option<BlockType> {
    let want = name.replace('_', "");
    BlockType::ALL.into_iter().find(|t| {
        format!("{t:?}")
            .replace('_', "")
            .eq_ignore_ascii_case(&want)
    })
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let rows: usize = std::env::var("GGML_GPU_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let formats: Vec<BlockType> = match std::env::var("GGML_GPU_BENCH") {
        Ok(v) => v.split(',').filter_map(|f| format(f.trim())).collect(),
        Err(_) => vec![
            BlockType::Q4K,
            BlockType::Q8_0,
            BlockType::Q6K,
            BlockType::Q4_0,
        ],
    };
    println!("| format | shape | MB | dequantize GB/s | tiled GB/s | dequantize us | tiled us | bf16 product us | block product us |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for t in formats {
        let mut sum = [0f64; 4];
        for (name, n, k) in SHAPES {
            let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?.to_dtype(DType::BF16)?;
            let q = BlockWeight::quantize(t, &w)?;
            let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?.to_dtype(DType::BF16)?;
            // bytes a dequantization moves: the blocks read, the bf16 weight written
            let bytes = (q.size_in_bytes() + n * k * 2) as f64;
            let direct = time(&dev, || q.dequantize_with(DType::BF16, false).map(drop))?;
            let tiled = time(&dev, || q.dequantize_with(DType::BF16, true).map(drop))?;
            let dense = time(&dev, || rserve_kernels::linear_rows(&x, &w).map(drop))?;
            let block = time(&dev, || q.linear(&x).map(drop))?;
            println!(
                "| {t:?} | {name} {n}x{k} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} |",
                q.size_in_bytes() as f64 / 1e6,
                bytes / direct / 1e9,
                bytes / tiled / 1e9,
                direct * 1e6,
                tiled * 1e6,
                dense * 1e6,
                block * 1e6
            );
            for (s, v) in sum.iter_mut().zip([direct, tiled, dense, block]) {
                *s += v * LAYERS;
            }
        }
        println!(
            "| {t:?} | a step of {LAYERS} layers, {rows} rows (ms) | | | | {:.2} | {:.2} | {:.2} | {:.2} |",
            sum[0] * 1e3,
            sum[1] * 1e3,
            sum[2] * 1e3,
            sum[3] * 1e3
        );
    }
    Ok(())
}
