//! A synthetic Qwen3 of any width and depth (random weights) and random PEFT adapters for it:
//! the model the decode, GGUF, image and memory benches measure when no checkpoint is given.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use mole_model::ModelConfig;

/// The synthetic model's `config.json`, which transformers reads too.
pub(super) fn synthetic_json(hidden: usize, layers: usize) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": hidden * 11 / 4,
        "num_hidden_layers": layers, "num_attention_heads": hidden / 64, "num_key_value_heads": hidden / 256,
        "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 32000,
        "max_position_embeddings": 512, "tie_word_embeddings": true
    })
}

pub(super) fn synthetic_config(hidden: usize, layers: usize) -> ModelConfig {
    serde_json::from_value(synthetic_json(hidden, layers)).expect("valid config")
}

/// Each layer's projections by checkpoint name (without `.weight`), with their (out, in) shapes.
fn projections(cfg: &ModelConfig) -> [(&'static str, (usize, usize)); 7] {
    let (h, hd, i) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.kv_heads() * hd);
    [
        ("self_attn.q_proj", (q, h)),
        ("self_attn.k_proj", (kv, h)),
        ("self_attn.v_proj", (kv, h)),
        ("self_attn.o_proj", (h, q)),
        ("mlp.gate_proj", (i, h)),
        ("mlp.up_proj", (i, h)),
        ("mlp.down_proj", (h, i)),
    ]
}

/// Random weights for every tensor the decoder asks for.
pub(super) fn synthetic_weights(
    cfg: &ModelConfig,
    dev: &Device,
) -> candle_core::Result<HashMap<String, Tensor>> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim());
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let r = |shape: (usize, usize)| Tensor::randn(0f32, 0.02, shape, dev);
    t.insert("model.embed_tokens.weight".into(), r((cfg.vocab_size, h))?);
    t.insert(
        "model.norm.weight".into(),
        Tensor::ones(h, DType::F32, dev)?,
    );
    for l in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (name, shape) in projections(cfg) {
            t.insert(p(&format!("{name}.weight")), r(shape)?);
        }
        for n in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            t.insert(p(n), Tensor::ones(h, DType::F32, dev)?);
        }
        for n in ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] {
            t.insert(p(n), Tensor::ones(hd, DType::F32, dev)?);
        }
    }
    Ok(t)
}

/// Writes a PEFT adapter of rank `r` on every linear module for `cfg` into `dir`.
pub(super) fn write_adapter(
    dir: &Path,
    cfg: &ModelConfig,
    r: usize,
    seed: u64,
    dev: &Device,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let noise = 0.01 + seed as f64 * 1e-4;
    for l in 0..cfg.num_hidden_layers {
        for (name, (fout, fin)) in projections(cfg) {
            let k = format!("base_model.model.model.layers.{l}.{name}");
            t.insert(
                format!("{k}.lora_A.weight"),
                Tensor::randn(0f32, noise as f32, (r, fin), dev)?,
            );
            t.insert(
                format!("{k}.lora_B.weight"),
                Tensor::randn(0f32, noise as f32, (fout, r), dev)?,
            );
        }
    }
    candle_core::safetensors::save(&t, dir.join("adapter_model.safetensors"))?;
    std::fs::write(
        dir.join("adapter_config.json"),
        serde_json::to_vec(&serde_json::json!({
            "peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        }))?,
    )?;
    Ok(())
}
