//! Qwen3-VL against transformers on the committed tiny model (tests/fixtures/vision, written
//! by generate.py): the image preprocessing (every patch value of three images of different
//! sizes, resized down and up, equal to the Qwen2-VL processor's PIL backend), the vision
//! tower (merged embeddings and DeepStack features within 1e-4 of their scale, f32), and the
//! language model over prompts with no, one and two images, with and without a LoRA adapter.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mole_api::ImageProcessor;
use mole_engine::lora::{self, LoadOptions};
use mole_model::vision::preprocess::{
    preprocess, resize_bicubic, resize_bicubic_torch, ProcessorConfig,
};
use mole_model::vision::{mrope_positions, ImageEmbeds, VisionConfig, VisionTower};
use mole_model::{argmax, Decoder, LoraAdapter, Row, RowVision, SeqCache};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("reference.json")).unwrap())
        .unwrap()
}

/// The fixture's processor settings with the PIL backend, which generate.py's references
/// (preprocessed.safetensors, the tower's and the language model's) were computed with.
fn processor() -> ProcessorConfig {
    let mut cfg: ProcessorConfig = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3_vl/preprocessor_config.json")).unwrap(),
    )
    .unwrap();
    cfg.backend = ImageProcessor::Pil;
    cfg
}

/// The fixture image `name`, decoded.
fn image(name: &str) -> image::RgbImage {
    image::open(fixtures().join(format!("images/{name}.png")))
        .unwrap()
        .to_rgb8()
}

fn load(file: &str) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(fixtures().join(file), &Device::Cpu).unwrap()
}

/// The largest difference over the largest magnitude of `want` (on the host).
fn rel_error(ours: &Tensor, want: &Tensor) -> f32 {
    let ours = ours.to_device(&Device::Cpu).unwrap();
    let d = (&ours - want).unwrap().abs().unwrap().max_all().unwrap();
    let s = want.abs().unwrap().max_all().unwrap();
    d.to_scalar::<f32>().unwrap() / s.to_scalar::<f32>().unwrap()
}

#[test]
fn preprocessing_equals_transformers_for_every_patch() {
    let cfg = processor();
    let want = load("preprocessed.safetensors");
    let r = reference();
    for name in ["square", "wide", "large"] {
        let img = image(name);
        let (w, h) = img.dimensions();
        let got = preprocess(&cfg, img.as_raw(), w as usize, h as usize).unwrap();
        let grid: Vec<usize> = serde_json::from_value(r["grids"][name].clone()).unwrap();
        assert_eq!(got.grid.to_vec(), grid, "{name}: grid");
        let want: Vec<f32> = want[name].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(got.values.len(), want.len(), "{name}: values");
        let worst = got
            .values
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert_eq!(
            worst, 0.0,
            "{name}: every value as transformers computes it"
        );
    }
}

/// The resize cases of tests/fixtures/vision/make_resize.py: name, input, and the size.
fn resize_cases() -> Vec<(String, image::RgbImage, (usize, usize))> {
    let dir = fixtures().join("resize");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    cases["cases"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, size)| {
            let input = image::open(dir.join(format!("{name}.in.png")))
                .unwrap()
                .to_rgb8();
            let size = (
                size[0].as_u64().unwrap() as usize,
                size[1].as_u64().unwrap() as usize,
            );
            (name.clone(), input, size)
        })
        .collect()
}

/// Each resize case by `resize` against the bytes of `backend` (`pil` or `torchvision`).
fn resize_equals(backend: &str, resize: fn(&[u8], usize, usize, usize, usize) -> Vec<u8>) {
    let mut wrong = Vec::new();
    for (name, input, (nw, nh)) in resize_cases() {
        let want = image::open(fixtures().join(format!("resize/{name}.{backend}.png")))
            .unwrap()
            .to_rgb8();
        assert_eq!(want.dimensions(), (nw as u32, nh as u32), "{name}");
        let (w, h) = input.dimensions();
        let got = resize(input.as_raw(), w as usize, h as usize, nw, nh);
        let differ = got
            .iter()
            .zip(want.as_raw())
            .filter(|(a, b)| a != b)
            .count();
        if differ > 0 {
            wrong.push(format!(
                "{name} ({w}×{h} → {nw}×{nh}): {differ} bytes differ"
            ));
        }
    }
    assert!(wrong.is_empty(), "not {backend}'s bytes: {wrong:#?}");
}

/// Pillow's bicubic resize, byte for byte, whichever order Pillow runs its two passes in:
/// each axis growing and shrinking, and the boundary where Pillow switches to the vertical
/// pass first.
#[test]
fn resize_equals_pillow_in_both_pass_orders() {
    resize_equals("pil", resize_bicubic);
}

