//! Property tests of the readers of remote files: the GGUF reader (`load_quantized`: header,
//! metadata, tokenizer, hyper-parameters), the safetensors header reader (`safetensors_elements`)
//! and the PEFT adapter reader (`adapter_config.json` and `adapter_model.safetensors` through
//! `lora::load`) on arbitrary and mutated bytes: each returns an error or a value, never panics
//! or aborts. A fixed number of cases each (256), so CI time is bounded.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};
use proptest::prelude::*;

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/engine")
}

/// A metadata-only llama GGUF with a 4-token vocabulary.
fn valid_gguf() -> Vec<u8> {
    use gguf_file::Value as V;
    let meta: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("llama".into())),
        ("llama.block_count", V::U32(1)),
        ("llama.embedding_length", V::U32(64)),
        ("llama.feed_forward_length", V::U32(128)),
        ("llama.attention.head_count", V::U32(4)),
        ("llama.attention.head_count_kv", V::U32(2)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("tokenizer.ggml.model", V::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens",
            V::Array(["a", "b", "c", "d"].map(|t| V::String(t.into())).to_vec()),
        ),
        ("tokenizer.ggml.merges", V::Array(vec![])),
        ("tokenizer.ggml.eos_token_id", V::U32(2)),
    ];
    let refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let t = candle_core::Tensor::zeros((4, 64), DType::F32, &Device::Cpu).unwrap();
    let q = candle_core::quantized::QTensor::quantize(&t, candle_core::quantized::GgmlDType::F32)
        .unwrap();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &refs, &[("token_embd.weight", &q)]).unwrap();
    out.into_inner()
}

/// `bytes` with `flips` (position modulo the length, new byte) applied, cut to `keep` bytes
/// when given.
fn mutate(mut bytes: Vec<u8>, flips: &[(usize, u8)], keep: Option<usize>) -> Vec<u8> {
    if !bytes.is_empty() {
        let n = bytes.len();
        for &(i, b) in flips {
            bytes[i % n] = b;
        }
    }
    if let Some(k) = keep {
        bytes.truncate(k);
    }
    bytes
}

fn mutations() -> impl Strategy<Value = (Vec<(usize, u8)>, Option<usize>)> {
    (
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
        prop::option::of(0usize..4096),
    )
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A case the GGUF proptest found (session 24): one byte of a tensor's shape set to 16 made
/// candle's reader overflow multiplying the elements' blocks by their bytes (a panic in a
/// debug build, a wrapped size in a release one); it is refused first.
#[test]
fn a_gguf_shape_whose_bytes_overflow_is_an_error() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.gguf");
    std::fs::write(
        &p,
        mutate(valid_gguf(), &[(11247974116238595067, 16)], None),
    )
    .unwrap();
    assert!(mole_formats::gguf::load_quantized(&p, &Device::Cpu).is_err());
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn gguf_reader_never_panics((flips, keep) in mutations(), raw in prop::collection::vec(any::<u8>(), 0..256)) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.gguf");
        std::fs::write(&p, mutate(valid_gguf(), &flips, keep)).unwrap();
        let _ = mole_formats::gguf::load_quantized(&p, &Device::Cpu);
        let mut magic = b"GGUF\x03\x00\x00\x00".to_vec();
        magic.extend(&raw);
        std::fs::write(&p, magic).unwrap();
        let _ = mole_formats::gguf::load_quantized(&p, &Device::Cpu);
    }

    #[test]
    fn safetensors_header_reader_never_panics((flips, keep) in mutations(), raw in prop::collection::vec(any::<u8>(), 0..256)) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("model.safetensors");
        let valid = std::fs::read(fixtures().join("adapters/llama/b_r4_qv/adapter_model.safetensors")).unwrap();
        std::fs::write(&p, mutate(valid, &flips, keep)).unwrap();
        let _ = mole_formats::hf::safetensors_elements(std::slice::from_ref(&p));
        std::fs::write(&p, &raw).unwrap();
        let _ = mole_formats::hf::safetensors_elements(&[p]);
    }

    #[test]
    fn peft_adapter_reader_never_panics(
        (flips, keep) in mutations(),
        (cflips, ckeep) in mutations(),
        text in ".{0,200}",
    ) {
        let src = fixtures().join("adapters/llama/b_r4_qv");
        let model = mole_model::ModelConfig::from_dir(&fixtures().join("llama")).unwrap();
        let d = tempfile::tempdir().unwrap();
        let cfg = std::fs::read(src.join("adapter_config.json")).unwrap();
        let cfg = mutate(cfg, &cflips, ckeep);
        let _ = mole_formats::peft::AdapterConfig::from_json(&String::from_utf8_lossy(&cfg));
        let _ = mole_formats::peft::AdapterConfig::from_json(&text);
        std::fs::write(d.path().join("adapter_config.json"), &cfg).unwrap();
        let w = std::fs::read(src.join("adapter_model.safetensors")).unwrap();
        std::fs::write(d.path().join("adapter_model.safetensors"), mutate(w, &flips, keep)).unwrap();
        let opts = mole_engine::lora::LoadOptions { max_rank: 64, expect_base: None };
        let _ = mole_engine::lora::load(d.path(), &model, DType::F32, &Device::Cpu, &opts);
    }
}
