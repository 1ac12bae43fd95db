//! `rserve adapters inspect PATH [--base MODEL]`: what a PEFT LoRA adapter holds (configuration,
//! targets, ranks, scale, size) and whether the server would take it for a base: the same reader
//! and checks as `--lora-modules` and `/v1/load_lora_adapter`, so a failure here names the reason
//! a load would fail with.

use crate::cli::InspectArgs;
use anyhow::{Context, Result};
use rserve_core::lora::peft::{parse_config, tensor_shapes};
use rserve_core::lora::{BaseShape, LoraAdapter};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The base's shape for the check, if one is given or the adapter names one that resolves.
fn base_shape(base: Option<&str>, named: Option<&str>) -> Result<Option<(String, BaseShape)>> {
    let (spec, explicit) = match (base, named) {
        (Some(b), _) => (b, true),
        (None, Some(n)) => (n, false),
        (None, None) => return Ok(None),
    };
    let dir = match rserve_core::hub::resolve_model(spec) {
        Ok(d) => d,
        Err(e) if explicit => return Err(e).with_context(|| format!("the base `{spec}`")),
        Err(_) => return Ok(None),
    };
    let hf = rserve_core::loader::read_config(&dir)?;
    let shape = BaseShape::from_config(&hf).map_err(anyhow::Error::msg)?;
    Ok(Some((spec.to_owned(), shape)))
}

/// The report as JSON; `Err` only when the adapter cannot be read at all.
pub fn report(a: &InspectArgs) -> Result<Value> {
    let dir = rserve_core::hub::resolve_model(&a.path)?;
    let name = dir
        .file_name()
        .map_or_else(|| a.path.clone(), |n| n.to_string_lossy().into_owned());
    let text = std::fs::read_to_string(dir.join("adapter_config.json"))
        .with_context(|| format!("reading {}", dir.join("adapter_config.json").display()))?;
    let raw: Value = serde_json::from_str(&text).context("adapter_config.json")?;
    let file_bytes = std::fs::metadata(dir.join("adapter_model.safetensors"))
        .map(|m| m.len())
        .ok();
    let mut out = json!({
        "path": dir.display().to_string(),
        "peft_type": raw.get("peft_type"),
        "r": raw.get("r"),
        "lora_alpha": raw.get("lora_alpha"),
        "use_rslora": raw.get("use_rslora"),
        "target_modules": raw.get("target_modules"),
        "base_model_name_or_path": raw.get("base_model_name_or_path"),
        "file_bytes": file_bytes,
    });
    let config = match parse_config(&name, &text) {
        Ok(c) => c,
        Err(e) => {
            out["usable"] = json!(false);
            out["reason"] = json!(e.to_string());
            return Ok(out);
        }
    };
    out["targets"] = json!(config
        .targets
        .iter()
        .map(|t| t.module())
        .collect::<Vec<_>>());
    out["scale"] = json!(config.scale(config.rank));
    match tensor_shapes(&dir) {
        Ok(t) => out["tensors"] = json!(t.len()),
        Err(e) => out["reason"] = json!(format!("adapter_model.safetensors: {e}")),
    }
    let named = raw.get("base_model_name_or_path").and_then(Value::as_str);
    match base_shape(a.base.as_deref(), named)? {
        None => {
            out["checked_against"] = Value::Null;
            out["usable"] = Value::Null;
        }
        Some((spec, shape)) => {
            out["checked_against"] = json!(spec);
            let t0 = std::time::Instant::now();
            match LoraAdapter::load(&name, &dir, &shape, a.max_lora_rank) {
                Ok(ad) => {
                    // what a runtime load (`/v1/load_lora_adapter`) spends reading and checking
                    out["read_ms"] = json!((t0.elapsed().as_secs_f64() * 1e4).round() / 10.0);
                    let mut ranks: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
                    for ((_, t), m) in &ad.modules {
                        let r = ranks.entry(t.module()).or_default();
                        if !r.contains(&m.rank()) {
                            r.push(m.rank());
                        }
                    }
                    let layers: std::collections::BTreeSet<usize> =
                        ad.modules.keys().map(|(l, _)| *l).collect();
                    out["usable"] = json!(true);
                    out["modules"] = json!(ad.modules.len());
                    out["layers"] = json!(layers.len());
                    out["ranks"] = json!(ranks);
                    out["bf16_bytes"] = json!(ad.elements() * 2);
                }
                Err(e) => {
                    out["usable"] = json!(false);
                    out["reason"] = json!(e.to_string());
                }
            }
        }
    }
    Ok(out)
}

/// Prints the report; exits with an error when the adapter is not usable on the base.
pub fn inspect(a: InspectArgs) -> Result<()> {
    let r = report(&a)?;
    if a.json {
        println!("{r}");
    } else {
        for (k, v) in r.as_object().into_iter().flatten() {
            if !v.is_null() {
                println!("{k:>24}: {v}");
            }
        }
    }
    if r["usable"] == json!(false) {
        anyhow::bail!(
            "the adapter cannot be served: {}",
            r["reason"].as_str().unwrap_or("?")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn repo() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    fn args(path: &Path, base: Option<&Path>, max: usize) -> InspectArgs {
        InspectArgs {
            path: path.display().to_string(),
            base: base.map(|b| b.display().to_string()),
            max_lora_rank: max,
            json: true,
        }
    }

    #[test]
    fn a_fixture_adapter_is_described_and_checked_against_its_base() {
        let dir = repo().join("adapters/fixtures/qwen2-r8-all");
        let base = repo().join("tests/fixtures/models/qwen2");
        let r = report(&args(&dir, Some(&base), 16)).unwrap();
        assert_eq!(r["usable"], json!(true), "{r}");
        assert_eq!(r["modules"], json!(14));
        assert_eq!(r["layers"], json!(2));
        assert_eq!(r["ranks"]["q_proj"], json!([8]));
        assert_eq!(r["targets"].as_array().map(Vec::len), Some(7));
        assert_eq!(r["tensors"], json!(28));
        // over --max-lora-rank: not usable, with the reason
        let r = report(&args(&dir, Some(&base), 4)).unwrap();
        assert_eq!(r["usable"], json!(false));
        assert!(
            r["reason"].as_str().unwrap().contains("max-lora-rank"),
            "{r}"
        );
        // without a base that resolves: described, not checked
        let r = report(&args(&dir, None, 16)).unwrap();
        assert!(r["usable"].is_null() && r["r"] == json!(8), "{r}");
        // a base that does not exist is an error
        assert!(report(&args(&dir, Some(Path::new("/no/such/base")), 16)).is_err());
    }
}
