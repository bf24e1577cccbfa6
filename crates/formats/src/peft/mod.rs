//! PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`.
//!
//! The matching rules follow PEFT (`check_target_module_exists`, `get_pattern_key`): a list of
//! target modules matches a module whose name equals an entry or ends with `.entry`; a string is
//! a regex that must match the whole module name. `rank_pattern`/`alpha_pattern` keys match a
//! module whose name is the key or ends with `.key` (the key may be a regex).

use std::collections::BTreeMap;
use std::path::Path;

use regex::Regex;
use serde::{Deserialize, Serialize};

pub mod weights;

pub use self::weights::WeightsError;

/// Errors reading or interpreting an adapter. Names are stable (see [`PeftError::code`]).
#[derive(Debug, thiserror::Error)]
pub enum PeftError {
    /// The config file is missing or unreadable.
    #[error("cannot read {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The config is not valid JSON for a LoRA adapter.
    #[error("invalid adapter_config.json: {0}")]
    Config(String),
    /// The adapter uses a feature mole does not support.
    #[error("unsupported adapter: {0}")]
    Unsupported(String),
    /// `adapter_config.json` resolves outside the adapter's directory (a symlink).
    #[error(transparent)]
    OutsideDir(crate::hf::HfError),
}

impl PeftError {
    /// Stable name of the error (metric label, JSON code).
    pub fn code(&self) -> &'static str {
        match self {
            PeftError::Io { .. } => "adapter_io",
            PeftError::Config(_) => "adapter_config_invalid",
            PeftError::Unsupported(_) => "adapter_unsupported",
            PeftError::OutsideDir(e) => e.code(),
        }
    }
}

/// `target_modules`: a list of names (suffix match) or one regex (full match).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(untagged)]
pub enum TargetModules {
    /// Module names, matched as PEFT does: equal, or ending with `.name`.
    List(Vec<String>),
    /// A regex matched against the whole module name.
    Regex(String),
}

/// The fields of `adapter_config.json` mole reads. Unknown fields are ignored (PEFT adds new
/// ones every release).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct AdapterConfig {
    /// Must be `LORA`.
    #[serde(default = "lora")]
    pub peft_type: String,
    /// Default rank.
    pub r: u32,
    /// Default alpha.
    pub lora_alpha: f64,
    /// Scale alpha/sqrt(r) instead of alpha/r.
    #[serde(default)]
    pub use_rslora: bool,
    /// Modules that carry LoRA weights.
    #[serde(default)]
    pub target_modules: Option<TargetModules>,
    /// Modules excluded from `target_modules`.
    #[serde(default)]
    pub exclude_modules: Option<TargetModules>,
    /// Per-module ranks (key: module name suffix or regex).
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, u32>,
    /// Per-module alphas.
    #[serde(default)]
    pub alpha_pattern: BTreeMap<String, f64>,
    /// Weights stored transposed (GPT-2 Conv1D style).
    #[serde(default)]
    pub fan_in_fan_out: bool,
    /// Modules whose full weights the adapter replaces.
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    /// DoRA (weight-decomposed LoRA).
    #[serde(default)]
    pub use_dora: bool,
    /// `none`, `all` or `lora_only`.
    #[serde(default = "none")]
    pub bias: String,
    /// The base model the adapter was trained on.
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// Only these layer indices carry LoRA weights.
    #[serde(default)]
    pub layers_to_transform: Option<LayersToTransform>,
    /// Task type (`CAUSAL_LM`, ...), informational.
    #[serde(default)]
    pub task_type: Option<String>,
}

/// `layers_to_transform`: one index or a list.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(untagged)]
pub enum LayersToTransform {
    /// One layer.
    One(u32),
    /// Several layers.
    Many(Vec<u32>),
}

fn lora() -> String {
    "LORA".into()
}
fn none() -> String {
    "none".into()
}

/// PEFT's pattern-key lookup: the first key `k` such that `(.*\.)?(k)$` matches the name.
fn pattern_match<'a, V>(patterns: &'a BTreeMap<String, V>, module: &str) -> Option<&'a V> {
    patterns.iter().find_map(|(k, v)| {
        let re = Regex::new(&format!(r"^(.*\.)?({k})$")).ok()?;
        re.is_match(module).then_some(v)
    })
}

fn matches_targets(targets: &TargetModules, module: &str) -> bool {
    match targets {
        TargetModules::Regex(r) => {
            Regex::new(&format!("^(?:{r})$")).is_ok_and(|re| re.is_match(module))
        }
        TargetModules::List(names) => names
            .iter()
            .any(|t| module == t || module.ends_with(&format!(".{t}"))),
    }
}

