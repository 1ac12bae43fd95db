#![allow(clippy::unwrap_used)]
//! Loading checkpoints: dtypes, and a clear typed error (never a panic) for every way a model
//! directory can be broken.

mod common;

use common::*;
use rserve_core::loader::{load_model, LoadError};
use rserve_core::{Engine, EngineConfig, EngineError, KvBudget};
use std::path::{Path, PathBuf};

fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("rserve-load-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(fixture_model(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

fn load_err(dir: &Path) -> LoadError {
    match load_model(dir, "auto", &candle_core::Device::Cpu, None) {
        Ok(_) => panic!("{} should not load", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn every_broken_checkpoint_is_a_typed_error() {
    let d = copy_fixture("qwen2", "cfg");
    std::fs::remove_file(d.join("config.json")).unwrap();
    assert!(matches!(load_err(&d), LoadError::MissingFile(p) if p.ends_with("config.json")));

    let d = copy_fixture("qwen2", "arch");
    edit_config(&d, |v| {
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"])
    });
    let e = load_err(&d);
    assert!(matches!(e, LoadError::UnsupportedArchitecture { .. }));
    assert!(
        e.to_string().contains("LlamaForCausalLM") && e.to_string().contains("Qwen3ForCausalLM"),
        "{e}"
    );

    let d = copy_fixture("qwen2", "shape");
    edit_config(&d, |v| v["intermediate_size"] = serde_json::json!(96));
    let e = load_err(&d);
    assert!(
        matches!(&e, LoadError::TensorShape { name, .. } if name.contains("mlp")),
        "{e}"
    );

    let d = copy_fixture("qwen2", "missing");
    edit_config(&d, |v| v["tie_word_embeddings"] = serde_json::json!(false));
    let e = load_err(&d);
    assert!(
        matches!(&e, LoadError::MissingTensor { name, .. } if name == "lm_head.weight"),
        "{e}"
    );

    let d = copy_fixture("qwen2", "trunc");
    let w = d.join("model.safetensors");
    let bytes = std::fs::read(&w).unwrap();
    std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(load_err(&d), LoadError::Safetensors { .. }));
    std::fs::write(&w, b"not a safetensors file at all").unwrap();
    assert!(matches!(load_err(&d), LoadError::Safetensors { .. }));

    let d = copy_fixture("qwen2", "tok");
    std::fs::write(d.join("tokenizer.json"), "{ broken").unwrap();
    assert!(matches!(load_err(&d), LoadError::Tokenizer(_)));

    let d = copy_fixture("qwen2", "json");
    std::fs::write(d.join("config.json"), "{ nope").unwrap();
    assert!(matches!(load_err(&d), LoadError::Json { .. }));

    let d = copy_fixture("llama3", "shard");
    std::fs::remove_file(d.join("model-00002-of-00004.safetensors")).unwrap();
    assert!(matches!(load_err(&d), LoadError::MissingFile(_)));

    assert!(matches!(
        load_err(Path::new("/nonexistent/model")),
        LoadError::NoDirectory(_)
    ));
    let mut cfg = EngineConfig::new(fixture_model("qwen2"));
    cfg.dtype = "int3".into();
    assert!(matches!(Engine::start(cfg), Err(EngineError::Load(m)) if m.contains("int3")));
}

#[test]
fn half_precision_dtypes_load_and_generate_close_to_float32() {
    let g = golden("qwen3");
    let case = &g.cases[3];
    for dtype in ["bfloat16", "float16"] {
        let mut cfg = EngineConfig::new(fixture_model("qwen3"));
        cfg.dtype = dtype.into();
        cfg.kv_cache = KvBudget::Blocks(64);
        let h = Engine::start(cfg).expect("starts");
        assert_eq!(
            format!("{:?}", h.info().dtype),
            if dtype == "bfloat16" { "BF16" } else { "F16" }
        );
        let out = greedy(&h, &case.prompt, 4, 0);
        let lps = out.outputs[0].logprobs.clone().unwrap();
        // the first token has a clear margin in the golden: it must agree, with a loose logprob
        assert_eq!(out.outputs[0].token_ids[0], case.tokens[0], "{dtype}");
        assert!(
            (lps[0].logprob - case.logprobs[0]).abs() < 0.15,
            "{dtype}: {} vs {}",
            lps[0].logprob,
            case.logprobs[0]
        );
    }
}

#[test]
fn special_token_ids_outside_the_vocabulary_are_load_errors_naming_the_file() {
    let d = copy_fixture("qwen2", "eos-gen");
    // 2^31: a signed compare in a kernel would take it for a negative id
    std::fs::write(
        d.join("generation_config.json"),
        r#"{"eos_token_id": [1, 2147483648]}"#,
    )
    .unwrap();
    let e = load_err(&d);
    assert!(
        matches!(&e, LoadError::SpecialToken { file, .. } if file.ends_with("generation_config.json")),
        "{e}"
    );
    assert!(e.to_string().contains("2147483648"), "{e}");

    let d = copy_fixture("qwen2", "eos-cfg");
    let _ = std::fs::remove_file(d.join("generation_config.json"));
    edit_config(&d, |v| v["eos_token_id"] = serde_json::json!(1000));
    let e = load_err(&d);
    assert!(
        matches!(&e, LoadError::SpecialToken { file, .. } if file.ends_with("config.json")),
        "{e}"
    );
    edit_config(&d, |v| v["bos_token_id"] = serde_json::json!(-3));
    edit_config(&d, |v| v["eos_token_id"] = serde_json::json!(2));
    assert!(matches!(load_err(&d), LoadError::SpecialToken { .. }));
    edit_config(&d, |v| v["bos_token_id"] = serde_json::json!(null));
    let m = load_model(&d, "auto", &candle_core::Device::Cpu, None).expect("loads");
    assert_eq!(m.generation.eos_token_ids, vec![2]);
}

#[test]
fn the_model_runs_from_input_embeddings_as_from_token_ids() {
    use rserve_core::batch::ForwardBatch;
    use rserve_core::kv_cache::KvCache;
    use rserve_kernels::AttentionMetadata;
    use std::sync::Arc;
    let m = load_model(
        &fixture_model("llama3"),
        "float32",
        &candle_core::Device::Cpu,
        None,
    )
    .unwrap();
    let mc = m.model.config().clone();
    let dev = candle_core::Device::Cpu;
    let ids: Vec<u32> = vec![5, 17, 301, 9, 44];
    let t = ids.len();
    let batch = || ForwardBatch {
        input_ids: candle_core::Tensor::new(ids.as_slice(), &dev).unwrap(),
        positions: candle_core::Tensor::new(&[0u32, 1, 2, 3, 4], &dev).unwrap(),
        logits_indices: candle_core::Tensor::new(&[2u32, 4], &dev).unwrap(),
        attn: Arc::new(
            AttentionMetadata::new(
                (0..t as i64).collect(),
                vec![0],
                1,
                vec![t as u32],
                vec![0, t as u32],
                &dev,
            )
            .unwrap(),
        ),
        adapter_slots: None,
        adapter_slots_covered: 0,
        adapter_runs: Vec::new(),
        adapter_listed: None,
        image_rows: Vec::new(),
        mrope_positions: None,
    };
    let kv = || {
        KvCache::new(
            mc.num_layers,
            1,
            16,
            mc.num_kv_heads,
            mc.head_dim,
            candle_core::DType::F32,
            &dev,
        )
        .unwrap()
    };
    let b = batch();
    let by_ids = m.model.forward(&b, &kv()).unwrap();
    let embeds = m.model.embed(&b.input_ids).unwrap();
    assert_eq!(embeds.dims(), &[t, mc.hidden_size]);
    let by_embeds = m.model.forward_embeds(&embeds, &b, &kv()).unwrap();
    assert_eq!(
        by_ids.to_vec2::<f32>().unwrap(),
        by_embeds.to_vec2::<f32>().unwrap()
    );
    assert_eq!(m.model.max_positions(), mc.max_position_embeddings);
}
