//! What the op-count tests (op_count.rs, op_count_quantized.rs, op_count_bgmv.rs) share: a
//! small random Qwen3, a random adapter, and the ops and copies of one tensor-path step over a
//! batch of rows.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mole_model::{
    tensors_made, transfers_made, Decoder, LoraAdapter, ModelConfig, Proj, Row, SeqCache, Transfers,
};

/// A small random Qwen3 (GQA, q/k norm): its config and f32 weights by checkpoint name.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn tiny_qwen3_weights() -> (ModelConfig, HashMap<String, Tensor>) {
    let cfg = ModelConfig::from_json(serde_json::json!({
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": 50,
        "max_position_embeddings": 256, "tie_word_embeddings": true
    }))
    .unwrap();
    let dev = Device::Cpu;
    let mut t = HashMap::new();
    t.insert(
        "model.embed_tokens.weight".to_string(),
        Tensor::randn(0f32, 0.2, (50, 64), &dev).unwrap(),
    );
    t.insert(
        "model.norm.weight".to_string(),
        Tensor::ones(64, DType::F32, &dev).unwrap(),
    );
    for l in 0..2 {
        for p in Proj::ALL {
            let (d_in, d_out) = p.dims(&cfg);
            let name = match p {
                Proj::Q => "self_attn.q_proj",
                Proj::K => "self_attn.k_proj",
                Proj::V => "self_attn.v_proj",
                Proj::O => "self_attn.o_proj",
                Proj::Gate => "mlp.gate_proj",
                Proj::Up => "mlp.up_proj",
                Proj::Down => "mlp.down_proj",
            };
            let w = Tensor::randn(0f32, 0.2, (d_out, d_in), &dev).unwrap();
            t.insert(format!("model.layers.{l}.{name}.weight"), w);
        }
        for (n, size) in [
            ("input_layernorm", 64),
            ("post_attention_layernorm", 64),
            ("self_attn.q_norm", 16),
            ("self_attn.k_norm", 16),
        ] {
            let ones = Tensor::ones(size, DType::F32, &dev).unwrap();
            t.insert(format!("model.layers.{l}.{n}.weight"), ones);
        }
    }
    (cfg, t)
}

/// [`tiny_qwen3_weights`] in f32 on the tensor path.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn tiny_qwen3() -> Decoder {
    let (cfg, t) = tiny_qwen3_weights();
    let mut m = Decoder::new(cfg, VarBuilder::from_tensors(t, DType::F32, &Device::Cpu)).unwrap();
    m.configure(mole_model::BackendKind::Paged, Default::default());
    m
}

/// A random adapter of rank 8 on every projection.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn adapter(m: &Decoder) -> LoraAdapter {
    let mut modules = HashMap::new();
    for l in 0..m.config().num_hidden_layers {
        for p in Proj::ALL {
            let (d_in, d_out) = p.dims(m.config());
            let at = Tensor::randn(0f32, 0.1, (d_in, 8), &Device::Cpu).unwrap();
            let b = Tensor::randn(0f32, 0.1, (d_out, 8), &Device::Cpu).unwrap();
            modules.insert((l, p), (at, b));
        }
    }
    LoraAdapter::from_modules(modules, 8, 0)
}

/// Rows on `adapters` with prompts of 3 to 7 tokens; all but the last `prefilling` are
/// prefilled first. Returns the tensors one step makes (it decodes one token of the first
/// rows while the others prefill) and the dims of its logits.
#[allow(dead_code)] // each test crate uses some of these helpers
pub fn ops_of_a_step(
    m: &Decoder,
    adapters: &[Option<&LoraAdapter>],
    prefilling: usize,
) -> (usize, Vec<usize>) {
    let prompts: Vec<Vec<u32>> = (0..adapters.len())
        .map(|k| (1..4 + (k as u32 % 5)).collect())
        .collect();
    let mut caches: Vec<SeqCache> = adapters.iter().map(|_| SeqCache::default()).collect();
    let warm = adapters.len() - prefilling;
    let mut first: Vec<Row> = caches[..warm]
        .iter_mut()
        .zip(&prompts)
        .zip(adapters)
        .map(|((cache, tokens), a)| Row {
            tokens,
            cache,
            adapter: *a,
            vision: None,
        })
        .collect();
    if !first.is_empty() {
        m.forward_batch(&mut first).unwrap();
    }
    drop(first);
    let next = [7u32];
    let mut step: Vec<Row> = caches
        .iter_mut()
        .enumerate()
        .zip(adapters)
        .map(|((k, cache), a)| Row {
            tokens: if k < warm { &next } else { &prompts[k] },
            cache,
            adapter: *a,
            vision: None,
        })
        .collect();
    let ((logits, ops), copies) =
        transfers_made(|| tensors_made(|| m.forward_batch(&mut step).unwrap()));
    assert_eq!(
        copies,
        Transfers {
            uploads: 1,
            downloads: 0
        },
        "a step's inputs go up in one copy (its logits come back in the engine's one read)"
    );
    (ops, logits.dims().to_vec())
}
