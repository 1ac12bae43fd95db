//! PEFT LoRA adapters: a directory with `adapter_config.json` and `adapter_model.safetensors`, as
//! peft's `save_pretrained` writes it, read into per-layer, per-projection pairs of matrices and
//! checked against the base model's shapes.
//!
//! Supported: `peft_type` LORA on the seven decoder projections (`q/k/v/o_proj`,
//! `gate/up/down_proj`), any rank up to the server's `--max-lora-rank` (per module, so
//! `rank_pattern` works), `lora_alpha` with `use_rslora` (scale alpha / sqrt(r)) or without
//! (alpha / r), `layers_to_transform` (layers without tensors have no adapter), `bias` = `none`.
//! Everything else a file may ask for (DoRA, `modules_to_save`, embedding or `lm_head`
//! adapters, LoRA biases, `alpha_pattern`, `fan_in_fan_out`, other PEFT methods) is a
//! [`LoraError::Unsupported`] naming the adapter and the feature, as are shapes that do not fit the
//! base.

use crate::models::hf_config::HfConfig;
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Why an adapter could not be used; every variant names the adapter.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("LoRA adapter `{adapter}`: cannot read {what}: {reason}")]
    Io {
        adapter: String,
        what: String,
        reason: String,
    },
    #[error("LoRA adapter `{adapter}`: adapter_config.json: {reason}")]
    Config { adapter: String, reason: String },
    #[error("LoRA adapter `{adapter}`: {feature} is not supported")]
    Unsupported { adapter: String, feature: String },
    #[error("LoRA adapter `{adapter}`: tensor `{tensor}`: {reason}")]
    Tensor {
        adapter: String,
        tensor: String,
        reason: String,
    },
    #[error("LoRA adapter `{adapter}`: rank {rank} of `{module}` exceeds --max-lora-rank {max}")]
    Rank {
        adapter: String,
        module: String,
        rank: usize,
        max: usize,
    },
}

/// A projection an adapter can target, by PEFT's module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// PEFT's (and transformers') module name.
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// The projection of a PEFT module name.
    pub fn from_module(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.module() == name)
    }

    /// The decoder block's submodule that holds it (`self_attn` or `mlp`).
    pub fn parent(self) -> &'static str {
        match self {
            Target::Gate | Target::Up | Target::Down => "mlp",
            _ => "self_attn",
        }
    }
}

/// What an adapter is checked against: the base model's layer count and each projection's
/// `(in, out)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseShape {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub q_out: usize,
    pub kv_out: usize,
}

impl BaseShape {
    /// From a Hugging Face `config.json`.
    pub fn from_config(c: &HfConfig) -> Result<Self, String> {
        let need = |v: Option<usize>, f: &str| v.ok_or_else(|| format!("config.json has no `{f}`"));
        let hidden = need(c.hidden_size, "hidden_size")?;
        let heads = need(c.num_attention_heads, "num_attention_heads")?;
        let head_dim = c.head_dim.unwrap_or(hidden / heads.max(1));
        Ok(Self {
            layers: need(c.num_hidden_layers, "num_hidden_layers")?,
            hidden,
            intermediate: need(c.intermediate_size, "intermediate_size")?,
            q_out: heads * head_dim,
            kv_out: c.num_key_value_heads.unwrap_or(heads) * head_dim,
        })
    }

    /// `(in, out)` of a projection.
    pub fn dims(&self, t: Target) -> (usize, usize) {
        match t {
            Target::Q => (self.hidden, self.q_out),
            Target::K | Target::V => (self.hidden, self.kv_out),
            Target::O => (self.q_out, self.hidden),
            Target::Gate | Target::Up => (self.hidden, self.intermediate),
            Target::Down => (self.intermediate, self.hidden),
        }
    }
}

/// The parts of `adapter_config.json` rserve reads.
#[derive(Debug, Deserialize)]
struct RawConfig {
    #[serde(default)]
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    target_modules: Option<Value>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    bias: Option<String>,
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    alpha_pattern: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
}

/// An adapter's settings, as read and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    /// `r`: the default rank (a module's own is its tensors').
    pub rank: usize,
    pub alpha: f64,
    pub rslora: bool,
    /// The projections `target_modules` names.
    pub targets: Vec<Target>,
    pub base_model: Option<String>,
}

