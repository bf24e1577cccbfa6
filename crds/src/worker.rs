//! The contract between the operator and the worker: the runtime configuration the operator
//! writes to the pool's ConfigMap (also the format of `config/local.yaml`), and the adapter
//! listing the worker serves at `GET /v1/lora_adapters`.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::adapter::ServingMode;
use crate::pool::{Dtype, RouterFallback, RouterStrategy};

/// What a worker process is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum WorkerMode {
    /// A pool's shared pod: base model once, adapters switched per request.
    Dynamic,
    /// A merged adapter's pod: serves one merged model (`merged`).
    Merged,
    /// One process that does everything (development, single machine).
    #[default]
    Local,
}

/// Runtime configuration of a worker (JSON in the pool's ConfigMap, YAML or JSON locally).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerConfig {
    /// What this worker is.
    #[serde(default)]
    pub mode: WorkerMode,
    /// Pool name: also accepted as `model` in requests (then the router decides).
    pub pool: String,
    /// Every model/adapter path must resolve (symlinks included) inside this directory.
    /// Relative paths below are relative to it.
    #[serde(default = "default_model_root")]
    pub model_root: String,
    /// The base model.
    pub base_model: WorkerBaseModel,
    /// The merged model this worker serves (merged mode only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged: Option<MergedModel>,
    /// Adapters of the pool.
    #[serde(default)]
    pub adapters: Vec<WorkerAdapter>,
    /// Router settings.
    #[serde(default)]
    pub router: WorkerRouter,
    /// Limits.
    #[serde(default)]
    pub limits: WorkerLimits,
    /// API keys and admin token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<WorkerAuth>,
}

impl WorkerConfig {
    /// Content hash of the config: the operator stores it in the ConfigMap's
    /// `mole.dev/config-hash` annotation and sends it with `POST /admin/reload`; a worker
    /// whose file (re-read and parsed) has another hash answers 409 `config_stale`, because
    /// the kubelet refreshes a mounted ConfigMap up to a minute after it changed.
    ///
    /// Computed over the struct's own JSON serialization (field order fixed by the type, no
    /// maps), so the operator and the worker agree whatever `serde_json` features either
    /// binary was built with.
    pub fn content_hash(&self) -> String {
        let json = serde_json::to_string(self).expect("WorkerConfig serializes");
        hex::encode(&Sha256::digest(json.as_bytes())[..8])
    }
}

fn default_model_root() -> String {
    "/models".into()
}

/// The base model of a worker.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerBaseModel {
    /// Identity (adapters must name the same base).
    pub name: String,
    /// HF directory (or a `.gguf` file), relative to `modelRoot` or absolute inside it.
    pub path: String,
    /// Serving dtype of the weights (see the pool's `baseModel.dtype`; ignored for GGUF
    /// weights, which keep their quantization).
    #[serde(default)]
    pub dtype: Dtype,
}

/// The merged model served by a merged-mode worker.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MergedModel {
    /// Adapter baked into the weights (requests name it as `model`).
    pub adapter: String,
    /// Its version.
    pub version: String,
    /// Merged HF directory, relative to `modelRoot`.
    pub path: String,
}

/// One adapter of the pool as the worker sees it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerAdapter {
    /// Adapter name (requests name it as `model`).
    pub name: String,
    /// Version; a new version is loaded beside the old one, which is freed when its last
    /// request ends.
    pub version: String,
    /// Pool-wide id (stable across versions).
    pub lora_id: u32,
    /// PEFT adapter directory, relative to `modelRoot`.
    pub path: String,
    /// Classifier label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Example prompts (embedding router).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<String>,
    /// Domains.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domains: Vec<String>,
    /// Keywords (keywords router).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keywords: Vec<String>,
    /// File extensions (keywords router).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<String>,
    /// How it is served by the pool.
    #[serde(default)]
    pub mode: ServingMode,
    /// URL of the merged Service, when merged pods serve it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_endpoint: Option<String>,
    /// Whether this worker loads the adapter itself (false when it is served merged only).
    #[serde(default = "yes")]
    pub load: bool,
}

fn yes() -> bool {
    true
}

