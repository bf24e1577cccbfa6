//! The worker's adapter listing (`GET /v1/lora_adapters`), which the operator reads to decide
//! readiness.

use serde::{Deserialize, Serialize};

/// Where an adapter's weights live in a worker.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Residency {
    /// In a device slot in GPU memory.
    Gpu,
    /// In host memory (the device slots of a CPU worker, or a GPU worker's host LRU).
    Cpu,
    /// Known but not in memory.
    Disk,
}

/// One adapter version known to a worker (`GET /v1/lora_adapters`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LoraAdapterInfo {
    /// Adapter name.
    pub name: String,
    /// Version.
    pub version: String,
    /// Pool-wide id.
    pub lora_id: u32,
    /// The directory its weights were read from, as the worker resolved it inside its model
    /// root (absent for merged weights and from workers before 0.1.1): a new source under the
    /// same version is a new load, and the operator reads Ready from this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Where its weights are.
    pub residency: Residency,
    /// Whether it can serve requests now.
    pub loaded: bool,
    /// LoRA rank (highest over modules).
    pub rank: u32,
    /// Bytes of adapter weights in memory.
    pub bytes: u64,
    /// Requests served (completed) with this version.
    pub requests: u64,
    /// Requests running now with this version.
    pub running: u64,
    /// Why it could not be loaded, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Loaded, but with something to look at: its `base_model_name_or_path` names another
    /// model than the pool's though its shapes fit (a local training path, a renamed copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// Response of `GET /v1/lora_adapters`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LoraAdaptersResponse {
    /// `"list"`, as OpenAI lists are.
    pub object: String,
    /// Base model name.
    pub base_model: String,
    /// Every adapter version the worker knows.
    pub data: Vec<LoraAdapterInfo>,
}

impl LoraAdaptersResponse {
    /// Whether `name` at `version` is loaded and can serve.
    pub fn is_loaded(&self, name: &str, version: &str) -> bool {
        self.data
            .iter()
            .any(|a| a.name == name && a.version == version && a.loaded)
    }
}