impl AdapterConfig {
    /// The factor on `B A` for a module of rank `r`: alpha / r, or alpha / sqrt(r) with rsLoRA.
    pub fn scale(&self, r: usize) -> f64 {
        let r = r.max(1) as f64;
        if self.rslora {
            self.alpha / r.sqrt()
        } else {
            self.alpha / r
        }
    }
}

/// One adapted projection: `y += scale * (x A^T) B^T`.
#[derive(Debug, Clone)]
pub struct LoraModule {
    pub a: Tensor, // [r, in], as stored (f32, f16 or bf16)
    pub b: Tensor, // [out, r], as stored
    pub scale: f64,
}

impl LoraModule {
    pub fn rank(&self) -> usize {
        self.a.dims().first().copied().unwrap_or(0)
    }

    /// `scale * B A`, `[out, in]` in f32: what merging the adapter adds to the weight.
    pub fn delta(&self) -> candle_core::Result<Tensor> {
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        f32(&self.b)?.matmul(&f32(&self.a)?)? * self.scale
    }
}

/// A PEFT LoRA adapter read from its directory and checked against a base.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    pub name: String,
    pub config: AdapterConfig,
    /// (layer, projection) -> its pair of matrices, on the CPU as the file stores them.
    pub modules: BTreeMap<(usize, Target), LoraModule>,
}

impl LoraAdapter {
    /// Reads the adapter `name` from `dir` and checks it against `base`, ranks up to `max_rank`.
    pub fn load(
        name: &str,
        dir: &Path,
        base: &BaseShape,
        max_rank: usize,
    ) -> Result<Self, LoraError> {
        let io = |what: &str, reason: String| LoraError::Io {
            adapter: name.to_owned(),
            what: what.to_owned(),
            reason,
        };
        let conf_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&conf_path)
            .map_err(|e| io(&conf_path.display().to_string(), e.to_string()))?;
        let config = parse_config(name, &text)?;
        let st = dir.join("adapter_model.safetensors");
        if !st.exists() {
            let what = if dir.join("adapter_model.bin").exists() {
                "adapter_model.bin (pickle; save the adapter with safe_serialization=True)"
            } else {
                "adapter_model.safetensors"
            };
            return Err(io(what, "not found".into()));
        }
        let tensors =
            read_tensors(&st).map_err(|e| io("adapter_model.safetensors", e.to_string()))?;
        let modules = modules(name, &config, tensors, base, max_rank)?;
        Ok(Self {
            name: name.to_owned(),
            config,
            modules,
        })
    }

    /// An adapter named `name` that changes nothing (no modules).
    pub fn empty(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            config: AdapterConfig {
                rank: 0,
                alpha: 0.0,
                rslora: false,
                targets: Vec::new(),
                base_model: None,
            },
            modules: BTreeMap::new(),
        }
    }

    /// The size of its matrices in bytes as stored here (the file's dtype).
    pub fn bytes(&self) -> usize {
        self.modules
            .values()
            .map(|m| (m.a.elem_count() + m.b.elem_count()) * m.a.dtype().size_in_bytes())
            .sum()
    }

    /// The number of values in its matrices.
    pub fn elements(&self) -> usize {
        self.modules
            .values()
            .map(|m| m.a.elem_count() + m.b.elem_count())
            .sum()
    }

    /// The largest rank of any module.
    pub fn max_rank(&self) -> usize {
        self.modules
            .values()
            .map(LoraModule::rank)
            .max()
            .unwrap_or(0)
    }
}

