//! Times the LoRA terms of a prompt step's runs on the projection shapes of a Llama-3.1-8B-shaped
//! model (8,192 rows in 1, 8 or 64 runs of one adapter each, rank 16, 64 slots) in each form
//! (`RSERVE_LORA_PROMPT_TERMS`): a cuBLAS shrink and expands per run, the same products in two
//! grouped cuBLAS calls; beside the base product alone (a gate-up's with its SiLU-and-multiply,
//! as its LoRA forms end in one). The last two columns put 56 decode rows of distinct adapters
//! in front of the runs (a 64-concurrent step's shape), their gathered kernels launched over
//! every row of the step or over those rows only (`LoraRows::listed`). The last lines add the
//! shapes up to a step of the 32-layer model.
//!
//!     cargo run --release --features cuda -p rserve-kernels --example lora_gpu_bench
//!
//! `LORA_GPU_BENCH_ROWS` sets the rows (default 8192), `LORA_GPU_BENCH_RUNS` the run counts
//! (default 1,8,64).

use candle_core::{DType, Device, Result, Tensor};
use rserve_kernels::lora::{
    listed_rows, set_prompt_terms, LoraRows, LoraRun, LoraStack, PromptTerms, NO_ADAPTER,
};
use rserve_kernels::lora_gemv::linear_rows_lora_runs;
mod common;
use common::time;

/// (name, parts, k, gate-up)
const SHAPES: [(&str, &[usize], usize, bool); 4] = [
    ("qkv", &[4096, 1024, 1024], 4096, false),
    ("o", &[4096], 4096, false),
    ("gate_up", &[14336, 14336], 4096, true),
    ("down", &[4096], 14336, false),
];
const LAYERS: f64 = 32.0;
const SLOTS: usize = 64;
const RANK: usize = 16;
const MODES: [PromptTerms; 2] = [PromptTerms::Runs, PromptTerms::Grouped];
/// Decode rows in front of the runs in the mixed columns.
const DECODE_ROWS: usize = 56;

fn env_list(name: &str, default: &[usize]) -> Vec<usize> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| default.to_vec())
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let rows = env_list("LORA_GPU_BENCH_ROWS", &[8192])[0];
    let run_counts = env_list("LORA_GPU_BENCH_RUNS", &[1, 8, 64]);
    let rnd = |shape: &[usize], std: f32| -> Result<Tensor> {
        Tensor::randn(0f32, std, shape, &dev)?.to_dtype(DType::BF16)
    };
    println!("| shape | runs | base product us | run by run us | grouped us | + {DECODE_ROWS} decode rows, every row launched us | the same, decode rows listed us |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for &count in &run_counts {
        let len = rows / count;
        let runs: Vec<LoraRun> = (0..count)
            .map(|i| LoraRun {
                start: i * len,
                len,
                slot: ((i * 7) % SLOTS) as u32,
            })
            .collect();
        let lora_rows = LoraRows {
            slots: None,
            runs: &runs,
            listed: None,
        };
        // the mixed step: decode rows of distinct slots, then the runs over the rest
        let mixed_len = (rows - DECODE_ROWS) / count;
        let mixed_runs: Vec<LoraRun> = (0..count)
            .map(|i| LoraRun {
                start: DECODE_ROWS + i * mixed_len,
                len: mixed_len,
                slot: ((i * 7) % SLOTS) as u32,
            })
            .collect();
        let mut slots = vec![NO_ADAPTER; rows];
        for (i, s) in slots.iter_mut().take(DECODE_ROWS).enumerate() {
            *s = (i % SLOTS) as u32;
        }
        let (list, listed) = listed_rows(&slots);
        let n_listed = list.len();
        let list = Tensor::from_vec(list, n_listed, &dev)?;
        let listed = Tensor::from_vec(listed, n_listed, &dev)?;
        let slots = Tensor::from_vec(slots, rows, &dev)?;
        let mixed = [
            LoraRows {
                slots: Some(&slots),
                runs: &mixed_runs,
                listed: None,
            },
            LoraRows {
                slots: Some(&slots),
                runs: &mixed_runs,
                listed: Some((&list, &listed)),
            },
        ];
        let mut step = [0f64; 5];
        for (name, parts, k, glu) in SHAPES {
            let n: usize = parts.iter().sum();
            let x = rnd(&[rows, k], 1.0)?;
            let w = rnd(&[n, k], 0.02)?;
            let a = rnd(&[SLOTS, parts.len() * RANK, k], 0.02)?;
            let b = rnd(&[SLOTS, n, RANK], 0.02)?;
            let stack = LoraStack {
                a: &a,
                b: &b,
                parts,
            };
            // the LoRA forms of a fused gate-up end in SiLU-and-multiply: so does its base here
            let mut t = vec![time(&dev, || {
                let y = rserve_kernels::linear_rows(&x, &w)?;
                if glu {
                    rserve_kernels::silu_and_mul(&y).map(drop)
                } else {
                    drop(y);
                    Ok(())
                }
            })?];
            for mode in MODES {
                set_prompt_terms(mode);
                t.push(time(&dev, || {
                    linear_rows_lora_runs(&x, &w, &stack, &lora_rows, glu).map(drop)
                })?);
            }
            set_prompt_terms(PromptTerms::Auto);
            for rows in &mixed {
                t.push(time(&dev, || {
                    linear_rows_lora_runs(&x, &w, &stack, rows, glu).map(drop)
                })?);
            }
            let cols: Vec<String> = t.iter().map(|v| format!("{:.1}", v * 1e6)).collect();
            println!("| {name} {n}x{k} | {count} | {} |", cols.join(" | "));
            for (s, v) in step.iter_mut().zip(&t) {
                *s += v * LAYERS;
            }
        }
        let cols: Vec<String> = step.iter().map(|v| format!("{:.2}", v * 1e3)).collect();
        println!(
            "| a step of {LAYERS} layers (ms) | {count} | {} |",
            cols.join(" | ")
        );
    }
    Ok(())
}