/// torchvision's antialiased bicubic resize of 8-bit images (transformers' fast processor),
/// byte for byte, on the same cases.
#[test]
fn resize_equals_torchvision() {
    resize_equals("torchvision", resize_bicubic_torch);
}

/// Every patch value of the torchvision backend (transformers 5's `Qwen2VLImageProcessor`),
/// its fused rescale-and-normalize included: with Qwen3-VL's mean and deviation, and with
/// Qwen2-VL's CLIP ones.
#[test]
fn torchvision_preprocessing_equals_transformers_for_every_patch() {
    let want = load("preprocessed_torchvision.safetensors");
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("resize/cases.json")).unwrap(),
    )
    .unwrap();
    let p = &manifest["processor"];
    let mut clip = processor();
    clip.image_mean = serde_json::from_value(p["clip"]["image_mean"].clone()).unwrap();
    clip.image_std = serde_json::from_value(p["clip"]["image_std"].clone()).unwrap();
    for (key, img, mut cfg) in [
        ("square", image("square"), processor()),
        ("wide", image("wide"), processor()),
        (
            "clip_grow_w_shrink_h",
            image::open(fixtures().join("resize/grow_w_shrink_h.in.png"))
                .unwrap()
                .to_rgb8(),
            clip,
        ),
    ] {
        cfg.backend = ImageProcessor::Torchvision;
        let (w, h) = img.dimensions();
        let got = preprocess(&cfg, img.as_raw(), w as usize, h as usize).unwrap();
        let grid: Vec<usize> = serde_json::from_value(p["grids"][key].clone()).unwrap();
        assert_eq!(got.grid.to_vec(), grid, "{key}: grid");
        let want: Vec<f32> = want[key].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(got.values.len(), want.len(), "{key}: values");
        let differ = got.values.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 0, "{key}: every value as transformers computes it");
    }
}

#[test]
fn the_vision_tower_equals_transformers() {
    let dir = fixtures().join("qwen3_vl");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vcfg: VisionConfig = serde_json::from_value(config["vision_config"].clone()).unwrap();
    let dev = common::test_device();
    // SAFETY: the fixture is a read-only input for the life of the test.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &dev)
            .unwrap()
    };
    let tower = VisionTower::new(&vcfg, vb.pp("model.visual")).unwrap();
    let img = image("square");
    let (w, h) = img.dimensions();
    let p = preprocess(&processor(), img.as_raw(), w as usize, h as usize).unwrap();
    let n = p.values.len() / processor().patch_len();
    let pixels = Tensor::from_vec(p.values, (n, processor().patch_len()), &dev).unwrap();
    let out = tower.forward(&pixels, &[p.grid], None).unwrap();
    let want = load("vision.safetensors");
    let err = rel_error(&out.merged, &want["merged"]);
    eprintln!("merged embeddings: relative error {err:.2e}");
    assert!(err <= 1e-4, "merged: {err}");
    assert_eq!(out.deepstack.len(), 2);
    for (i, d) in out.deepstack.iter().enumerate() {
        let err = rel_error(d, &want[&format!("deepstack.{i}")]);
        eprintln!("deepstack {i}: relative error {err:.2e}");
        assert!(err <= 1e-4, "deepstack {i}: {err}");
    }
}

/// A prompt of the fixture, ready for the decoder: its ids, its images' embeddings, its M-RoPE
/// positions and offset, and its placeholders.
struct Prompt {
    ids: Vec<u32>,
    embeds: Option<ImageEmbeds>,
    positions: Vec<[u32; 3]>,
    offset: i64,
    image_tokens: Vec<(u32, u32)>,
}

fn prompt(model: &Decoder, name: &str) -> Prompt {
    let r = reference();
    let p = &r["prompts"][name];
    let ids: Vec<u32> = serde_json::from_value(p["ids"].clone()).unwrap();
    let images: Vec<String> = serde_json::from_value(p["images"].clone()).unwrap();
    let cfg = processor();
    let (mut values, mut grids) = (Vec::new(), Vec::new());
    for name in &images {
        let img = image(name);
        let (w, h) = img.dimensions();
        let patches = preprocess(&cfg, img.as_raw(), w as usize, h as usize).unwrap();
        values.extend(patches.values);
        grids.push(patches.grid);
    }
    let embeds = (!images.is_empty()).then(|| {
        let n = values.len() / cfg.patch_len();
        let pixels = Tensor::from_vec(values, (n, cfg.patch_len()), model.device()).unwrap();
        model
            .vision()
            .unwrap()
            .forward(&pixels, &grids, None)
            .unwrap()
    });
    let pad = r["image_pad"].as_u64().unwrap() as u32;
    let (positions, offset) = mrope_positions(&ids, pad, &grids, cfg.merge_size).unwrap();
    let image_tokens = ids
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == pad)
        .enumerate()
        .map(|(k, (i, _))| (i as u32, k as u32))
        .collect();
    Prompt {
        ids,
        embeds,
        positions,
        offset,
        image_tokens,
    }
}

