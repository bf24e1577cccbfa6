//! Loading a model holds its weights once, at its peak too: the load's resident high-water mark
//! (`VmHWM`) stays near what the loaded model holds (`VmRSS`).
//!
//! Reading the safetensors through a mapping (candle's `MmapedSafetensors`, the loader before)
//! kept every page of the file mapped in the process while the model copied it, so the load
//! peaked at the weights twice: 528 MiB against 290 MiB held for a 257 MiB bf16 SmolLM2. A pod
//! sized by what the model holds would meet that peak at start.
//!
//! Measured in a child process (this binary again, running only [`child`]), since `VmHWM` is
//! the whole process's and other tests allocate: a synthetic bf16 Llama of 72 MB. What may be
//! in flight beyond the model is one tensor being read (the largest here, the 8 MB embedding,
//! 11% of the file) and the allocator's spread; a second copy of the weights is 100% of the
//! file. Bound: a quarter of the file.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test is a failed test
#![allow(clippy::disallowed_methods)] // the test builds its weights on the CPU

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use mole_model::Decoder;

/// `VmRSS` and `VmHWM` of this process, in bytes.
fn resident() -> (u64, u64) {
    (
        common::status_bytes("VmRSS:"),
        common::status_bytes("VmHWM:"),
    )
}

/// A bf16 Llama (hidden 512, 8 layers, vocabulary 8192, untied head) in `dir`; its file's bytes.
fn write_model(dir: &Path) -> u64 {
    let (h, inter, layers, vocab) = (512usize, 1536usize, 8usize, 8192usize);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 8,
        "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": vocab, "max_position_embeddings": 512, "tie_word_embeddings": false,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, h]),
        ("lm_head.weight".into(), vec![vocab, h]),
        ("model.norm.weight".into(), vec![h]),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj", vec![h, h]),
            ("self_attn.k_proj", vec![h, h]),
            ("self_attn.v_proj", vec![h, h]),
            ("self_attn.o_proj", vec![h, h]),
            ("mlp.gate_proj", vec![inter, h]),
            ("mlp.up_proj", vec![inter, h]),
            ("mlp.down_proj", vec![h, inter]),
        ] {
            shapes.push((format!("{p}.{name}.weight"), shape));
        }
        shapes.push((format!("{p}.input_layernorm.weight"), vec![h]));
        shapes.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
    }
    let tensors: HashMap<String, Tensor> = shapes
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n = shape.iter().product();
            let t = Tensor::from_vec(common::seeded(i as u64 + 1, n, 0.05), shape, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            (name, t)
        })
        .collect();
    let file = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &file).unwrap();
    std::fs::metadata(&file).unwrap().len()
}

/// In the child (`MOLE_LOAD_MEMORY_DIR` set): loads the model there and prints its readings.
#[test]
fn child() {
    let Ok(dir) = std::env::var("MOLE_LOAD_MEMORY_DIR") else {
        return;
    };
    let model = Decoder::load(Path::new(&dir), DType::BF16, &Device::Cpu).unwrap();
    let (rss, hwm) = resident();
    println!("LOADED {rss} {hwm}");
    drop(model);
}

#[test]
fn a_bf16_load_peaks_near_what_the_model_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = write_model(tmp.path());
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("MOLE_LOAD_MEMORY_DIR", tmp.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the child failed: {text}");
    let line = text
        .lines()
        .find_map(|l| l.split_once("LOADED ").map(|(_, v)| v))
        .unwrap_or_else(|| panic!("the child printed no readings: {text}"));
    let v: Vec<u64> = line.split(' ').map(|s| s.parse().unwrap()).collect();
    let (rss, hwm) = (v[0], v[1]);
    let above = hwm.saturating_sub(rss);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "{:.1} MiB file: {:.1} MiB resident after the load, peak {:.1} MiB ({:.0}% of the file above it)",
        mib(bytes),
        mib(rss),
        mib(hwm),
        100.0 * above as f64 / bytes as f64
    );
    assert!(
        above <= bytes / 4,
        "the load peaked {:.1} MiB above what it holds, for a {:.1} MiB file",
        mib(above),
        mib(bytes)
    );
}
