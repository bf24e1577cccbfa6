//! `config.json` as the decoder reads it: the families mole runs and their shape.

use std::path::Path;

use serde::Deserialize;

use super::{ModelError, Rope};
use crate::formats::hf;

/// The decoder families mole runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama / SmolLM2.
    Llama,
    /// Qwen2 / Qwen2.5: bias on q, k, v.
    Qwen2,
    /// Qwen3: RMSNorm on each head of q and k.
    Qwen3,
}

/// `config.json` fields the decoder reads.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    /// `llama`, `qwen2` or `qwen3`.
    pub model_type: String,
    /// Hidden size.
    pub hidden_size: usize,
    /// MLP size.
    pub intermediate_size: usize,
    /// Layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head size (default hidden/heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (older configs and most published checkpoints).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE settings as transformers 5 writes them (`rope_theta`, `rope_type`).
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// RoPE scaling of older configs (`{"rope_type": "llama3", ...}`).
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// Vocabulary.
    pub vocab_size: usize,
    /// lm_head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on the attention projections (Qwen2 has it on q/k/v even when unset).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Longest position (the pre-scaling window for `linear` and `dynamic` RoPE).
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Pre-training context length when a config keeps it at the top level (else it is read
    /// from the RoPE dict).
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// Share of the head that is rotated (only 1.0 is supported).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
}

fn default_max_pos() -> usize {
    4096
}

impl ModelConfig {
    /// Reads and checks `config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        Self::from_json(hf::read_config(dir)?)
    }

    /// Parses and checks a `config.json` value.
    pub fn from_json(v: serde_json::Value) -> Result<Self, ModelError> {
        let cfg: ModelConfig =
            serde_json::from_value(v).map_err(|e| ModelError::Config(e.to_string()))?;
        cfg.family()?;
        if cfg.hidden_size == 0 || cfg.num_attention_heads == 0 {
            return Err(ModelError::Config(
                "hidden_size and num_attention_heads must be > 0".into(),
            ));
        }
        if cfg.kv_heads() == 0 || !cfg.num_attention_heads.is_multiple_of(cfg.kv_heads()) {
            return Err(ModelError::Config(
                "num_attention_heads must be a multiple of num_key_value_heads".into(),
            ));
        }
        if cfg.head_dim() == 0 || !cfg.head_dim().is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "head_dim {} must be even for RoPE",
                cfg.head_dim()
            )));
        }
        cfg.rope()?;
        Ok(cfg)
    }
    /// The family.
    pub fn family(&self) -> Result<Family, ModelError> {
        match self.model_type.as_str() {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            other => Err(ModelError::Config(format!(
                "model_type {other} is not supported (llama, qwen2, qwen3)"
            ))),
        }
    }
    /// RoPE base: the RoPE dict's `rope_theta`, else the top-level one, else 10000.
    pub fn rope_theta(&self) -> f64 {
        self.rope()
            .map(|r| r.theta)
            .unwrap_or(self.rope_theta.unwrap_or(10_000.0))
    }
    /// RoPE base and scaling (`rope_scaling` or `rope_parameters`), as transformers reads them.
    pub fn rope(&self) -> Result<Rope, ModelError> {
        Rope::from_config(self)
    }
    /// Longest sequence the model accepts: `max_position_embeddings`, stretched by `linear`,
    /// `dynamic` and `yarn` RoPE scaling (see [`Rope::max_positions`]).
    pub fn max_positions(&self) -> usize {
        self.rope()
            .map(|r| r.max_positions(self.max_position_embeddings))
            .unwrap_or(self.max_position_embeddings)
    }
    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    /// Head size.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }
}
