#![allow(clippy::unwrap_used)]
//! GGUF checkpoints and GGML quantizers against llama.cpp and transformers (fixtures and goldens
//! from `tests/fixtures/make_gguf.py`):
//! - rserve's quantizers write the bytes llama.cpp's reference quantizers write;
//! - tiny GGUF files made by llama.cpp's converter and quantizer (`q4_k_m` mixing q4_K and
//!   q6_K, `q8_0`, `q4_0`) decode as transformers decodes them: within 1e-3 with f32 products of
//!   the dequantized weights, and with the fast kernels (8-bit activations, as ggml's) the same
//!   tokens up to the first near-tie and log-probs within 0.15;
//! - the tokenizer rebuilt from the metadata tokenizes as the model's `tokenizer.json`;
//! - truncated, hostile and unsupported files are typed errors, never panics.

mod common;

use common::*;
use rserve_core::gguf::file::{parse, GgufError};
use rserve_core::loader::{load_model_with, LoadError, LoadOptions};
use rserve_core::quant::ggml::set_reference_products;
use rserve_core::{Engine, EngineConfig, EngineHandle, EngineRequest, KvBudget, SamplingParams};
use rserve_kernels::quantize::{quantize, BlockType};
use std::path::PathBuf;

const MODELS: &[&str] = &["llama-q4_k_m", "qwen2-q8_0", "qwen3-q4_0"];

fn gguf_path(name: &str) -> PathBuf {
    repo()
        .join("tests/fixtures/gguf")
        .join(format!("{name}.gguf"))
}

/// On the CPU an embedding table stored in blocks is read in place: each looked-up row is the
/// dense (dequantized) table's row, and an id outside the vocabulary is an error.
#[test]
fn quantized_embedding_rows_are_the_dequantized_tables() {
    use rserve_core::models::layers::embedding::Embedding;
    use rserve_core::weights::Weights;
    use std::sync::Arc;
    for name in MODELS {
        let file = Arc::new(rserve_core::gguf::GgufFile::open(&gguf_path(name)).unwrap());
        let (vocab, hidden) = {
            let (t, _) = file.tensor("token_embd.weight").unwrap();
            (t.shape()[0], t.shape()[1])
        };
        let w = Weights::from_gguf(
            file,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
            None,
        );
        let shape = [vocab, hidden];
        let table = Embedding::load(&w.pp("model"), shape, "embed_tokens.weight").unwrap();
        assert!(table.dense().is_none(), "{name}: the table stays in blocks");
        let dense = w.get(&shape, "model.embed_tokens.weight").unwrap();
        let ids =
            candle_core::Tensor::new(&[0u32, 7, vocab as u32 - 1, 7], &candle_core::Device::Cpu)
                .unwrap();
        let got = table.forward(&ids, None).unwrap();
        let want = dense.index_select(&ids, 0).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
        let bad = candle_core::Tensor::new(&[vocab as u32], &candle_core::Device::Cpu).unwrap();
        let err = table.forward(&bad, None).unwrap_err().to_string();
        assert!(err.contains("outside the vocabulary"), "{name}: {err}");
    }
}

