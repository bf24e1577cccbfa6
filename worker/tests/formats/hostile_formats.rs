//! Malformed remote data turns into errors with stable codes, never a panic: a GGUF file whose
//! metadata has zero attention heads, and a merge whose output lies outside the root (refused
//! before any directory of it is created).

#![allow(clippy::unwrap_used)] // a failed unwrap in a test helper is a failed test

use crate::common;

use common::byte_tokens;

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::Device;

/// A metadata-only llama GGUF (no tensors) with `heads` and `kv_heads` attention heads.
fn gguf(path: &Path, heads: u32, kv_heads: u32) {
    use gguf_file::Value as V;
    let meta: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("llama".into())),
        ("llama.block_count", V::U32(1)),
        ("llama.embedding_length", V::U32(64)),
        ("llama.feed_forward_length", V::U32(128)),
        ("llama.attention.head_count", V::U32(heads)),
        ("llama.attention.head_count_kv", V::U32(kv_heads)),
        ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
        ("tokenizer.ggml.model", V::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens",
            V::Array(byte_tokens().into_iter().map(V::String).collect()),
        ),
        ("tokenizer.ggml.merges", V::Array(vec![])),
        ("tokenizer.ggml.eos_token_id", V::U32(2)),
    ];
    let refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &refs, &[]).unwrap();
}

#[test]
fn a_gguf_with_zero_heads_is_an_error_not_a_panic() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.gguf");
    gguf(&p, 4, 2);
    assert!(mole_formats::gguf::load_quantized(&p, &Device::Cpu).is_ok());
    for (heads, kv) in [(0, 0), (4, 0), (4, 3)] {
        gguf(&p, heads, kv);
        let e = match mole_formats::gguf::load_quantized(&p, &Device::Cpu) {
            Ok(_) => panic!("{heads} heads, {kv} kv heads: loaded"),
            Err(e) => e,
        };
        assert_eq!(e.code(), "invalid_gguf_metadata", "{heads}/{kv}: {e}");
    }
}

#[test]
fn a_merge_output_outside_the_root_creates_nothing() {
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/merge");
    let top = tempfile::tempdir().unwrap();
    let root = top.path().join("root");
    for (from, to) in [("base_f32", "base"), ("adapters/plain_r8", "adapter")] {
        let dst = root.join(to);
        std::fs::create_dir_all(&dst).unwrap();
        for e in std::fs::read_dir(fx.join(from)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
    for out in ["../escape/deep/merged", "merged/../../escape/deep/merged"] {
        let opts = mole_tools::merge::MergeOptions {
            base: root.join("base"),
            adapter: root.join("adapter"),
            out: root.join(out),
            safe_merge: true,
            dtype: None,
            root: Some(root.clone()),
            expect_base: None,
            max_rank: 64,
            adapter_name: None,
            adapter_version: None,
        };
        let e = mole_tools::merge::merge(&opts).expect_err(out);
        assert_eq!(e.code(), "path_outside_root", "{out}: {e}");
        assert!(
            !top.path().join("escape").exists(),
            "{out}: the output's parents were created outside the root"
        );
    }
}