/// Router settings of a worker.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerRouter {
    /// Strategies in order.
    #[serde(default = "default_strategies")]
    pub strategies: Vec<RouterStrategy>,
    /// Adapter used as classifier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classifier_adapter: Option<String>,
    /// Lowest classifier probability accepted.
    #[serde(default = "default_min_confidence")]
    pub min_confidence: f64,
    /// Sentence-embedding model directory (relative to `modelRoot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_model: Option<String>,
    /// Lowest cosine similarity accepted.
    #[serde(default = "default_embedding_threshold")]
    pub embedding_threshold: f64,
    /// What to do with unrouted requests.
    #[serde(default)]
    pub fallback: RouterFallback,
    /// Forward merged adapters' requests to their merged pods.
    #[serde(default = "yes")]
    pub prefer_merged: bool,
    /// Serve merged adapters here while their pods are unavailable.
    #[serde(default = "yes")]
    pub fallback_to_dynamic: bool,
}

impl Default for WorkerRouter {
    fn default() -> Self {
        Self {
            strategies: default_strategies(),
            classifier_adapter: None,
            min_confidence: default_min_confidence(),
            embedding_model: None,
            embedding_threshold: default_embedding_threshold(),
            fallback: RouterFallback::Base,
            prefer_merged: true,
            fallback_to_dynamic: true,
        }
    }
}

fn default_strategies() -> Vec<RouterStrategy> {
    vec![RouterStrategy::Explicit, RouterStrategy::Keywords]
}
fn default_min_confidence() -> f64 {
    0.5
}
fn default_embedding_threshold() -> f64 {
    0.35
}

/// Limits of a worker.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerLimits {
    /// Adapters resident on the device.
    #[serde(default = "d_max_loras")]
    pub max_loras: u32,
    /// Adapters kept in host memory.
    #[serde(default = "d_max_cpu_loras")]
    pub max_cpu_loras: u32,
    /// Highest LoRA rank accepted.
    #[serde(default = "d_max_lora_rank")]
    pub max_lora_rank: u32,
    /// Precision adapter weights are held in; unset: the weights' dtype where the worker's
    /// kernels read it (see the pool's `dynamic.loraDtype`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_dtype: Option<crate::Dtype>,
    /// Sequences decoded together.
    #[serde(default = "d_max_batch")]
    pub max_batch_size: u32,
    /// Longest sequence in tokens.
    #[serde(default = "d_max_seq_len")]
    pub max_seq_len: u32,
    /// Waiting requests before 429.
    #[serde(default = "d_max_queue")]
    pub max_queue: u32,
    /// Highest `max_tokens` a request may ask for.
    #[serde(default = "d_max_tokens")]
    pub max_tokens: u32,
    /// Largest request body in bytes.
    #[serde(default = "d_max_body")]
    pub max_body_bytes: u64,
    /// Longest a request may take, in seconds.
    #[serde(default = "d_timeout")]
    pub request_timeout_seconds: u64,
}

impl Default for WorkerLimits {
    fn default() -> Self {
        Self {
            max_loras: d_max_loras(),
            max_cpu_loras: d_max_cpu_loras(),
            max_lora_rank: d_max_lora_rank(),
            lora_dtype: None,
            max_batch_size: d_max_batch(),
            max_seq_len: d_max_seq_len(),
            max_queue: d_max_queue(),
            max_tokens: d_max_tokens(),
            max_body_bytes: d_max_body(),
            request_timeout_seconds: d_timeout(),
        }
    }
}

fn d_max_loras() -> u32 {
    8
}
fn d_max_cpu_loras() -> u32 {
    32
}
fn d_max_lora_rank() -> u32 {
    64
}
fn d_max_batch() -> u32 {
    16
}
fn d_max_seq_len() -> u32 {
    4096
}
fn d_max_queue() -> u32 {
    256
}
fn d_max_tokens() -> u32 {
    2048
}
fn d_max_body() -> u64 {
    16 * 1024 * 1024
}
fn d_timeout() -> u64 {
    300
}

/// Where a worker finds its secrets (files, so a Kubernetes Secret can be mounted).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerAuth {
    /// File with API keys, one per line; requests need `Authorization: Bearer <key>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_keys_file: Option<String>,
    /// File with the admin token for load/unload/reload endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_token_file: Option<String>,
    /// File with the operator's token (a Secret the operator creates per pool). It is accepted
    /// on the endpoints the operator calls — `GET /v1/lora_adapters`, `POST /admin/reload`,
    /// `POST /v1/unload_lora_adapter` — whatever the API keys and admin token are, so readiness
    /// and reloads work on pools with `spec.auth` and without a user admin token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator_token_file: Option<String>,
}

/// Where an adapter's weights live in a worker.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
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
pub struct LoraAdapterInfo {
    /// Adapter name.
    pub name: String,
    /// Version.
    pub version: String,
    /// Pool-wide id.
    pub lora_id: u32,
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
}

/// Response of `GET /v1/lora_adapters`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
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
