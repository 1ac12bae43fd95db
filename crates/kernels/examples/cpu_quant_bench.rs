//! Times the CPU quantized products on the projection shapes of a Qwen2.5-0.5B-shaped and a
//! Llama-3.2-1B-shaped model: weight bytes streamed per second at 1 and 8 activation rows (at 1
//! row both from the cache, the same weight again, and from memory, copies in turn).
//!
//!     RAYON_NUM_THREADS=2 cargo run --release -p rserve-kernels --example cpu_quant_bench

use rserve_kernels::cpu_quant::X8Weight;
use rserve_kernels::quantize::{quantize, test_values as values, BlockType};
use std::time::Instant;

fn main() {
    let shapes: [(&str, usize, usize); 8] = [
        ("qwen qkv", 1152, 896),
        ("qwen gate_up", 9728, 896),
        ("qwen down", 896, 4864),
        ("qwen head", 151936, 896),
        ("llama qkv", 3072, 2048),
        ("llama gate_up", 16384, 2048),
        ("llama down", 2048, 8192),
        ("llama head", 128256, 2048),
    ];
    let formats = [
        BlockType::Q8_0,
        BlockType::Q4_0,
        BlockType::Q5_0,
        BlockType::Q4K,
        BlockType::Q6K,
    ];
    println!("| shape | format | MB | m=1 GB/s | m=1 ms | m=1 from memory GB/s | m=8 GB/s | prefill int8 GFLOP/s | prefill f32 GFLOP/s |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    // optional filters: CPU_QUANT_BENCH=FORMAT[,SHAPE-SUBSTRING]
    let filter = std::env::var("CPU_QUANT_BENCH").unwrap_or_default();
    let mut filter = filter.split(',');
    let (only_format, only_shape) = (filter.next().unwrap_or(""), filter.next().unwrap_or(""));
    for (name, n, k) in shapes {
        if !name.contains(only_shape) {
            continue;
        }
        let wf = values(n * k, 1);
        for f in formats {
            if k % f.block_values() != 0
                || !(only_format.is_empty() || format!("{f:?}").eq_ignore_ascii_case(only_format))
            {
                continue;
            }
            let q = quantize(f, &wf, k).expect("quantize");
            let mb = q.len() as f64 / 1e6;
            let w = X8Weight::from_ggml(f, &q, n, k).expect("layout");
            let mut res = Vec::new();
            for m in [1usize, 8] {
                let x = values(m * k, 2);
                let reps = ((1e9 / q.len() as f64) as usize).clamp(2, 200);
                let _ = w.matmul(&x, m).expect("matmul");
                // the best of five runs of `reps` products
                let s = (0..5)
                    .map(|_| {
                        let t = Instant::now();
                        for _ in 0..reps {
                            std::hint::black_box(w.matmul(&x, m).expect("matmul"));
                        }
                        t.elapsed().as_secs_f64() / reps as f64
                    })
                    .fold(f64::MAX, f64::min);
                res.push((q.len() as f64 / s / 1e9, s * 1e3));
            }
            // batch 1 from memory: enough copies of the weight (at least 256 MB) taken in turn,
            // as a decode step meets each projection
            let copies = (256e6 / q.len() as f64).ceil() as usize;
            let cold: Vec<X8Weight> = (0..copies.min(64))
                .map(|_| X8Weight::from_ggml(f, &q, n, k).expect("layout"))
                .collect();
            let x = values(k, 2);
            let turns = cold.len().max(4);
            let s = (0..3)
                .map(|_| {
                    let t = Instant::now();
                    for i in 0..turns {
                        std::hint::black_box(cold[i % cold.len()].matmul(&x, 1).expect("matmul"));
                    }
                    t.elapsed().as_secs_f64() / turns as f64
                })
                .fold(f64::MAX, f64::min);
            drop(cold);
            let cold_gbs = q.len() as f64 / s / 1e9;
            // prefill: 512 rows (CPU_QUANT_BENCH_ROWS) through the integer products, and through the dequantized
            // weight and an f32 product
            let m: usize = std::env::var("CPU_QUANT_BENCH_ROWS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(512);
            let x = values(m * k, 3);
            let time = |f: &dyn Fn()| {
                f();
                (0..3)
                    .map(|_| {
                        let t = Instant::now();
                        f();
                        t.elapsed().as_secs_f64()
                    })
                    .fold(f64::MAX, f64::min)
            };
            let int8 = time(&|| {
                std::hint::black_box(w.matmul(&x, m).expect("matmul"));
            });
            let xt = candle_core::Tensor::from_vec(x.clone(), (m, k), &candle_core::Device::Cpu)
                .expect("x");
            let dense = time(&|| {
                let wf = candle_core::Tensor::from_vec(
                    w.dequantize(),
                    (n, k),
                    &candle_core::Device::Cpu,
                )
                .expect("w");
                std::hint::black_box(rserve_kernels::linear_rows(&xt, &wf).expect("f32"));
            });
            let gflop = 2.0 * (m * n * k) as f64 / 1e9;
            println!(
                "| {name} | {f:?} | {mb:.1} | {:.2} | {:.3} | {cold_gbs:.2} | {:.2} | {:.1} | {:.1} |",
                res[0].0,
                res[0].1,
                res[1].0,
                gflop / int8,
                gflop / dense
            );
        }
    }
}
