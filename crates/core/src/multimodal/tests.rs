//! The preprocessing against the Hugging Face processors' goldens
//! (`tests/fixtures/make_vision_goldens.py`): the processors' RGB conversion byte for byte (PNG in
//! every mode, an animated GIF's first frame, a lossless WebP; a JPEG within 2 levels, its inverse
//! DCT rounding as the decoder's), and the Qwen2-VL and CLIP pixel values within 1e-5.

use super::clip::ClipConfig;
use super::qwen2_vl::Qwen2VlConfig;
use super::*;
use serde_json::Value;
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vision")
}

fn index() -> Value {
    let text = std::fs::read_to_string(dir().join("goldens.json")).expect("goldens.json");
    serde_json::from_str(&text).expect("json")
}

fn f32s(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir().join(name)).expect("golden");
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-5, "{what}: max difference {worst}");
}

/// Each golden image as rserve decodes it from its file, with whether that must equal Pillow's
/// decode byte for byte (a JPEG's may differ by the inverse DCT's rounding).
fn decoded() -> Vec<(String, RgbImage, bool)> {
    let idx = index();
    idx["images"]
        .as_array()
        .expect("images")
        .iter()
        .map(|e| {
            let name = e["name"].as_str().expect("name").to_string();
            let file = e["file"]
                .as_str()
                .map_or(format!("{name}.png"), str::to_string);
            let bytes = std::fs::read(dir().join(&file)).expect("image file");
            let img = decode(&bytes, DEFAULT_MAX_IMAGE_PIXELS).expect("decodes");
            (name, img, e["exact"].as_bool().unwrap_or(true))
        })
        .collect()
}

/// The images the processors' goldens start from: rserve's decode where that is exact, else
/// Pillow's (`{name}.rgb`), so the preprocessing is checked on the same pixels.
fn images() -> Vec<(String, RgbImage)> {
    decoded()
        .into_iter()
        .map(|(name, img, exact)| {
            if exact {
                return (name, img);
            }
            let rgb = std::fs::read(dir().join(format!("{name}.rgb"))).expect("rgb");
            let pillow = RgbImage::new(img.width, img.height, rgb).expect("Pillow's pixels");
            (name, pillow)
        })
        .collect()
}

#[test]
fn decoding_matches_the_processors_rgb_conversion() {
    for (name, img, exact) in decoded() {
        let want = std::fs::read(dir().join(format!("{name}.rgb"))).expect("rgb");
        if exact {
            assert_eq!(img.data, want, "{name}");
            continue;
        }
        assert_eq!(img.data.len(), want.len(), "{name}");
        let worst = img
            .data
            .iter()
            .zip(&want)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap_or(0);
        assert!(
            worst <= 2,
            "{name}: a channel differs from Pillow's by {worst}"
        );
    }
}

#[test]
fn qwen2_vl_pixels_match_the_processor() {
    let idx = index();
    let cfg: Qwen2VlConfig = serde_json::from_value(idx["qwen2_vl"].clone()).expect("config");
    for ((name, img), e) in images()
        .iter()
        .zip(idx["images"].as_array().expect("images"))
    {
        let got = cfg.preprocess(img).expect("preprocess");
        let grid: Vec<usize> = e["qwen2_vl_grid_thw"]
            .as_array()
            .expect("grid")
            .iter()
            .map(|v| v.as_u64().expect("int") as usize)
            .collect();
        assert_eq!(got.grid_thw.to_vec(), grid, "{name}");
        close(
            &got.pixel_values,
            &f32s(&format!("{name}.qwen2_vl.f32")),
            name,
        );
    }
}

#[test]
fn clip_pixels_match_the_processor() {
    let idx = index();
    let cfg = ClipConfig {
        shortest_edge: idx["clip"]["shortest_edge"].as_u64().expect("edge") as usize,
        crop_size: idx["clip"]["crop_size"].as_u64().expect("crop") as usize,
        ..ClipConfig::default()
    };
    for (name, img) in images() {
        let got = cfg.preprocess(&img).expect("preprocess");
        close(&got, &f32s(&format!("{name}.clip.f32")), &name);
    }
}

/// A 1-pixel-wide image resizes (before its crop) to 336 x ~22M pixels: only the crop is
/// computed, so it takes the memory of a square image, and its columns are the flat colour.
#[test]
fn a_thin_image_is_cropped_without_resizing_it_whole() {
    let cfg = ClipConfig::default();
    for (w, h) in [(1, 65_536), (65_536, 1), (3, 40_000)] {
        let img = RgbImage::new(w, h, vec![200u8; w * h * 3]).expect("image");
        let (rh, rw) = cfg.resized_size(h, w);
        assert!(rh.max(rw) > 1_000_000 || w == 3, "{rw}x{rh}");
        let got = cfg.preprocess(&img).expect("preprocess");
        assert_eq!(got.len(), 3 * 336 * 336);
        let first = got[0];
        assert!(got[..336 * 336].iter().all(|&v| v == first), "{w}x{h}");
    }
}

