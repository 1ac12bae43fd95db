//! The requests `rserve bench serve` sends, per `--dataset-name`, named as `vllm bench serve`
//! names its datasets: `random` (random token ids of a fixed length), `prefix_repetition` (a few
//! long random prefixes, each followed by a random suffix of its own, in shuffled order) and
//! `random-mm` (chat messages of random images, sized by `--random-mm-bucket-config`, and
//! `--random-input-len` random words, sent to `/chat/completions`).

use crate::cli::BenchServeArgs;
use anyhow::{bail, Context, Result};
use base64::Engine as _;
use rayon::prelude::*;
use rserve_core::multimodal::{encode_png, test_pattern};
use rserve_core::sampler::SeqRng;
use serde_json::{json, Value};

/// One request's prompt.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Prompt {
    /// Token ids, sent to `/completions`.
    Ids(Vec<u32>),
    /// One user message of images (data URIs) and then text, sent to `/chat/completions`.
    Chat { images: Vec<String>, text: String },
}

impl Prompt {
    /// The request body's prompt field: `prompt` or `messages`.
    pub(crate) fn insert_into(&self, body: &mut Value) {
        match self {
            Self::Ids(ids) => body["prompt"] = json!(ids),
            Self::Chat { images, text } => {
                let mut parts: Vec<Value> = images
                    .iter()
                    .map(|u| json!({"type": "image_url", "image_url": {"url": u}}))
                    .collect();
                parts.push(json!({"type": "text", "text": text}));
                body["messages"] = json!([{"role": "user", "content": parts}]);
            }
        }
    }
}

/// A benchmark's requests.
#[derive(Debug)]
pub(crate) struct Dataset {
    pub prompts: Vec<Prompt>,
    /// Prompt tokens per request as the dataset sets them (words and images are counted by the
    /// server: the report takes its `usage`).
    pub input_len: usize,
    pub output_len: usize,
    /// Sent to `/chat/completions` rather than `/completions`.
    pub chat: bool,
}

/// Common short English words, most of them one token in any BPE vocabulary.
const WORDS: [&str; 48] = [
    "the", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with", "as",
    "his", "they", "be", "at", "one", "have", "this", "from", "by", "hot", "word", "but", "what",
    "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your",
    "how", "said", "an", "each", "she", "which", "do", "their", "time",
];

/// Largest image side `random-mm` makes (16 Mpx images at most).
const MAX_SIDE: usize = 4096;

/// `--random-mm-bucket-config` as vLLM writes it, `{(height, width, frames): probability, ...}`:
/// the image sizes and their weights (normalized). Only images (one frame) are supported.
pub(crate) fn parse_buckets(spec: &str) -> Result<Vec<(usize, usize, f64)>> {
    let inner = spec
        .trim()
        .strip_prefix('{')
        .and_then(|s| s.strip_suffix('}'))
        .context(
            "--random-mm-bucket-config: expected {(height, width, frames): probability, ...}",
        )?;
    let mut out = Vec::new();
    let mut rest = inner.trim();
    while !rest.is_empty() {
        let open = rest
            .strip_prefix('(')
            .context("--random-mm-bucket-config: each key is a (height, width, frames) tuple")?;
        let (tuple, after) = open
            .split_once(')')
            .context("--random-mm-bucket-config: unclosed tuple")?;
        let dims: Vec<usize> = tuple
            .split(',')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .context("--random-mm-bucket-config: sizes are whole numbers")?;
        let [h, w, frames] = dims[..] else {
            bail!("--random-mm-bucket-config: each key is a (height, width, frames) tuple");
        };
        if frames != 1 {
            bail!("--random-mm-bucket-config: only images (1 frame) are supported, got {frames}");
        }
        if h == 0 || w == 0 || h > MAX_SIDE || w > MAX_SIDE {
            bail!("--random-mm-bucket-config: image sides must be 1 to {MAX_SIDE} pixels");
        }
        let after = after
            .trim_start()
            .strip_prefix(':')
            .context("--random-mm-bucket-config: expected `: probability` after a size")?;
        let (p, tail) = after.split_once(',').unwrap_or((after, ""));
        let p: f64 = p
            .trim()
            .parse()
            .context("--random-mm-bucket-config: probabilities are numbers")?;
        if !(p.is_finite() && p >= 0.0) {
            bail!("--random-mm-bucket-config: probabilities must be finite and not negative");
        }
        if p > 0.0 {
            out.push((h, w, p));
        }
        rest = tail.trim();
    }
    let total: f64 = out.iter().map(|b| b.2).sum();
    if out.is_empty() || total <= 0.0 {
        bail!("--random-mm-bucket-config: at least one size with a positive probability");
    }
    Ok(out.into_iter().map(|(h, w, p)| (h, w, p / total)).collect())
}