impl AdapterConfig {
    /// Reads `adapter_config.json` from an adapter directory.
    pub fn from_dir(dir: &Path) -> Result<Self, PeftError> {
        let path = crate::hf::confine(dir, "adapter_config.json").map_err(PeftError::OutsideDir)?;
        let text = std::fs::read_to_string(&path).map_err(|source| PeftError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json(&text)
    }

    /// Parses and checks a config.
    pub fn from_json(text: &str) -> Result<Self, PeftError> {
        let cfg: AdapterConfig =
            serde_json::from_str(text).map_err(|e| PeftError::Config(e.to_string()))?;
        if !cfg.peft_type.eq_ignore_ascii_case("LORA") {
            return Err(PeftError::Unsupported(format!(
                "peft_type {} (only LORA is supported)",
                cfg.peft_type
            )));
        }
        if cfg.r == 0 {
            return Err(PeftError::Config("r must be at least 1".into()));
        }
        if let Some(TargetModules::Regex(r)) = &cfg.target_modules {
            Regex::new(r).map_err(|e| PeftError::Config(format!("target_modules regex: {e}")))?;
        }
        Ok(cfg)
    }

    /// Whether PEFT would put LoRA weights on `module` (full dotted name inside the model,
    /// e.g. `model.layers.0.self_attn.q_proj`).
    pub fn targets(&self, module: &str) -> bool {
        let Some(t) = &self.target_modules else {
            return false;
        };
        if let Some(ex) = &self.exclude_modules {
            if matches_targets(ex, module) {
                return false;
            }
        }
        matches_targets(t, module)
    }

    /// Rank of `module` (rank_pattern, else `r`).
    pub fn rank_for(&self, module: &str) -> u32 {
        pattern_match(&self.rank_pattern, module)
            .copied()
            .unwrap_or(self.r)
    }

    /// Alpha of `module` (alpha_pattern, else `lora_alpha`).
    pub fn alpha_for(&self, module: &str) -> f64 {
        pattern_match(&self.alpha_pattern, module)
            .copied()
            .unwrap_or(self.lora_alpha)
    }

    /// The LoRA scale of `module`: alpha/r, or alpha/sqrt(r) with rslora.
    pub fn scale_for(&self, module: &str) -> f64 {
        let r = self.rank_for(module) as f64;
        let alpha = self.alpha_for(module);
        if self.use_rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        }
    }

    /// The highest rank any module may have.
    pub fn max_rank(&self) -> u32 {
        self.rank_pattern
            .values()
            .copied()
            .chain([self.r])
            .max()
            .unwrap_or(self.r)
    }
}

/// Module name inside the model for an adapter tensor key:
/// `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` →
/// (`model.layers.0.self_attn.q_proj`, `lora_A.weight`). PEFT may insert an adapter name
/// (`lora_A.default.weight`); it is dropped.
pub fn split_adapter_key(key: &str) -> Option<(String, String)> {
    let key = key.strip_prefix("base_model.model.").unwrap_or(key);
    for part in [
        "lora_A",
        "lora_B",
        "lora_embedding_A",
        "lora_embedding_B",
        "lora_magnitude_vector",
    ] {
        if let Some(idx) = key.find(&format!(".{part}")) {
            let module = key[..idx].to_string();
            let rest = &key[idx + 1..];
            let rest = rest.replace(".default.", ".").replace(".default", "");
            return Some((module, rest));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: &str) -> AdapterConfig {
        AdapterConfig::from_json(json).unwrap()
    }

    #[test]
    fn list_targets_match_suffix_only_on_dot_boundary() {
        let c = cfg(r#"{"r":8,"lora_alpha":16,"target_modules":["q_proj","v_proj"]}"#);
        assert!(c.targets("model.layers.0.self_attn.q_proj"));
        assert!(c.targets("q_proj"));
        assert!(!c.targets("model.layers.0.self_attn.xq_proj"));
        assert!(!c.targets("model.layers.0.self_attn.k_proj"));
    }

    #[test]
    fn regex_targets_match_whole_name() {
        let c = cfg(r#"{"r":8,"lora_alpha":16,"target_modules":".*layers\\.1\\..*(q|v)_proj"}"#);
        assert!(c.targets("model.layers.1.self_attn.q_proj"));
        assert!(!c.targets("model.layers.0.self_attn.q_proj"));
    }

    #[test]
    fn scale_follows_rank_and_alpha_patterns_and_rslora() {
        let c = cfg(
            r#"{"r":8,"lora_alpha":16,"target_modules":["q_proj","v_proj"],
               "rank_pattern":{"v_proj":4},"alpha_pattern":{"v_proj":32}}"#,
        );
        assert_eq!(c.scale_for("model.layers.0.self_attn.q_proj"), 2.0);
        assert_eq!(c.scale_for("model.layers.0.self_attn.v_proj"), 8.0);
        assert_eq!(c.max_rank(), 8);
        let r = cfg(r#"{"r":16,"lora_alpha":16,"use_rslora":true,"target_modules":["q_proj"]}"#);
        assert_eq!(r.scale_for("q_proj"), 4.0);
    }

    #[test]
    fn refuses_non_lora_and_zero_rank() {
        assert!(AdapterConfig::from_json(r#"{"peft_type":"IA3","r":8,"lora_alpha":8}"#).is_err());
        assert!(AdapterConfig::from_json(r#"{"r":0,"lora_alpha":8}"#).is_err());
    }

    #[test]
    fn splits_adapter_keys() {
        assert_eq!(
            split_adapter_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
            Some((
                "model.layers.0.self_attn.q_proj".into(),
                "lora_A.weight".into()
            ))
        );
        assert_eq!(
            split_adapter_key("base_model.model.model.embed_tokens.lora_embedding_A.default"),
            Some(("model.embed_tokens".into(), "lora_embedding_A".into()))
        );
    }
}
