//! PEFT LoRA adapters (`adapters/fixtures`, made with their goldens by
//! `adapters/make_adapters.py`): read and checked against their bases, and, merged into the
//! base's weights (W + scale B A), decoding as transformers + peft decode with the adapter
//! (greedy tokens equal, log-probs within 1e-4, float32 on the CPU); unsupported and broken
//! adapters are errors that name the adapter and the reason.
#![allow(clippy::unwrap_used)]

mod common;

use candle_core::{Device, Tensor};
use common::*;
use rserve_core::lora::{BaseShape, LoraAdapter, LoraError};
use rserve_core::models::HfConfig;
use rserve_core::{Engine, EngineConfig, KvBudget};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// (adapter, base, rank, alpha, targets, rslora)
const ADAPTERS: &[(&str, &str, usize, f64, usize, bool)] = &[
    ("llama3-r8-qv", "llama3", 8, 16.0, 2, false),
    ("llama3-r4-all", "llama3", 4, 8.0, 7, false),
    ("llama3-r16-rslora-mlp", "llama3", 16, 8.0, 3, true),
    ("qwen2-r8-all", "qwen2", 8, 32.0, 7, false),
];

fn adapter_dir(name: &str) -> PathBuf {
    repo().join("adapters/fixtures").join(name)
}

fn base_shape(base: &str) -> BaseShape {
    let text = std::fs::read_to_string(fixture_model(base).join("config.json")).unwrap();
    let c: HfConfig = serde_json::from_str(&text).unwrap();
    BaseShape::from_config(&c).unwrap()
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rserve-lora-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn fixture_adapters_are_read_and_checked() {
    for &(name, base, rank, alpha, targets, rslora) in ADAPTERS {
        let shape = base_shape(base);
        let a = LoraAdapter::load(name, &adapter_dir(name), &shape, 64).unwrap();
        assert_eq!(a.config.rank, rank, "{name}");
        assert_eq!(a.config.targets.len(), targets, "{name}");
        assert_eq!(a.modules.len(), shape.layers * targets, "{name}");
        assert_eq!(a.max_rank(), rank, "{name}");
        let want = if rslora {
            alpha / (rank as f64).sqrt()
        } else {
            alpha / rank as f64
        };
        for ((_, t), m) in &a.modules {
            assert_eq!(m.scale, want, "{name}");
            let (fan_in, fan_out) = shape.dims(*t);
            assert_eq!(m.a.dims(), &[rank, fan_in], "{name} {t:?}");
            assert_eq!(m.b.dims(), &[fan_out, rank], "{name} {t:?}");
        }
        assert!(a.bytes() > 0);
    }
}

/// The base's weights with every adapted projection's weight plus scale * B A, as a model
/// directory the engine loads.
fn merged(name: &str, base: &str) -> PathBuf {
    let shape = base_shape(base);
    let a = LoraAdapter::load(name, &adapter_dir(name), &shape, 64).unwrap();
    let src = fixture_model(base);
    let mut weights: HashMap<String, Tensor> = HashMap::new();
    for f in std::fs::read_dir(&src).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            weights.extend(candle_core::safetensors::load(&p, &Device::Cpu).unwrap());
        }
    }
    for ((layer, t), m) in &a.modules {
        let key = format!("model.layers.{layer}.{}.{}.weight", t.parent(), t.module());
        let w = weights.get(&key).unwrap_or_else(|| panic!("{key}"));
        let sum = (w + m.delta().unwrap().to_dtype(w.dtype()).unwrap()).unwrap();
        weights.insert(key, sum);
    }
    let out = scratch(name);
    candle_core::safetensors::save(&weights, out.join("model.safetensors")).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if src.join(f).exists() {
            std::fs::copy(src.join(f), out.join(f)).unwrap();
        }
    }
    out
}

fn check_merged(name: &str, base: &str) {
    let dir = merged(name, base);
    let g = golden(&format!("lora-{name}"));
    assert_eq!(g.model, format!("adapters/fixtures/{name}"));
    let mut cfg = EngineConfig::new(&dir);
    cfg.device = test_device();
    cfg.kv_cache = KvBudget::Blocks(256);
    let h = Engine::start(cfg).unwrap();
    let tol = tolerance();
    for case in &g.cases {
        let out = greedy(&h, &case.prompt, case.tokens.len(), 1);
        let o = &out.outputs[0];
        assert_eq!(
            o.token_ids,
            case.tokens,
            "{name}: prompt of {}",
            case.prompt.len()
        );
        for (i, (got, want)) in o
            .logprobs
            .as_ref()
            .unwrap()
            .iter()
            .zip(&case.logprobs)
            .enumerate()
        {
            assert!(
                (got.logprob - want).abs() < tol,
                "{name} step {i}: {} vs {want}",
                got.logprob
            );
        }
    }
    drop(h);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn merged_adapters_decode_as_peft_does() {
    for &(name, base, ..) in ADAPTERS {
        check_merged(name, base);
    }
}

fn copy_adapter(name: &str, tag: &str) -> PathBuf {
    let d = scratch(tag);
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(adapter_dir(name).join(f), d.join(f)).unwrap();
    }
    d
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("adapter_config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn broken_and_unsupported_adapters_are_named_errors() {
    let shape = base_shape("llama3");
    let load = |dir: &Path, max: usize| LoraAdapter::load("mine", dir, &shape, max);
    // a rank above --max-lora-rank
    let e = load(&adapter_dir("llama3-r16-rslora-mlp"), 8).unwrap_err();
    assert!(
        matches!(
            e,
            LoraError::Rank {
                rank: 16,
                max: 8,
                ..
            }
        ),
        "{e}"
    );
    // a base of other shapes (qwen2's adapter on llama3's layers)
    let other = BaseShape {
        intermediate: shape.intermediate + 32,
        ..shape.clone()
    };
    let e = LoraAdapter::load("mine", &adapter_dir("llama3-r4-all"), &other, 64).unwrap_err();
    assert!(
        e.to_string().contains("outputs") || e.to_string().contains("inputs"),
        "{e}"
    );
    let fewer = BaseShape {
        layers: 1,
        ..shape.clone()
    };
    let e = LoraAdapter::load("mine", &adapter_dir("llama3-r4-all"), &fewer, 64).unwrap_err();
    assert!(e.to_string().contains("layer 1"), "{e}");
    // DoRA
    let d = copy_adapter("llama3-r8-qv", "dora");
    edit_config(&d, |v| v["use_dora"] = true.into());
    let e = load(&d, 64).unwrap_err();
    assert!(
        matches!(e, LoraError::Unsupported { .. }) && e.to_string().contains("DoRA"),
        "{e}"
    );
    // a truncated tensor file
    let d = copy_adapter("llama3-r8-qv", "truncated");
    let p = d.join("adapter_model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load(&d, 64).unwrap_err();
    assert!(
        matches!(e, LoraError::Io { .. }) && e.to_string().contains("mine"),
        "{e}"
    );
    // tensors of a projection the config does not target
    let d = copy_adapter("llama3-r8-qv", "targets");
    edit_config(&d, |v| v["target_modules"] = serde_json::json!(["q_proj"]));
    let e = load(&d, 64).unwrap_err();
    assert!(e.to_string().contains("v_proj"), "{e}");
    // no directory, no config
    let e = load(Path::new("/nonexistent/adapter"), 64).unwrap_err();
    assert!(e.to_string().contains("adapter_config.json"), "{e}");
    for tag in ["dora", "truncated", "targets"] {
        let _ = std::fs::remove_dir_all(scratch(tag));
    }
}