/// Every tensor of the safetensors file `path`, on the CPU as the file stores them: the header is
/// read first, then each tensor's bytes straight from the file at its offset, the tensors in
/// parallel (reading the whole file and then each tensor out of it on one thread took 60-124 ms
/// for an 8B-shaped rank-16 adapter). Not mapped: a file cut short while a running server reads
/// it is an error, not a fault.
fn read_tensors(path: &Path) -> candle_core::Result<HashMap<String, Tensor>> {
    use rayon::prelude::*;
    use std::os::unix::fs::FileExt;
    let bad = |why: String| candle_core::Error::Msg(format!("not a safetensors file: {why}"));
    let file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0)?;
    let n = u64::from_le_bytes(n);
    if n > size.saturating_sub(8) || n > 100 << 20 {
        return Err(bad(format!("a header of {n} bytes in a file of {size}")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact_at(&mut header, 8)?;
    let header: HashMap<String, Value> =
        serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
    let start = 8 + n;
    let entries: Vec<(String, Entry)> = header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let e: Entry = serde_json::from_value(v).map_err(|e| bad(format!("`{k}`: {e}")))?;
            Ok((k, e))
        })
        .collect::<candle_core::Result<_>>()?;
    entries
        .into_par_iter()
        .map(|(name, e)| {
            let dtype = match e.dtype.as_str() {
                "F32" => DType::F32,
                "F16" => DType::F16,
                "BF16" => DType::BF16,
                other => candle_core::bail!(
                    "`{name}`: dtype {other} (LoRA matrices are f32, f16 or bf16)"
                ),
            };
            let [lo, hi] = e.data_offsets;
            // a header's shape and offsets are the file's word: sizes that overflow are lies
            let bytes_wanted = e
                .shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .and_then(|c| c.checked_mul(dtype.size_in_bytes()))
                .and_then(|b| u64::try_from(b).ok());
            if hi < lo
                || Some(hi - lo) != bytes_wanted
                || start.checked_add(hi).is_none_or(|end| end > size)
            {
                return Err(bad(format!(
                    "`{name}`: bytes {lo}..{hi} for shape {:?}",
                    e.shape
                )));
            }
            let mut bytes = vec![0u8; (hi - lo) as usize];
            file.read_exact_at(&mut bytes, start + lo)?;
            let t = Tensor::from_raw_buffer(&bytes, dtype, &e.shape, &Device::Cpu)?;
            Ok((name, t))
        })
        .collect()
}

/// A tensor's entry in a safetensors header.
#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

/// The tensors of an adapter directory's `adapter_model.safetensors`: name -> shape, from the
/// file's header (nothing is checked or converted).
pub fn tensor_shapes(dir: &Path) -> candle_core::Result<BTreeMap<String, Vec<usize>>> {
    let file = dir.join("adapter_model.safetensors");
    // SAFETY: the file is mapped read-only and only its header is read while the map lives.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&file) }?;
    Ok(st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec()))
        .collect())
}

/// Reads and checks `adapter_config.json` of the adapter `name` (its text).
pub fn parse_config(name: &str, text: &str) -> Result<AdapterConfig, LoraError> {
    let bad = |reason: String| LoraError::Config {
        adapter: name.to_owned(),
        reason,
    };
    let unsupported = |feature: &str| LoraError::Unsupported {
        adapter: name.to_owned(),
        feature: feature.to_owned(),
    };
    let raw: RawConfig = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    match raw.peft_type.as_deref() {
        None | Some("LORA") => {}
        Some(other) => return Err(unsupported(&format!("peft_type `{other}` (only LORA is)"))),
    }
    if raw.r == 0 {
        return Err(bad("`r` is 0".into()));
    }
    if !raw.lora_alpha.is_finite() {
        return Err(bad("`lora_alpha` is not a finite number".into()));
    }
    if raw.use_dora {
        return Err(unsupported("DoRA (`use_dora`)"));
    }
    if raw.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(unsupported("`modules_to_save` (fully trained modules)"));
    }
    if raw.bias.as_deref().is_some_and(|b| b != "none") || raw.lora_bias {
        return Err(unsupported(
            "LoRA biases (`bias` other than none, `lora_bias`)",
        ));
    }
    if raw.fan_in_fan_out {
        return Err(unsupported("`fan_in_fan_out` (Conv1D bases)"));
    }
    if raw.alpha_pattern.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(unsupported("`alpha_pattern`"));
    }
    let targets = match raw.target_modules {
        None => Target::ALL.to_vec(),
        Some(Value::String(s)) if s == "all-linear" => Target::ALL.to_vec(),
        Some(Value::String(s)) => match Target::from_module(&s) {
            Some(t) => vec![t],
            None => {
                return Err(unsupported(&format!(
                    "`target_modules` as the pattern `{s}` (list the projections instead)"
                )))
            }
        },
        Some(Value::Array(list)) => {
            let mut ts = Vec::new();
            for v in list {
                let Some(s) = v.as_str() else {
                    return Err(bad(format!(
                        "`target_modules` holds {v}, not a module name"
                    )));
                };
                // a module name, or a path ending in one
                let last = s.rsplit('.').next().unwrap_or(s);
                match Target::from_module(last) {
                    Some(t) if !ts.contains(&t) => ts.push(t),
                    Some(_) => {}
                    None => {
                        return Err(unsupported(&format!(
                            "target module `{s}` (q/k/v/o_proj and gate/up/down_proj are)"
                        )))
                    }
                }
            }
            ts.sort();
            ts
        }
        Some(other) => return Err(bad(format!("`target_modules` is {other}"))),
    };
    Ok(AdapterConfig {
        rank: raw.r,
        alpha: raw.lora_alpha,
        rslora: raw.use_rslora,
        targets,
        base_model: raw.base_model_name_or_path,
    })
}