/// The requests of `args`, drawn from `rng` (images from their own seeds, built in parallel).
pub(crate) fn build(args: &BenchServeArgs, rng: &mut SeqRng) -> Result<Dataset> {
    let counts = match args.dataset_name.as_str() {
        "prefix_repetition" => [
            args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len,
            args.prefix_repetition_output_len,
            args.prefix_repetition_num_prefixes,
        ],
        _ => [args.random_input_len, args.random_output_len, 1],
    };
    if args.num_prompts == 0 || counts.contains(&0) {
        bail!("--num-prompts, the lengths and the prefix count must be positive");
    }
    let span = args.token_id_max.saturating_sub(args.token_id_min).max(1);
    let random = |rng: &mut SeqRng, len: usize| -> Vec<u32> {
        (0..len)
            .map(|_| args.token_id_min + (rng.next_u64() % u64::from(span)) as u32)
            .collect()
    };
    match args.dataset_name.as_str() {
        "prefix_repetition" => {
            let k = args.prefix_repetition_num_prefixes;
            let prefixes: Vec<Vec<u32>> = (0..k)
                .map(|_| random(rng, args.prefix_repetition_prefix_len))
                .collect();
            let mut prompts: Vec<Vec<u32>> = (0..args.num_prompts)
                .map(|i| {
                    let mut p = prefixes[i % k].clone();
                    p.extend(random(rng, args.prefix_repetition_suffix_len));
                    p
                })
                .collect();
            for i in (1..prompts.len()).rev() {
                let j = (rng.next_u64() % (i as u64 + 1)) as usize;
                prompts.swap(i, j);
            }
            Ok(Dataset {
                prompts: prompts.into_iter().map(Prompt::Ids).collect(),
                input_len: args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len,
                output_len: args.prefix_repetition_output_len,
                chat: false,
            })
        }
        "random-mm" => {
            let buckets = parse_buckets(&args.random_mm_bucket_config)?;
            let items = args.random_mm_base_items_per_request;
            // (request, size) of every image, then the images themselves over the threads
            let images = args
                .num_prompts
                .checked_mul(items)
                .filter(|&n| n <= 1 << 20)
                .context("random-mm: at most 2^20 images in all")?;
            let mut sizes = Vec::with_capacity(images);
            let mut texts = Vec::with_capacity(args.num_prompts);
            for _ in 0..args.num_prompts {
                for _ in 0..items {
                    let mut u = rng.next_f64();
                    let pick = buckets
                        .iter()
                        .find(|b| {
                            u -= b.2;
                            u < 0.0
                        })
                        .or(buckets.last());
                    sizes.extend(pick.map(|b| (b.0, b.1)));
                }
                let words: Vec<&str> = (0..args.random_input_len)
                    .map(|_| WORDS[(rng.next_u64() % WORDS.len() as u64) as usize])
                    .collect();
                texts.push(words.join(" "));
            }
            let seed = args.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let uris: Vec<String> = sizes
                .par_iter()
                .enumerate()
                .map(|(i, &(h, w))| -> Result<String> {
                    let png = encode_png(&test_pattern(w, h, seed ^ i as u64))?;
                    Ok(format!(
                        "data:image/png;base64,{}",
                        base64::engine::general_purpose::STANDARD.encode(png)
                    ))
                })
                .collect::<Result<_>>()?;
            let mut uris = uris.into_iter();
            let prompts = texts
                .into_iter()
                .map(|text| Prompt::Chat {
                    images: uris.by_ref().take(items).collect(),
                    text,
                })
                .collect();
            Ok(Dataset {
                prompts,
                input_len: args.random_input_len,
                output_len: args.random_output_len,
                chat: true,
            })
        }
        _ => Ok(Dataset {
            prompts: (0..args.num_prompts)
                .map(|_| Prompt::Ids(random(rng, args.random_input_len)))
                .collect(),
            input_len: args.random_input_len,
            output_len: args.random_output_len,
            chat: false,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchServeArgs,
    }

    fn args(extra: &[&str]) -> BenchServeArgs {
        let mut argv = vec!["bench", "--model", "m"];
        argv.extend_from_slice(extra);
        Cli::parse_from(argv).args
    }

    #[test]
    fn buckets_parse_as_vllm_writes_them() {
        let b = parse_buckets("{(256, 256, 1): 0.5, (720, 1280, 1): 1.5}").unwrap();
        assert_eq!(b, vec![(256, 256, 0.25), (720, 1280, 0.75)]);
        assert_eq!(
            parse_buckets(" {(28,56,1):1} ").unwrap(),
            vec![(28, 56, 1.0)]
        );
        // a size that can never be drawn is left out
        let b = parse_buckets("{(28, 28, 1): 0, (56, 56, 1): 2}").unwrap();
        assert_eq!(b, vec![(56, 56, 1.0)]);
        for bad in [
            "",
            "{}",
            "{(256, 256): 1}",
            "{(256, 256, 4): 1}",
            "{(0, 256, 1): 1}",
            "{(256, 256, 1): -1}",
            "{(256, 256, 1): 0}",
            "{(8192, 256, 1): 1}",
            "{(256, 256, 1) 1}",
            "(256, 256, 1): 1",
        ] {
            assert!(parse_buckets(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn random_mm_requests_carry_their_images_and_words() {
        let a = args(&[
            "--dataset-name",
            "random-mm",
            "--num-prompts",
            "3",
            "--random-input-len",
            "5",
            "--random-mm-base-items-per-request",
            "2",
            "--random-mm-bucket-config",
            "{(28, 56, 1): 1.0}",
        ]);
        let d = build(&a, &mut SeqRng::new(0)).unwrap();
        assert!(d.chat);
        assert_eq!(d.prompts.len(), 3);
        let mut seen = std::collections::HashSet::new();
        for p in &d.prompts {
            let Prompt::Chat { images, text } = p else {
                panic!("a chat prompt expected");
            };
            assert_eq!(text.split(' ').count(), 5);
            assert_eq!(images.len(), 2);
            for u in images {
                let b64 = u.strip_prefix("data:image/png;base64,").unwrap();
                let png = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .unwrap();
                let img = rserve_core::multimodal::decode(&png, 1 << 20).unwrap();
                assert_eq!((img.width, img.height), (56, 28));
                assert!(seen.insert(u.clone()), "every image differs");
            }
        }
        let mut body = json!({});
        d.prompts[0].insert_into(&mut body);
        let parts = body["messages"][0]["content"].as_array().unwrap();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0]["type"], "image_url");
        assert_eq!(parts[2]["type"], "text");
        // the same seed gives the same requests
        assert_eq!(build(&a, &mut SeqRng::new(0)).unwrap().prompts, d.prompts);
    }

    #[test]
    fn token_datasets_keep_their_shapes() {
        let d = build(
            &args(&["--num-prompts", "4", "--random-input-len", "7"]),
            &mut SeqRng::new(1),
        )
        .unwrap();
        assert!(!d.chat);
        assert!(d
            .prompts
            .iter()
            .all(|p| matches!(p, Prompt::Ids(ids) if ids.len() == 7)));
        let d = build(
            &args(&[
                "--dataset-name",
                "prefix_repetition",
                "--num-prompts",
                "6",
                "--prefix-repetition-prefix-len",
                "5",
                "--prefix-repetition-suffix-len",
                "3",
                "--prefix-repetition-num-prefixes",
                "2",
            ]),
            &mut SeqRng::new(1),
        )
        .unwrap();
        let prefixes: std::collections::HashSet<Vec<u32>> = d
            .prompts
            .iter()
            .map(|p| match p {
                Prompt::Ids(ids) => {
                    assert_eq!(ids.len(), 8);
                    ids[..5].to_vec()
                }
                Prompt::Chat { .. } => panic!("token ids expected"),
            })
            .collect();
        assert_eq!(prefixes.len(), 2);
        assert_eq!(d.input_len, 8);
    }
}
