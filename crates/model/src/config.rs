//! `config.json` as the decoder reads it: the families mole runs and their shape.

use std::path::Path;

use serde::Deserialize;

use super::vision::VisionConfig;
use super::ModelError;
use mole_formats::hf;

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

/// What a vision-language model (Qwen3-VL) adds to its text decoder: the vision tower's
/// config, its special tokens, and the M-RoPE sections of the rotary frequencies.
#[derive(Debug, Clone)]
pub struct VisionSpec {
    /// The vision tower.
    pub config: VisionConfig,
    /// The placeholder token each image token takes in the prompt.
    pub image_token_id: u32,
    /// The token before an image's placeholders.
    pub vision_start_token_id: u32,
    /// The token after them.
    pub vision_end_token_id: u32,
    /// Rotary frequencies that follow the temporal, height and width position (interleaved:
    /// frequency `j` follows height when `j % 3 == 1` and `j < 3 · sections[1]`, width when
    /// `j % 3 == 2` and `j < 3 · sections[2]`, else time).
    pub mrope_section: [usize; 3],
}

/// `config.json` fields the decoder reads.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    /// `llama`, `qwen2` or `qwen3` (a Qwen3-VL's text decoder is a `qwen3`).
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
    /// A vision-language model's vision side (`model_type: qwen3_vl`).
    #[serde(skip)]
    pub vision: Option<VisionSpec>,
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
        // The quantized checkpoints mole serves load in `Decoder::load`; others are refused
        // here, naming their format, before any tensor is looked for.
        if let Err(why) = mole_formats::quant::scheme(&v) {
            return Err(ModelError::UnsupportedQuantization(why));
        }
        if v.get("model_type").and_then(serde_json::Value::as_str) == Some("qwen3_vl") {
            return Self::from_qwen3_vl(v);
        }
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
    /// A Qwen3-VL `config.json`: its `text_config` is a Qwen3 decoder's (whose weights sit under
    /// `model.language_model`), its `vision_config` the tower's.
    fn from_qwen3_vl(v: serde_json::Value) -> Result<Self, ModelError> {
        let bad = |m: &str| ModelError::Config(format!("qwen3_vl: {m}"));
        let mut text = v
            .get("text_config")
            .cloned()
            .filter(serde_json::Value::is_object)
            .ok_or_else(|| bad("text_config is missing"))?;
        text["model_type"] = "qwen3".into();
        if text.get("tie_word_embeddings").is_none() {
            text["tie_word_embeddings"] = v
                .get("tie_word_embeddings")
                .cloned()
                .unwrap_or(false.into());
        }
        // transformers 5 writes `rope_parameters`; the published checkpoints (4.57) `rope_scaling`.
        let rope = text
            .get("rope_parameters")
            .or(text.get("rope_scaling"))
            .cloned()
            .unwrap_or_default();
        let sections: [usize; 3] = rope
            .get("mrope_section")
            .cloned()
            .and_then(|s| serde_json::from_value(s).ok())
            .ok_or_else(|| bad("text_config.rope_parameters (or rope_scaling).mrope_section must be 3 integers"))?;
        if rope
            .get("mrope_interleaved")
            .and_then(serde_json::Value::as_bool)
            != Some(true)
        {
            return Err(bad(
                "only interleaved M-RoPE (Qwen3-VL's) is supported; Qwen2-VL's contiguous sections are not",
            ));
        }
        let mut cfg = Self::from_json(text)?;
        if sections.iter().sum::<usize>() != cfg.head_dim() / 2 {
            return Err(bad("mrope_section must sum to head_dim / 2"));
        }
        if cfg.rope()?.is_dynamic() {
            return Err(bad("dynamic RoPE scaling is not supported with M-RoPE"));
        }
        let token = |k: &str| -> Result<u32, ModelError> {
            v.get(k)
                .and_then(serde_json::Value::as_u64)
                .map(|t| t as u32)
                .ok_or_else(|| bad(&format!("{k} is missing")))
        };
        let config: VisionConfig = serde_json::from_value(
            v.get("vision_config")
                .cloned()
                .ok_or_else(|| bad("vision_config is missing"))?,
        )
        .map_err(|e| bad(&format!("vision_config: {e}")))?;
        cfg.vision = Some(VisionSpec {
            config,
            image_token_id: token("image_token_id")?,
            vision_start_token_id: token("vision_start_token_id")?,
            vision_end_token_id: token("vision_end_token_id")?,
            mrope_section: sections,
        });
        Ok(cfg)
    }

    /// Where the text decoder's tensors are named from: `model`, or a Qwen3-VL's
    /// `model.language_model`.
    pub fn text_prefix(&self) -> &'static str {
        match self.vision {
            Some(_) => "model.language_model",
            None => "model",
        }
    }

    /// The family.
    pub fn family(&self) -> Result<Family, ModelError> {
        match self.model_type.as_str() {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            other => Err(ModelError::Config(format!(
                "model_type {other} is not supported (llama, qwen2, qwen3, qwen3_vl)"
            ))),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `config.json` of Qwen/Qwen3-VL-8B-Instruct as published (transformers 4.57 keys:
    /// `rope_scaling` holds the M-RoPE sections).
    const QWEN3_VL_8B: &str = r#"{
      "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655,
      "model_type": "qwen3_vl",
      "text_config": {
        "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
        "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
        "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
        "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": true, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "use_cache": true, "vocab_size": 151936
      },
      "tie_word_embeddings": false, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
      "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304,
        "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
        "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2
      },
      "vision_end_token_id": 151653, "vision_start_token_id": 151652
    }"#;

    #[test]
    fn the_published_qwen3_vl_8b_config_reads() {
        let cfg = ModelConfig::from_json(serde_json::from_str(QWEN3_VL_8B).unwrap()).unwrap();
        assert_eq!(
            (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim()),
            (4096, 36, 128)
        );
        assert_eq!(cfg.rope_theta(), 5_000_000.0);
        assert_eq!(cfg.max_positions(), 262_144);
        let v = cfg.vision.as_ref().unwrap();
        assert_eq!(v.mrope_section, [24, 20, 20]);
        assert_eq!(
            (
                v.image_token_id,
                v.vision_start_token_id,
                v.vision_end_token_id
            ),
            (151_655, 151_652, 151_653)
        );
        assert_eq!(
            (
                v.config.depth,
                v.config.hidden_size,
                v.config.out_hidden_size
            ),
            (27, 1152, 4096)
        );
        assert_eq!(v.config.deepstack_visual_indexes, [8, 16, 24]);
        // Qwen2-VL's contiguous sections are refused by name.
        let mut old: serde_json::Value = serde_json::from_str(QWEN3_VL_8B).unwrap();
        old["text_config"]["rope_scaling"]["mrope_interleaved"] = false.into();
        let err = ModelConfig::from_json(old).unwrap_err().to_string();
        assert!(err.contains("interleaved"), "{err}");
    }
}
