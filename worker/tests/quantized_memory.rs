//! A quantized base holds its weights once while it serves (issue 36: a 4-bit base's memory is
//! its blocks, which `/v1/models`, the startup log and the KV-cache budget count).
//!
//! candle 0.11.1's CPU product repacks q4_K weights (and q6_K ones for more than one row) on
//! first use into expanded tiles that it keeps beside the original blocks, for as long as the
//! tensor lives: a q4_K base's resident memory about doubled after its first request (466 MiB
//! of blocks, 501 MiB resident loaded, 1,064 MiB after one request, `bench memory --synthetic
//! q4_k`). mole multiplies every block type it serves with its own kernel, which reads the
//! blocks in place.
//!
//! Measured as the growth of this process's `VmRSS` over a prefill and decode steps of a
//! k-quant model (57 MiB of blocks), against its blocks' bytes, after a model of the same
//! shapes (its own tensors) has served the same steps, so that the allocator's arenas have
//! already grown to a step's buffers. This file holds one test, so no other test's allocations
//! share the process. What is left is the step's KV cache and buffers and the allocator's
//! spread, a few MiB (up to 17 measured); a second copy of the weights is 100% of the blocks
//! (candle's tiles: 145% on a 4-layer model, 43.6 MiB for 30 MiB). Bound: half the blocks'
//! bytes.

#![allow(clippy::unwrap_used)] // a failed unwrap in a test is a failed test
#![allow(clippy::disallowed_methods)] // the test builds its weights on the CPU

mod common;

use std::collections::HashMap;

use common::seeded;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use mole_model::{Decoder, ModelConfig, Row, SeqCache};

/// `VmRSS` of this process, in bytes.
fn resident() -> u64 {
    common::status_bytes("VmRSS:")
}

const SHAPE: (usize, usize, usize, usize, usize, usize, usize) = (1024, 2816, 8, 2048, 16, 4, 64);

/// A Llama of [`SHAPE`] in llama.cpp's Q4_K_M mix (q6_K for v, down and the output head, q4_K
/// elsewhere), its values drawn from `seed`, and the bytes of its blocks.
fn q4_k_m_model(seed: u64) -> (Decoder, usize) {
    let (h, inter, layers, vocab, nh, nkv, hd) = SHAPE;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": hd, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": vocab, "max_position_embeddings": 512, "tie_word_embeddings": false,
    });
    let dev = Device::Cpu;
    let mut seed = seed * 1000;
    let mut tensors = HashMap::new();
    let mut blocks = 0usize;
    let mut add = |name: String, rows: usize, cols: usize, t: GgmlDType| {
        seed += 1;
        let scale = if rows == 1 {
            0.1
        } else {
            (3.0 / cols as f32).sqrt()
        };
        let mut v = seeded(seed, rows * cols, scale);
        if rows == 1 {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        let w = Tensor::from_vec(v, (rows, cols), &dev).unwrap();
        let q = if rows == 1 {
            QTensor::quantize(&w.squeeze(0).unwrap(), GgmlDType::F32).unwrap()
        } else {
            let q = QTensor::quantize(&w, t).unwrap();
            blocks += q.storage_size_in_bytes();
            q
        };
        tensors.insert(name, q);
    };
    add("model.embed_tokens.weight".into(), vocab, h, GgmlDType::Q4K);
    add("lm_head.weight".into(), vocab, h, GgmlDType::Q6K);
    add("model.norm.weight".into(), 1, h, GgmlDType::F32);
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (name, rows, cols, t) in [
            ("self_attn.q_proj.weight", nh * hd, h, GgmlDType::Q4K),
            ("self_attn.k_proj.weight", nkv * hd, h, GgmlDType::Q4K),
            ("self_attn.v_proj.weight", nkv * hd, h, GgmlDType::Q6K),
            ("self_attn.o_proj.weight", h, nh * hd, GgmlDType::Q4K),
            ("mlp.gate_proj.weight", inter, h, GgmlDType::Q4K),
            ("mlp.up_proj.weight", inter, h, GgmlDType::Q4K),
            ("mlp.down_proj.weight", h, inter, GgmlDType::Q6K),
        ] {
            add(p(name), rows, cols, t);
        }
        for n in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            add(p(n), 1, h, GgmlDType::F32);
        }
    }
    let cfg = ModelConfig::from_json(config).unwrap();
    (Decoder::from_quantized(cfg, tensors, &dev).unwrap(), blocks)
}

/// A prefill of two 96-token prompts, then three decode steps.
fn serve(model: &Decoder) {
    let vocab = SHAPE.3 as u32;
    let prompts: Vec<Vec<u32>> = (0..2u32)
        .map(|r| (0..96).map(|i| (i * 7 + r * 13 + 1) % vocab).collect())
        .collect();
    let mut caches = [SeqCache::default(), SeqCache::default()];
    for step in 0..4u32 {
        let toks: Vec<Vec<u32>> = if step == 0 {
            prompts.clone()
        } else {
            vec![vec![step], vec![step + 1]]
        };
        let mut batch: Vec<Row> = toks
            .iter()
            .zip(caches.iter_mut())
            .map(|(t, cache)| Row {
                tokens: t,
                cache,
                adapter: None,
                vision: None,
            })
            .collect();
        model.forward(&mut batch).unwrap();
    }
}

#[test]
fn a_k_quant_base_holds_its_blocks_once_while_it_serves() {
    if !cfg!(target_os = "linux") {
        eprintln!("VmRSS is read from /proc: Linux only");
        return;
    }
    // A model of the same shapes served first, so the allocator's arenas and the thread
    // pool's buffers have grown to a step's size before the measured model serves; on one
    // pool thread, so that the steps run on the same threads and arenas each time (with
    // several, a task may land on a thread whose arena has not grown yet: 0.3-17 MiB over runs
    // of a 4-layer model; on one, 1.4-8.2 MiB).
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let (grown, blocks) = pool.install(|| {
        let (warm, _) = q4_k_m_model(1);
        serve(&warm);
        let (model, blocks) = q4_k_m_model(2);
        let before = resident();
        serve(&model);
        (resident().saturating_sub(before), blocks)
    });
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "blocks {:.1} MiB; resident grew by {:.1} MiB over a prefill and 3 decode steps",
        mib(blocks as u64),
        mib(grown)
    );
    assert!(
        grown < blocks as u64 / 2,
        "serving grew the process by {:.1} MiB for {:.1} MiB of blocks: a second copy of the weights",
        mib(grown),
        mib(blocks as u64)
    );
}
