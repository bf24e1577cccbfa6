//! A synthetic Qwen3 of any width and depth (random weights) and random PEFT adapters for it:
//! the model the decode, GGUF, image and memory benches measure when no checkpoint is given.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::model::ModelConfig;

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

/// Random weights for every tensor the decoder asks for.
pub(super) fn synthetic_weights(
    cfg: &ModelConfig,
    dev: &Device,
) -> candle_core::Result<HashMap<String, Tensor>> {
    let (h, hd, nh, nkv, i) = (
        cfg.hidden_size,
        cfg.head_dim(),
        cfg.num_attention_heads,
        cfg.kv_heads(),
        cfg.intermediate_size,
    );
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let r = |shape: (usize, usize)| Tensor::randn(0f32, 0.02, shape, dev);
    t.insert("model.embed_tokens.weight".into(), r((cfg.vocab_size, h))?);
    t.insert(
        "model.norm.weight".into(),
        Tensor::ones(h, DType::F32, dev)?,
    );
    for l in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (name, shape) in [
            ("self_attn.q_proj.weight", (nh * hd, h)),
            ("self_attn.k_proj.weight", (nkv * hd, h)),
            ("self_attn.v_proj.weight", (nkv * hd, h)),
            ("self_attn.o_proj.weight", (h, nh * hd)),
            ("mlp.gate_proj.weight", (i, h)),
            ("mlp.up_proj.weight", (i, h)),
            ("mlp.down_proj.weight", (h, i)),
        ] {
            t.insert(p(name), r(shape)?);
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
    let (h, hd, nh, nkv, i) = (
        cfg.hidden_size,
        cfg.head_dim(),
        cfg.num_attention_heads,
        cfg.kv_heads(),
        cfg.intermediate_size,
    );
    let mut t: HashMap<String, Tensor> = HashMap::new();
    let noise = 0.01 + seed as f64 * 1e-4;
    for l in 0..cfg.num_hidden_layers {
        for (name, (fout, fin)) in [
            ("self_attn.q_proj", (nh * hd, h)),
            ("self_attn.k_proj", (nkv * hd, h)),
            ("self_attn.v_proj", (nkv * hd, h)),
            ("self_attn.o_proj", (h, nh * hd)),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ] {
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