#[test]
fn smart_resize_keeps_the_bounds() {
    let cfg = Qwen2VlConfig::default();
    for (h, w) in [
        (1, 1),
        (28, 28),
        (1080, 1920),
        (4000, 3000),
        (100, 5000),
        (57, 83),
    ] {
        let (rh, rw) = cfg.smart_resize(h, w).expect("fits");
        assert_eq!((rh % 28, rw % 28), (0, 0), "{h}x{w}");
        assert!(
            rh * rw <= 28 * 28 * 1280 && rh * rw >= 56 * 56,
            "{h}x{w} -> {rh}x{rw}"
        );
    }
    assert!(cfg.smart_resize(1, 300).is_err(), "aspect ratio above 200");
}

#[test]
fn bad_images_are_refused_with_the_reason() {
    assert_eq!(
        decode(b"not an image", 1 << 20),
        Err(ImageError::UnknownFormat)
    );
    let png = std::fs::read(dir().join("rgb_160x120.png")).expect("png");
    assert!(matches!(
        decode(&png, 160 * 120 - 1),
        Err(ImageError::TooLarge {
            width: 160,
            height: 120,
            ..
        })
    ));
    assert!(matches!(
        decode(&png[..png.len() / 2], 1 << 20),
        Err(ImageError::Decode(_))
    ));
    // every truncation and a few corruptions fail cleanly
    for cut in (0..png.len()).step_by(997) {
        let _ = decode(&png[..cut], 1 << 20);
    }
    let mut bad = png.clone();
    for i in (40..bad.len()).step_by(53) {
        bad[i] ^= 0x5a;
    }
    let _ = decode(&bad, 1 << 20);
}

#[test]
fn equal_pixels_hash_alike() {
    let a = RgbImage::new(2, 1, vec![1, 2, 3, 4, 5, 6]).expect("image");
    let b = RgbImage::new(1, 2, vec![1, 2, 3, 4, 5, 6]).expect("image");
    assert_eq!(a.content_hash(), a.clone().content_hash());
    assert_ne!(
        a.content_hash(),
        b.content_hash(),
        "the size is part of the hash"
    );
}

/// The image decoders and both processors on mutated PNG, JPEG, GIF and WebP files: every input
/// either gives an image or a typed error, never a panic.
#[test]
fn mutated_images_fail_cleanly() {
    let src = images().into_iter().next().expect("an image").1;
    let buf = image::RgbImage::from_raw(src.width as u32, src.height as u32, src.data.clone())
        .expect("buffer");
    let mut files = Vec::new();
    for fmt in [
        image::ImageFormat::Png,
        image::ImageFormat::Jpeg,
        image::ImageFormat::Gif,
        image::ImageFormat::WebP,
    ] {
        let mut out = std::io::Cursor::new(Vec::new());
        image::DynamicImage::ImageRgb8(buf.clone())
            .write_to(&mut out, fmt)
            .expect("encodes");
        files.push(out.into_inner());
    }
    let procs = default_processors();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut ok, mut refused) = (0, 0);
    for file in &files {
        for p in &procs {
            assert!(p.decode(file).is_ok(), "the unmutated file decodes");
        }
        for _ in 0..150 {
            let mut f = file.clone();
            match next() % 4 {
                0 => f.truncate((next() as usize) % f.len()),
                1 => {
                    for _ in 0..1 + next() % 8 {
                        let i = (next() as usize) % f.len();
                        f[i] = next() as u8;
                    }
                }
                2 => {
                    // the size fields of the headers live in the first bytes
                    let i = (next() as usize) % f.len().min(32);
                    f[i] = 0xff;
                }
                _ => {
                    let i = (next() as usize) % f.len();
                    let junk: Vec<u8> = (0..next() % 64).map(|_| next() as u8).collect();
                    f.splice(i..i, junk);
                }
            }
            for p in &procs {
                match p.decode(&f) {
                    Ok(img) => {
                        assert_eq!(img.pixels.len(), img.shape[0] * img.shape[1]);
                        ok += 1;
                    }
                    Err(_) => refused += 1,
                }
            }
        }
    }
    assert!(
        refused > 0 && ok + refused == 4 * 150 * 2,
        "{ok} decoded, {refused} refused"
    );
}

