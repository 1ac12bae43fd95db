//! Multi-adapter serving on the tiny fixtures (float32, CPU): each PEFT adapter decodes as
//! transformers + peft decode with it (greedy tokens equal, log-probs within 1e-4), alone and all
//! of them mixed in one batch with base rows, with fewer device slots than adapters (slots are
//! rewritten between steps) and fewer host copies (adapters read again from disk); adapters load
//! and unload while requests run, and bad loads are errors that leave the engine serving.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use rserve_core::lora::LoraOptions;
use rserve_core::{
    EngineConfig, EngineError, EngineHandle, EngineRequest, OutputStream, SamplingParams,
};
use std::path::PathBuf;

const LLAMA3_ADAPTERS: &[&str] = &["llama3-r8-qv", "llama3-r4-all", "llama3-r16-rslora-mlp"];

fn adapter_dir(name: &str) -> PathBuf {
    repo().join("adapters/fixtures").join(name)
}

fn with_adapters(
    names: &[&str],
    max_loras: usize,
    max_cpu: usize,
) -> impl FnOnce(&mut EngineConfig) {
    let modules: Vec<(String, PathBuf)> = names
        .iter()
        .map(|n| (n.to_string(), adapter_dir(n)))
        .collect();
    move |c: &mut EngineConfig| {
        c.lora = Some(LoraOptions {
            max_loras,
            max_rank: 16,
            max_cpu_loras: max_cpu,
        });
        c.lora_modules = modules;
    }
}

fn submit(h: &EngineHandle, prompt: &[u32], n: usize, lora: Option<&str>) -> OutputStream {
    let mut p = SamplingParams::greedy(n);
    p.ignore_eos = true;
    p.logprobs = Some(1);
    h.submit(EngineRequest {
        prompt_token_ids: prompt.to_vec(),
        params: p,
        lora: lora.map(str::to_owned),
        cache_salt: None,
        mm: None,
    })
    .unwrap()
}

/// Every golden case of `golden` (an adapter's, or the base's with `lora` None) submitted now; the
/// streams with what each must produce.
fn submit_cases(
    h: &EngineHandle,
    golden_name: &str,
    lora: Option<&str>,
) -> Vec<(String, OutputStream, Vec<u32>, Vec<f32>)> {
    golden(golden_name)
        .cases
        .into_iter()
        .map(|c| {
            let s = submit(h, &c.prompt, c.tokens.len(), lora);
            let tag = format!("{golden_name} prompt of {}", c.prompt.len());
            (tag, s, c.tokens, c.logprobs)
        })
        .collect()
}

fn check(runs: Vec<(String, OutputStream, Vec<u32>, Vec<f32>)>) {
    let tol = tolerance();
    for (tag, s, tokens, logprobs) in runs {
        let out = s.wait().unwrap();
        let o = &out.outputs[0];
        assert_eq!(o.token_ids, tokens, "{tag}");
        for (i, (got, want)) in o
            .logprobs
            .as_ref()
            .unwrap()
            .iter()
            .zip(&logprobs)
            .enumerate()
        {
            assert!(
                (got.logprob - want).abs() < tol,
                "{tag} step {i}: {} vs {want}",
                got.logprob
            );
        }
    }
}

#[test]
fn each_adapter_alone_decodes_as_peft_does() {
    let h = start("llama3", with_adapters(LLAMA3_ADAPTERS, 1, 1));
    for name in LLAMA3_ADAPTERS {
        check(submit_cases(&h, &format!("lora-{name}"), Some(name)));
    }
    assert_sound(&h);
    let h = start("qwen2", with_adapters(&["qwen2-r8-all"], 1, 1));
    check(submit_cases(&h, "lora-qwen2-r8-all", Some("qwen2-r8-all")));
    // the base's own rows are untouched by the adapters loaded beside them
    check(submit_cases(&h, "qwen2", None));
    assert_sound(&h);
}

#[test]
fn adapters_and_base_rows_mixed_in_one_batch_decode_as_alone() {
    // as many slots as adapters, then fewer (slots rewritten, admission limited) and fewer host
    // copies (adapters read again from their directories)
    for (max_loras, max_cpu) in [(3, 3), (2, 2), (1, 1)] {
        let h = start("llama3", with_adapters(LLAMA3_ADAPTERS, max_loras, max_cpu));
        let mut runs = submit_cases(&h, "llama3", None);
        for name in LLAMA3_ADAPTERS {
            runs.extend(submit_cases(&h, &format!("lora-{name}"), Some(name)));
        }
        check(runs);
        assert_sound(&h);
    }
}