#[test]
fn quantizers_write_llama_cpps_bytes() {
    let p = repo().join("tests/fixtures/quant/ggml_ref.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let cols = v["cols"].as_u64().unwrap() as usize;
    let x: Vec<f32> = v["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_f64().unwrap() as f32)
        .collect();
    for (name, t) in [
        ("q8_0", BlockType::Q8_0),
        ("q4_0", BlockType::Q4_0),
        ("q5_0", BlockType::Q5_0),
        ("q4k", BlockType::Q4K),
        ("q6k", BlockType::Q6K),
    ] {
        let hex = v[name].as_str().unwrap();
        let want: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let got = quantize(t, &x, cols).unwrap();
        assert_eq!(got.len(), want.len(), "{name}: size");
        let bb = t.block_bytes();
        let bad: Vec<usize> = (0..got.len() / bb)
            .filter(|b| got[b * bb..(b + 1) * bb] != want[b * bb..(b + 1) * bb])
            .collect();
        assert!(
            bad.is_empty(),
            "{name}: {} of {} blocks differ from llama.cpp, first block {} (row {})",
            bad.len(),
            got.len() / bb,
            bad[0],
            bad[0] * t.block_values() / cols
        );
    }
}

fn gguf_engine(name: &str) -> EngineHandle {
    let mut cfg = EngineConfig::new(gguf_path(name));
    cfg.dtype = "float32".into();
    cfg.kv_cache = KvBudget::Blocks(128);
    Engine::start(cfg).unwrap()
}

/// Runs every golden case greedily; checks tokens and log-probs: all of them within `tol`
/// (`exact`), or up to the first step whose top-2 margin is under 0.1.
fn check(name: &str, tol: f32, exact: bool) -> f32 {
    let g = golden(&format!("gguf-{name}"));
    assert_eq!(g.model, format!("gguf/{name}.gguf"));
    let h = gguf_engine(name);
    let mut worst = 0f32;
    for c in &g.cases {
        let mut p = SamplingParams::greedy(c.tokens.len());
        p.ignore_eos = true;
        p.logprobs = Some(1);
        let out = h
            .submit(EngineRequest {
                prompt_token_ids: c.prompt.clone(),
                params: p,
                lora: None,
                cache_salt: None,
                mm: None,
            })
            .unwrap()
            .wait()
            .unwrap();
        let o = &out.outputs[0];
        let lps = o.logprobs.as_ref().unwrap();
        for (i, lp) in lps.iter().enumerate().take(c.tokens.len()) {
            if !exact && c.margins[i] < 0.1 {
                break;
            }
            assert_eq!(
                o.token_ids[i],
                c.tokens[i],
                "{name}: prompt of {} tokens, step {i}",
                c.prompt.len()
            );
            let err = (lp.logprob - c.logprobs[i]).abs();
            worst = worst.max(err);
            assert!(
                err < tol,
                "{name}: prompt of {} tokens, step {i}: logprob {} vs {}",
                c.prompt.len(),
                lp.logprob,
                c.logprobs[i]
            );
        }
    }
    assert_sound(&h);
    h.shutdown();
    worst
}

/// One test, two phases: the reference switch is process-wide.
#[test]
fn gguf_models_decode_as_transformers_does() {
    set_reference_products(true);
    for name in MODELS {
        let e = check(name, 1e-3, true);
        println!("{name}: dequantized f32 products, worst logprob error {e:.2e}");
    }
    set_reference_products(false);
    for name in MODELS {
        let e = check(name, 0.15, false);
        println!("{name}: fast kernels, worst logprob error {e:.3}");
    }
}

#[test]
fn the_metadata_tokenizer_and_template_are_the_models() {
    let want = rserve_core::tokenizer::Tokenizer::from_file(
        repo().join("crates/core/assets/tokenizer.json"),
    )
    .unwrap();
    let texts = [
        "",
        "The old man reads the quiet letter in the garden.",
        "Le café est très bon. 中文的文字 and emoji 🙂🚀! Größe, Καλημέρα.",
        "def add(a, b):\n    return a + b\n\n  x = 12345 + 67\n",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces, trailing spaces   \n\n\n tabs\there",
    ];
    for name in MODELS {
        let m = load_model_with(
            &gguf_path(name),
            &LoadOptions::new("float32"),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        for t in texts {
            for special in [true, false] {
                assert_eq!(
                    m.tokenizer.encode(t, special).unwrap(),
                    want.encode(t, special).unwrap(),
                    "{name}: {t:?} (add special {special})"
                );
            }
        }
        assert!(m.chat_template.is_some(), "{name}: chat template");
        assert!(!m.generation.eos_token_ids.is_empty(), "{name}: eos");
        assert_eq!(m.bos_token.as_deref(), Some("<|begin_of_text|>"));
    }
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model` = `llama`, a file of metadata only from
/// `tests/fixtures/make_gguf_spm.py`) tokenizes and decodes as transformers' tokenizer for the
/// same file: byte fallback, the `▁` prefix, merges recovered from the scores, added tokens.
#[test]
fn a_sentencepiece_vocabulary_tokenizes_as_transformers() {
    let g = rserve_core::gguf::GgufFile::open(&gguf_path("spm-vocab")).unwrap();
    let tok = rserve_core::gguf::tokenizer::load(&g).unwrap();
    let p = repo().join("tests/fixtures/goldens/gguf-spm-vocab.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    assert_eq!(tok.vocab_size() as u64, v["vocab_size"].as_u64().unwrap());
    for case in v["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
}

/// `--tokenizer DIR`: the directory's tokenizer and chat template replace the metadata's.
#[test]
fn a_tokenizer_directory_replaces_the_metadata_tokenizer() {
    let mut opts = LoadOptions::new("float32");
    opts.tokenizer = Some(fixture_model("mistral"));
    let m = load_model_with(&gguf_path("qwen2-q8_0"), &opts, &candle_core::Device::Cpu).unwrap();
    let template = m.chat_template.expect("the directory's template");
    assert!(
        template.source().contains("[INST]"),
        "{}",
        template.source()
    );
    assert_eq!(m.tokenizer.vocab_size(), 1000);
}

fn fixture_bytes() -> Vec<u8> {
    std::fs::read(gguf_path("qwen2-q8_0")).unwrap()
}

/// A seeded xorshift generator of the fuzz tests.
fn xorshift(mut s: u64) -> impl FnMut() -> u64 {
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// Where the header ends (the first tensor's data), found by parsing.
fn header_len(bytes: &[u8]) -> usize {
    parse(bytes)
        .unwrap()
        .tensors
        .values()
        .map(|t| t.start)
        .min()
        .unwrap()
}

#[test]
fn truncated_and_mangled_files_are_errors_not_panics() {
    let bytes = fixture_bytes();
    let hl = header_len(&bytes);
    // every cut inside the header, and a few in the data
    for cut in (0..hl)
        .step_by(7)
        .chain([hl + 1, bytes.len() / 2, bytes.len() - 1])
    {
        assert!(parse(&bytes[..cut]).is_err(), "cut at {cut} parsed");
    }
    // a seeded fuzz of the header: flipped bytes, overwritten lengths
    let mut next = xorshift(0x9e3779b97f4a7c15);
    for _ in 0..3000 {
        let mut b = bytes[..hl.min(bytes.len())].to_vec();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % b.len();
            match next() % 3 {
                0 => b[at] ^= 1 << (next() % 8),
                1 => b[at] = 0xff,
                _ => {
                    let end = (at + 8).min(b.len());
                    b[at..end].fill(0xff)
                }
            }
        }
        let _ = parse(&b);
    }
    assert!(matches!(parse(b"GGML\x03\0\0\0"), Err(GgufError::Magic(_))));
    assert!(matches!(
        parse(b"GGUF\x01\0\0\0"),
        Err(GgufError::Version(1))
    ));
}

/// A minimal GGUF: the given metadata strings and one tensor of 256 values (type `ty`).
fn tiny_gguf(meta: &[(&str, &str)], tensor: &str, ty: u32) -> Vec<u8> {
    gguf_with(meta, tensor, &[256], ty, 0)
}

/// A GGUF of the given metadata strings and one tensor directory entry (`dims`, type `ty`,
/// `offset`), followed by 1 KiB of data.
fn gguf_with(meta: &[(&str, &str)], tensor: &str, dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    let s = |b: &mut Vec<u8>, t: &str| {
        b.extend_from_slice(&(t.len() as u64).to_le_bytes());
        b.extend_from_slice(t.as_bytes());
    };
    for (k, v) in meta {
        s(&mut b, k);
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, v);
    }
    s(&mut b, tensor);
    b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend_from_slice(&[0u8; 1024]);
    b
}

fn load_error(bytes: &[u8], tag: &str) -> String {
    let p = std::env::temp_dir().join(format!("rserve-gguf-{tag}-{}.gguf", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    let r = load_model_with(&p, &LoadOptions::new("float32"), &candle_core::Device::Cpu);
    std::fs::remove_file(&p).ok();
    match r {
        Ok(_) => panic!("{tag}: loaded"),
        Err(e) => {
            assert!(matches!(e, LoadError::Gguf { .. }), "{tag}: {e:?}");
            e.to_string()
        }
    }
}

#[test]
fn unsupported_architectures_types_and_truncated_tensors_are_named() {
    let e = load_error(
        &tiny_gguf(&[("general.architecture", "gpt2")], "token_embd.weight", 0),
        "arch",
    );
    assert!(e.contains("`gpt2`") && e.contains("qwen2"), "{e}");
    let e = load_error(
        &tiny_gguf(
            &[("general.architecture", "llama")],
            "blk.0.attn_q.weight",
            16,
        ),
        "type",
    );
    assert!(e.contains("blk.0.attn_q.weight") && e.contains("iq"), "{e}");
    let bytes = fixture_bytes();
    let e = load_error(&bytes[..bytes.len() - 100], "trunc");
    assert!(e.contains("truncated") || e.contains("ends inside"), "{e}");
    let e = load_error(&[0u8; 64], "zeros");
    assert!(e.contains("GGUF"), "{e}");
}

/// Tensor directory entries whose sizes overflow a `usize` (a shape of 2^62 f32 values, q8_0
/// blocks whose bytes pass 2^64) or whose offsets are huge are malformed files, not panics or
/// wrapped sizes; a seeded fuzz of the entry's fields (dimension count, dimensions, type,
/// offset) parses or fails cleanly.
#[test]
fn tensor_directories_with_huge_sizes_are_errors_not_panics() {
    let meta = [("general.architecture", "llama")];
    for (dims, ty) in [
        (vec![1u64 << 62], 0u32),
        (vec![32 << 58], 8), // 2^58 q8_0 blocks of 34 bytes: past 2^64
        (vec![1 << 32, 1 << 32], 0),
        (vec![256, 1 << 60], 12),
        (vec![u64::MAX], 0),
    ] {
        let b = gguf_with(&meta, "t", &dims, ty, 0);
        assert!(
            matches!(
                parse(&b),
                Err(GgufError::Malformed(_) | GgufError::Truncated(_))
            ),
            "{dims:?} type {ty}: {:?}",
            parse(&b).map(|f| f.tensors.len())
        );
    }
    for offset in [1u64 << 63, u64::MAX - 31, 31] {
        assert!(parse(&gguf_with(&meta, "t", &[256], 0, offset)).is_err());
    }
    let edges = [
        0u64,
        1,
        31,
        32,
        256,
        1 << 31,
        1 << 32,
        1 << 59,
        1 << 62,
        u64::MAX,
    ];
    let mut next = xorshift(0x2545f4914f6cdd1d);
    for _ in 0..4000 {
        let n = (next() % 5) as usize;
        let dims: Vec<u64> = (0..n)
            .map(|_| edges[(next() % edges.len() as u64) as usize])
            .collect();
        let ty = (next() % 40) as u32;
        let offset = edges[(next() % edges.len() as u64) as usize];
        let b = gguf_with(&meta, "t", &dims, ty, offset);
        if let Ok(f) = parse(&b) {
            // whatever parsed lies inside the file
            for t in f.tensors.values() {
                assert!(t.start + t.len <= b.len(), "{dims:?} {ty} {offset}");
            }
        }
    }
}