impl Prompt {
    fn vision(&self) -> Option<RowVision<'_>> {
        self.embeds.as_ref().map(|embeds| RowVision {
            positions: &self.positions,
            image_tokens: &self.image_tokens,
            embeds: Some(embeds),
            offset: self.offset,
        })
    }
}

/// Prefills the prompts as one batch, each row with its adapter, then decodes `steps` greedy
/// tokens together: each row's prefill logits and tokens.
fn run(
    model: &Decoder,
    rows: &[(&Prompt, Option<&LoraAdapter>)],
    steps: usize,
) -> (Vec<Tensor>, Vec<Vec<u32>>) {
    let mut caches: Vec<SeqCache> = rows.iter().map(|_| SeqCache::default()).collect();
    let mut batch: Vec<Row> = rows
        .iter()
        .zip(caches.iter_mut())
        .map(|((p, a), cache)| Row {
            tokens: &p.ids,
            cache,
            adapter: *a,
            vision: p.vision(),
        })
        .collect();
    let first = model.forward(&mut batch).unwrap();
    drop(batch);
    let mut out: Vec<Vec<u32>> = first.iter().map(|l| vec![argmax(l).unwrap()]).collect();
    for _ in 1..steps {
        let last: Vec<[u32; 1]> = out.iter().map(|o| [*o.last().unwrap()]).collect();
        let mut batch: Vec<Row> = last
            .iter()
            .zip(caches.iter_mut())
            .zip(rows)
            .map(|((t, cache), (_, a))| Row {
                tokens: t,
                cache,
                adapter: *a,
                vision: None,
            })
            .collect();
        let next = model.forward(&mut batch).unwrap();
        for (o, l) in out.iter_mut().zip(next) {
            o.push(argmax(&l).unwrap());
        }
    }
    (first, out)
}

/// The language model on prompts with no image, one image and two images of different sizes
/// (in one batch), each with and without the adapter, on the host kernels and on the tensor
/// path: prefill logits within 1e-4 of their scale of transformers' (f32) and 12 greedy tokens
/// equal (transformers' generate, which continues M-RoPE after the images).
#[test]
fn the_language_model_with_images_equals_transformers() {
    let dir = fixtures().join("qwen3_vl");
    let dev = common::test_device();
    let mut model = Decoder::load(&dir, DType::F32, &dev).unwrap();
    let opts = LoadOptions {
        max_rank: 64,
        expect_base: None,
    };
    let adapter = lora::load(
        &fixtures().join("adapter"),
        model.config(),
        DType::F32,
        &dev,
        &opts,
    )
    .unwrap();
    let r = reference();
    let names = ["text", "one_image", "two_images"];
    let prompts: Vec<Prompt> = names.iter().map(|n| prompt(&model, n)).collect();
    // The host kernels are the CPU's; a GPU runs the tensor path only.
    let paths: &[bool] = if dev.is_cuda() {
        &[false]
    } else {
        &[true, false]
    };
    for &host in paths {
        model.configure(mole_model::BackendKind::host_if(host), Default::default());
        for label in ["base", "adapter"] {
            let a = (label == "adapter").then_some(&adapter);
            let rows: Vec<(&Prompt, Option<&LoraAdapter>)> =
                prompts.iter().map(|p| (p, a)).collect();
            let (logits, tokens) = run(&model, &rows, 12);
            for (k, name) in names.iter().enumerate() {
                let want_l = Tensor::new(
                    serde_json::from_value::<Vec<f32>>(
                        r["prompts"][name][label]["last_logits"].clone(),
                    )
                    .unwrap(),
                    &Device::Cpu,
                )
                .unwrap();
                let err = rel_error(&logits[k], &want_l);
                let mode = if host { "host kernels" } else { "tensor path" };
                eprintln!("{name} {label} ({mode}): relative logit error {err:.2e}");
                assert!(err <= 1e-4, "{name} {label} ({mode}): {err}");
                let want: Vec<u32> =
                    serde_json::from_value(r["prompts"][name][label]["greedy"].clone()).unwrap();
                assert_eq!(tokens[k], want, "{name} {label} ({mode}): greedy tokens");
            }
        }
    }
}
