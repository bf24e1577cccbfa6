//! mole's decoder against transformers on committed tiny random models
//! (tests/fixtures/engine, written by generate.py): last-position logits of two prompts run as
//! one batch within 1e-4 of the logits' scale (f32; the remaining difference is summation order
//! in matmuls and softmax), and 32-token greedy continuations identical, decoding both rows
//! together with per-sequence caches.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use mole_worker::model::{argmax, Decoder, Row, SeqCache};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("reference.json")).unwrap())
        .unwrap()
}

fn check_family(name: &str) {
    let r = &reference()[name];
    let model = Decoder::load(&fixtures().join(name), DType::F32, &Device::Cpu).unwrap();
    let prompts: Vec<Vec<u32>> = serde_json::from_value(r["prompts"].clone()).unwrap();
    let mut caches = vec![SeqCache::default(); prompts.len()];
    let logits = {
        let mut rows: Vec<Row> = prompts
            .iter()
            .zip(caches.iter_mut())
            .map(|(p, c)| Row {
                tokens: p,
                cache: c,
            })
            .collect();
        model.forward(&mut rows).unwrap()
    };
    for (i, l) in logits.iter().enumerate() {
        let ours: Vec<f32> = l.to_vec1().unwrap();
        let want: Vec<f32> = serde_json::from_value(r["last_logits"][i].clone()).unwrap();
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = ours
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
            / scale;
        eprintln!("{name} prompt {i}: max logit error {worst:.2e} of scale {scale:.3}");
        assert!(worst <= 1e-4, "{name} prompt {i}: relative error {worst}");
    }
    // Greedy: both sequences decode in the same batch, each with its own cache.
    let mut next: Vec<u32> = logits.iter().map(|l| argmax(l).unwrap()).collect();
    let mut generated: Vec<Vec<u32>> = next.iter().map(|t| vec![*t]).collect();
    for _ in 1..32 {
        let toks: Vec<[u32; 1]> = next.iter().map(|t| [*t]).collect();
        let mut rows: Vec<Row> = toks
            .iter()
            .zip(caches.iter_mut())
            .map(|(t, c)| Row {
                tokens: t,
                cache: c,
            })
            .collect();
        let out = model.forward(&mut rows).unwrap();
        next = out.iter().map(|l| argmax(l).unwrap()).collect();
        for (g, t) in generated.iter_mut().zip(&next) {
            g.push(*t);
        }
    }
    for (i, g) in generated.iter().enumerate() {
        let want: Vec<u32> = serde_json::from_value(r["greedy"][i].clone()).unwrap();
        assert_eq!(g, &want, "{name} prompt {i}: greedy continuation");
    }
    assert_eq!(caches[0].len(), prompts[0].len() + 31);
}

#[test]
fn llama_matches_transformers() {
    check_family("llama");
}

#[test]
fn qwen2_with_qkv_bias_matches_transformers() {
    check_family("qwen2");
}

#[test]
fn qwen3_with_qk_norm_matches_transformers() {
    check_family("qwen3");
}