/// `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}[.adapter].weight` ->
/// (layer, projection, is_b).
fn parse_name(name: &str) -> Option<(usize, Target, bool)> {
    let rest = name.strip_prefix("base_model.model.")?;
    let rest = rest.strip_prefix("model.").unwrap_or(rest);
    let rest = rest.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let (parent, rest) = rest.split_once('.')?;
    let (module, rest) = rest.split_once('.')?;
    let target = Target::from_module(module)?;
    if parent != target.parent() {
        return None;
    }
    let is_b = match rest.split('.').next()? {
        "lora_A" => false,
        "lora_B" => true,
        _ => return None,
    };
    // `lora_X.weight`, or `lora_X.<adapter name>.weight`
    let parts: Vec<&str> = rest.split('.').collect();
    (matches!(parts.len(), 2 | 3) && parts.last() == Some(&"weight"))
        .then_some((layer, target, is_b))
}

fn modules(
    name: &str,
    config: &AdapterConfig,
    tensors: HashMap<String, Tensor>,
    base: &BaseShape,
    max_rank: usize,
) -> Result<BTreeMap<(usize, Target), LoraModule>, LoraError> {
    let tensor_err = |tensor: &str, reason: String| LoraError::Tensor {
        adapter: name.to_owned(),
        tensor: tensor.to_owned(),
        reason,
    };
    // (layer, projection) -> [lora_A, lora_B], each with its tensor's name
    type Named = Option<(String, Tensor)>;
    let mut pairs: BTreeMap<(usize, Target), [Named; 2]> = BTreeMap::new();
    let mut names: Vec<_> = tensors.into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    for (tname, t) in names {
        let Some((layer, target, is_b)) = parse_name(&tname) else {
            let feature = if tname.contains("embed") || tname.contains("lm_head") {
                format!("an adapter on the embeddings or the LM head (`{tname}`)")
            } else if tname.contains("magnitude") {
                format!("DoRA (`{tname}`)")
            } else {
                format!("the tensor `{tname}` (not a LoRA matrix of a decoder projection)")
            };
            return Err(LoraError::Unsupported {
                adapter: name.to_owned(),
                feature,
            });
        };
        if layer >= base.layers {
            return Err(tensor_err(
                &tname,
                format!("layer {layer}, but the base has {} layers", base.layers),
            ));
        }
        if !config.targets.contains(&target) {
            return Err(tensor_err(
                &tname,
                "a projection `target_modules` does not name".into(),
            ));
        }
        // kept as stored (no conversion on the load path); slot writes convert on the device
        if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(tensor_err(
                &tname,
                format!("dtype {:?} (LoRA matrices are f32, f16 or bf16)", t.dtype()),
            ));
        }
        let slot = &mut pairs.entry((layer, target)).or_default()[usize::from(is_b)];
        if let Some((first, _)) = slot {
            return Err(tensor_err(&tname, format!("a second copy of `{first}`")));
        }
        *slot = Some((tname, t));
    }
    let mut out = BTreeMap::new();
    for ((layer, target), [a, b]) in pairs {
        let module = format!(
            "model.layers.{layer}.{}.{}",
            target.parent(),
            target.module()
        );
        let (Some((an, a)), Some((bn, b))) = (a, b) else {
            return Err(tensor_err(
                &module,
                "has only one of lora_A and lora_B".into(),
            ));
        };
        let (fan_in, fan_out) = base.dims(target);
        let (ar, ain) = a.dims2().map_err(|e| tensor_err(&an, e.to_string()))?;
        let (bout, br) = b.dims2().map_err(|e| tensor_err(&bn, e.to_string()))?;
        if ain != fan_in {
            return Err(tensor_err(
                &an,
                format!("shape [{ar}, {ain}], but the base projection takes {fan_in} inputs"),
            ));
        }
        if bout != fan_out {
            return Err(tensor_err(
                &bn,
                format!("shape [{bout}, {br}], but the base projection has {fan_out} outputs"),
            ));
        }
        if ar == 0 {
            return Err(tensor_err(&an, "rank 0".into()));
        }
        if ar != br {
            return Err(tensor_err(
                &module,
                format!("lora_A has rank {ar}, lora_B {br}"),
            ));
        }
        if ar > max_rank {
            return Err(LoraError::Rank {
                adapter: name.to_owned(),
                module,
                rank: ar,
                max: max_rank,
            });
        }
        let scale = config.scale(ar);
        out.insert((layer, target), LoraModule { a, b, scale });
    }
    if out.is_empty() {
        return Err(tensor_err(
            "adapter_model.safetensors",
            "holds no LoRA matrices".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_read_and_unsupported_features_named() {
        let ok = parse_config(
            "a",
            r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"], "bias": "none"}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.targets, vec![Target::Q, Target::V]);
        assert_eq!(ok.scale(8), 2.0);
        let rs = parse_config("a", r#"{"r": 16, "lora_alpha": 8, "use_rslora": true}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rs.scale(16), 2.0);
        assert_eq!(rs.targets, Target::ALL.to_vec());
        for (json, what) in [
            (r#"{"r": 8, "lora_alpha": 8, "use_dora": true}"#, "DoRA"),
            (
                r#"{"r": 8, "lora_alpha": 8, "modules_to_save": ["lm_head"]}"#,
                "modules_to_save",
            ),
            (r#"{"r": 8, "lora_alpha": 8, "bias": "all"}"#, "biases"),
            (
                r#"{"r": 8, "lora_alpha": 8, "target_modules": ["embed_tokens"]}"#,
                "embed_tokens",
            ),
            (
                r#"{"r": 8, "lora_alpha": 8, "target_modules": ".*proj"}"#,
                "pattern",
            ),
            (r#"{"peft_type": "IA3", "r": 8, "lora_alpha": 8}"#, "IA3"),
            (r#"{"r": 0, "lora_alpha": 8}"#, "`r` is 0"),
            (r#"{"lora_alpha": 8}"#, "missing field `r`"),
            (
                r#"{"r": 8, "lora_alpha": 8, "target_modules": [3]}"#,
                "not a module name",
            ),
        ] {
            let e = parse_config("bad-one", json)
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(e.contains("bad-one") && e.contains(what), "{json}: {e}");
        }
    }

    #[test]
    fn tensor_names_map_to_layers_and_projections() {
        assert_eq!(
            parse_name("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            Some((3, Target::Q, false))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight"),
            Some((0, Target::Down, true))
        );
        assert_eq!(
            parse_name("base_model.model.model.layers.0.mlp.q_proj.lora_A.weight"),
            None
        );
        assert_eq!(parse_name("base_model.model.lm_head.lora_A.weight"), None);
        assert_eq!(
            parse_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.a.b.weight"),
            None
        );
    }

    /// A safetensors file whose header claims sizes past `usize` (a shape of 2^62 x 8, offsets
    /// near 2^64) is refused as malformed, never an overflow.
    #[test]
    fn headers_with_huge_sizes_are_refused() {
        let dir = std::env::temp_dir().join(format!("rserve-peft-huge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let path = dir.join("adapter_model.safetensors");
        for (shape, offsets) in [
            ("[4611686018427387904, 8]", "[0, 0]"),
            ("[2, 2]", "[18446744073709551600, 18446744073709551615]"),
            ("[2, 2]", "[0, 18446744073709551615]"),
            ("[18446744073709551615, 18446744073709551615]", "[0, 16]"),
        ] {
            let header = format!(
                r#"{{"a": {{"dtype": "F32", "shape": {shape}, "data_offsets": {offsets}}}}}"#
            );
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            bytes.extend_from_slice(&[0u8; 16]);
            std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));
            let e = read_tensors(&path).expect_err(shape);
            assert!(
                e.to_string().contains("not a safetensors file"),
                "{shape}: {e}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