/// The patch layout composed step by step: the channel-first normalized image, then each patch's
/// rows copied out (what the fused preprocessing must equal, bit for bit).
fn composed_patches(cfg: &Qwen2VlConfig, img: &RgbImage) -> Vec<f32> {
    let (rh, rw) = cfg.smart_resize(img.height, img.width).expect("fits");
    let resized = img.resized(rw, rh, super::resample::Filter::Bicubic);
    let chw = normalize_chw(&resized, cfg.image_mean, cfg.image_std);
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let plane = rh * rw;
    let mut out = Vec::new();
    for bh in 0..rh / p / m {
        for bw in 0..rw / p / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (py0, px0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        for _ in 0..t {
                            for y in 0..p {
                                out.extend_from_slice(
                                    &chw[c * plane + (py0 + y) * rw + px0..][..p],
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

#[test]
fn the_fused_patch_layout_equals_the_composed_one() {
    let cfg = Qwen2VlConfig {
        max_pixels: 12_845_056,
        ..Qwen2VlConfig::default()
    };
    // 300x200 stays on one thread; 700x600 (over 2^18 pixels) spreads its bands over threads
    for (w, h) in [(300, 200), (700, 600)] {
        let img = test_pattern(w, h, 7);
        let got = cfg.preprocess(&img).expect("preprocess");
        let want = composed_patches(&cfg, &img);
        assert_eq!(got.pixel_values.len(), want.len(), "{w}x{h}");
        assert!(
            got.pixel_values
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{w}x{h}"
        );
    }
}

#[test]
fn the_normalizer_table_is_the_arithmetic() {
    let (mean, std) = (super::qwen2_vl::CLIP_MEAN, super::qwen2_vl::CLIP_STD);
    let norm = Normalizer::new(mean, std);
    for c in 0..3 {
        for v in 0..=255u8 {
            let x = (f64::from(v) * (1.0 / 255.0)) as f32;
            assert_eq!(
                norm.value(c, v).to_bits(),
                ((x - mean[c]) / std[c]).to_bits()
            );
        }
    }
}

/// Qwen2-VL's and CLIP's processors with their default configurations.
fn default_processors() -> [Processor; 2] {
    let with = |kind| Processor {
        kind,
        image_token_id: 0,
        max_image_pixels: 1 << 22,
    };
    [
        with(ImageProcessor::Qwen2Vl(Qwen2VlConfig::default())),
        with(ImageProcessor::Clip {
            config: ClipConfig::default(),
            patch_size: 14,
            keep_cls: false,
        }),
    ]
}

#[test]
fn the_largest_image_and_the_profile_batch() {
    let [qwen, clip] = default_processors();
    // 28 x 28 x 1280 pixels at most: 1280 merged patches; a 2000 x 3000 image resizes to no more
    assert_eq!(qwen.max_image_tokens(), 1280);
    let big = qwen.image(&RgbImage::new(3000, 2000, vec![9; 3000 * 2000 * 3]).expect("image"));
    assert!(big.expect("preprocesses").num_tokens <= 1280);
    let batch = qwen.profile_images(1000);
    assert_eq!(batch.len(), 1);
    // a 31 x 32 grid of merged patches: 992 tokens, 3,968 patch rows of 3 x 2 x 14 x 14
    assert_eq!(batch[0].grid_thw, [1, 62, 64]);
    assert_eq!((batch[0].num_tokens, batch[0].shape), (992, [3968, 1176]));
    assert_eq!(batch[0].pixels.len(), 3968 * 1176);
    // past the largest image: images of at most 1280 tokens (35 x 36, twice, then 20 x 22)
    let tokens: Vec<usize> = qwen
        .profile_images(3000)
        .iter()
        .map(|i| i.num_tokens)
        .collect();
    assert_eq!(tokens, [1260, 1260, 440]);
    assert_eq!(clip.max_image_tokens(), 576);
    let crops = clip.profile_images(2000);
    assert_eq!(crops.len(), 3);
    assert!(crops
        .iter()
        .all(|c| c.num_tokens == 576 && c.shape == [3, 336 * 336]));
    assert_eq!(clip.profile_images(10).len(), 1);
}

#[test]
fn images_preprocess_on_media_threads_and_their_parallel_work_stays_there() {
    use rayon::prelude::*;
    let media = |name: Option<&str>| name.is_some_and(|n| n.starts_with("rserve-media-"));
    assert!(on_media_threads(|| media(std::thread::current().name())));
    // a resize's rows spread over the media pool, never over rayon's global pool
    assert!(on_media_threads(|| {
        (0..256)
            .into_par_iter()
            .all(|_| media(std::thread::current().name()))
    }));
    // the caller's own thread is left as it was
    assert!(!media(std::thread::current().name()));
}
