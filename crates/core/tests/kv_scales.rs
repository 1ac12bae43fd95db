#![allow(clippy::unwrap_used)]
//! A checkpoint's FP8 KV-cache scales: `self_attn.k_scale` / `v_scale` (vLLM's names) and
//! `k_proj.output_scale` / `v_proj.output_scale` (AutoFP8's), of shape `[]` or `[1]`, are read per
//! layer and used by `--kv-cache-dtype fp8`; a scale that is not finite and positive is a load
//! error naming the tensor.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use rserve_core::kv_cache::KvCacheDtype;
use rserve_core::loader::{load_model, LoadError};
use rserve_core::{Engine, EngineConfig, EngineHandle, KvBudget};
use rserve_kernels::CacheScales;
use std::collections::HashMap;
use std::path::PathBuf;

/// The qwen2 fixture (two layers) with `extra` tensors added to its weights.
fn with_tensors(tag: &str, extra: &[(&str, Tensor)]) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("rserve-kv-scales-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(fixture_model("qwen2")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    let file = dst.join("model.safetensors");
    let mut tensors: HashMap<String, Tensor> =
        candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    for (name, t) in extra {
        tensors.insert(name.to_string(), t.clone());
    }
    candle_core::safetensors::save(&tensors, &file).unwrap();
    dst
}

fn scaled_checkpoint(tag: &str) -> PathBuf {
    with_tensors(
        tag,
        &[
            (
                "model.layers.0.self_attn.k_scale",
                Tensor::new(0.5f32, &Device::Cpu).unwrap(),
            ),
            (
                "model.layers.1.self_attn.v_proj.output_scale",
                Tensor::new(&[2.0f32], &Device::Cpu).unwrap(),
            ),
        ],
    )
}

fn engine(dir: PathBuf, kv: KvCacheDtype) -> EngineHandle {
    let mut cfg = EngineConfig::new(dir);
    cfg.dtype = "float32".into();
    cfg.kv_cache = KvBudget::Blocks(64);
    cfg.kv_cache_dtype = kv;
    Engine::start(cfg).unwrap()
}

#[test]
fn checkpoint_scales_are_read_per_layer() {
    let dir = scaled_checkpoint("read");
    let m = load_model(&dir, "float32", &Device::Cpu, None).unwrap();
    assert_eq!(
        m.model.kv_cache_scales(),
        vec![
            Some(CacheScales { k: 0.5, v: 1.0 }),
            Some(CacheScales { k: 1.0, v: 2.0 })
        ]
    );
    let plain = load_model(&fixture_model("qwen2"), "float32", &Device::Cpu, None).unwrap();
    assert_eq!(plain.model.kv_cache_scales(), vec![None, None]);
}

#[test]
fn an_fp8_cache_at_the_checkpoints_scales_scores_like_the_full_cache() {
    let dir = scaled_checkpoint("serve");
    let ids: Vec<u32> = (0..60).map(|i| (i * 37 + 11) % 1000).collect();
    let full = engine(dir.clone(), KvCacheDtype::Auto);
    let want = teacher_forced(&full, &ids);
    full.shutdown();
    let fp8 = engine(dir, KvCacheDtype::Fp8);
    let got = teacher_forced(&fp8, &ids);
    fp8.shutdown();
    let errs: Vec<f32> = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).collect();
    let mean = errs.iter().sum::<f32>() / errs.len() as f32;
    // as at unit scales (tests/python/test_kv_cache_dtype.py): E4M3's cost on the tiny model
    assert!(mean < 0.25, "mean abs log-prob error {mean}: {errs:?}");
}

#[test]
fn a_scale_that_is_not_finite_and_positive_is_a_load_error() {
    for (tag, bad) in [("zero", 0.0f32), ("nan", f32::NAN), ("neg", -1.0)] {
        let dir = with_tensors(
            tag,
            &[(
                "model.layers.1.self_attn.k_scale",
                Tensor::new(bad, &Device::Cpu).unwrap(),
            )],
        );
        match load_model(&dir, "float32", &Device::Cpu, None) {
            Err(LoadError::Tensor { name, reason }) => {
                assert_eq!(name, "model.layers.1.self_attn.k_scale");
                assert!(reason.contains("finite and positive"), "{reason}");
            }
            Err(e) => panic!("{tag}: {e}"),
            Ok(_) => panic!("{tag}: a scale of {bad} loaded"),
        }
    }
}
