//! Times the GGML quantizers (what `--isq` spends on the CPU) on the projection shapes of a
//! Qwen2.5-0.5B-shaped model: millions of values quantized per second, the best of three runs,
//! on the rayon pool.
//!
//!     RAYON_NUM_THREADS=2 cargo run --release -p rserve-kernels --example quantize_bench
//!
//! `QUANTIZE_BENCH=q4k` times one format.

use rserve_kernels::quantize::{quantize, test_values as values, BlockType};
use std::time::Instant;

fn main() {
    let shapes: [(&str, usize, usize); 3] = [
        ("qwen qkv", 1152, 896),
        ("qwen gate_up", 9728, 896),
        ("qwen down", 896, 4864),
    ];
    let only = std::env::var("QUANTIZE_BENCH").unwrap_or_default();
    println!("| shape | format | M values | ms | M values/s |");
    println!("|---|---|---:|---:|---:|");
    for (name, n, k) in shapes {
        // weights of a trained model's scale
        let w: Vec<f32> = values(n * k, 1).iter().map(|v| v * 0.05).collect();
        for f in BlockType::ALL {
            let named = format!("{f:?}").replace('_', "");
            if k % f.block_values() != 0
                || !(only.is_empty() || named.eq_ignore_ascii_case(&only.replace('_', "")))
            {
                continue;
            }
            let best = (0..3)
                .map(|_| {
                    let t = Instant::now();
                    std::hint::black_box(quantize(f, &w, k).expect("quantize"));
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            let m = (n * k) as f64 / 1e6;
            println!(
                "| {name} | {f:?} | {m:.2} | {:.1} | {:.0} |",
                best * 1e3,
                m / best
            );
        }
    }
}