#[test]
fn adapters_load_and_unload_while_requests_run() {
    let h = start("llama3", with_adapters(&[], 2, 2));
    let id = h.load_lora("qv", &adapter_dir("llama3-r8-qv")).unwrap();
    // the same name twice, an unknown name, a broken adapter: errors, nothing changes
    let e = h
        .load_lora("qv", &adapter_dir("llama3-r4-all"))
        .unwrap_err();
    assert!(
        matches!(e, EngineError::Lora(_)) && e.to_string().contains("already"),
        "{e}"
    );
    let e = h.unload_lora("nope").unwrap_err();
    assert!(matches!(e, EngineError::NotFound(_)), "{e}");
    let broken = std::env::temp_dir().join(format!("rserve-lora-broken-{}", std::process::id()));
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("adapter_config.json"), "{not json").unwrap();
    let e = h.load_lora("broken", &broken).unwrap_err();
    assert!(
        matches!(e, EngineError::Lora(_)) && e.to_string().contains("broken"),
        "{e}"
    );
    std::fs::write(
        broken.join("adapter_config.json"),
        r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}"#,
    )
    .unwrap();
    std::fs::write(broken.join("adapter_model.safetensors"), b"truncated").unwrap();
    assert!(h.load_lora("broken", &broken).is_err());
    let _ = std::fs::remove_dir_all(&broken);
    // a request in flight keeps its adapter through an unload
    let g = golden("lora-llama3-r8-qv");
    let case = g.cases.last().unwrap();
    let long = submit(&h, &case.prompt, case.tokens.len(), Some("qv"));
    assert_eq!(h.unload_lora("qv").unwrap(), id);
    let out = long.wait().unwrap();
    assert_eq!(out.outputs[0].token_ids, case.tokens);
    // an unloaded name is unknown to new requests
    let mut p = SamplingParams::greedy(2);
    p.ignore_eos = true;
    let e = h
        .submit(EngineRequest {
            prompt_token_ids: vec![1, 2],
            params: p,
            lora: Some("qv".into()),
            cache_salt: None,
            mm: None,
        })
        .err()
        .unwrap();
    assert!(matches!(e, EngineError::NotFound(_)), "{e}");
    // loaded again (a new id), and two other adapters through the two slots
    assert_ne!(h.load_lora("qv", &adapter_dir("llama3-r8-qv")).unwrap(), id);
    h.load_lora("all", &adapter_dir("llama3-r4-all")).unwrap();
    h.load_lora("mlp", &adapter_dir("llama3-r16-rslora-mlp"))
        .unwrap();
    let mut runs = submit_cases(&h, "lora-llama3-r8-qv", Some("qv"));
    runs.extend(submit_cases(&h, "lora-llama3-r4-all", Some("all")));
    runs.extend(submit_cases(&h, "lora-llama3-r16-rslora-mlp", Some("mlp")));
    check(runs);
    let names: Vec<String> = h
        .lora_registry()
        .unwrap()
        .list()
        .into_iter()
        .map(|a| a.name)
        .collect();
    assert_eq!(names, ["all", "mlp", "qv"]);
    assert_sound(&h);
}

#[test]
fn adapters_off_or_misconfigured_are_clear_errors() {
    let h = start("llama3", |_| {});
    let e = h
        .submit(EngineRequest {
            prompt_token_ids: vec![1, 2],
            params: SamplingParams::greedy(2),
            lora: Some("qv".into()),
            cache_salt: None,
            mm: None,
        })
        .err()
        .unwrap();
    assert!(matches!(e, EngineError::NotFound(_)), "{e}");
    let e = h.load_lora("qv", &adapter_dir("llama3-r8-qv")).unwrap_err();
    assert!(e.to_string().contains("--enable-lora"), "{e}");
    // a rank above --max-lora-rank at start, and modules without --enable-lora
    let mut cfg = EngineConfig::new(fixture_model("llama3"));
    cfg.lora = Some(LoraOptions {
        max_loras: 1,
        max_rank: 8,
        max_cpu_loras: 1,
    });
    cfg.lora_modules = vec![("mlp".into(), adapter_dir("llama3-r16-rslora-mlp"))];
    let e = rserve_core::Engine::start(cfg).err().unwrap();
    assert!(e.to_string().contains("max-lora-rank"), "{e}");
    let mut cfg = EngineConfig::new(fixture_model("llama3"));
    cfg.lora_modules = vec![("qv".into(), adapter_dir("llama3-r8-qv"))];
    assert!(rserve_core::Engine::start(cfg).is_err());
}

fn mean_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

#[test]
fn adapters_apply_on_a_quantized_base() {
    let ids: Vec<u32> = golden("lora-llama3-r4-all").cases[4].prompt.clone();
    let full = start("llama3", with_adapters(&["llama3-r4-all"], 1, 1));
    let (want, base) = (
        teacher_forced_with(&full, &ids, Some("llama3-r4-all")),
        teacher_forced_with(&full, &ids, None),
    );
    drop(full);
    let q = start("llama3", |c| {
        with_adapters(&["llama3-r4-all"], 1, 1)(c);
        c.isq = Some(rserve_core::quant::IsqFormat::Q8_0);
    });
    assert!(q.info().isq.is_some());
    let got = teacher_forced_with(&q, &ids, Some("llama3-r4-all"));
    // the q8_0 base with the adapter is near the f32 base with it, far nearer than either base is
    let (err, gap) = (mean_abs(&got, &want), mean_abs(&base, &want));
    assert!(
        err < 0.05 && err * 5.0 < gap,
        "q8_0 + adapter {err} vs adapter effect {gap}"
    );
    assert_sound(&q);
}

#[test]
fn an_adapter_named_by_hub_id_is_found_in_the_local_cache() {
    // a hub cache laid out as huggingface-hub writes it, offline
    let cache = std::env::temp_dir().join(format!("rserve-lora-hub-{}", std::process::id()));
    let snap = cache.join("models--acme--tiny-qv/snapshots/0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(cache.join("models--acme--tiny-qv/refs")).unwrap();
    std::fs::write(cache.join("models--acme--tiny-qv/refs/main"), "0123abcd").unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(adapter_dir("llama3-r8-qv").join(f), snap.join(f)).unwrap();
    }
    // only hub ids read these variables; the other tests name directories
    std::env::set_var("HF_HUB_CACHE", &cache);
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let h = start("llama3", with_adapters(&[], 1, 1));
    h.load_lora("qv", std::path::Path::new("acme/tiny-qv"))
        .unwrap();
    check(submit_cases(&h, "lora-llama3-r8-qv", Some("qv")));
    let e = h
        .load_lora("other", std::path::Path::new("acme/missing"))
        .unwrap_err();
    assert!(
        matches!(e, EngineError::Lora(_)) && e.to_string().contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    assert_sound(&h);
    let _ = std::fs::remove_dir_all(&cache);
}
