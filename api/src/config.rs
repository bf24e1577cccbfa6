//! The runtime configuration the operator writes to a pool's ConfigMap (also the format of
//! `config/local.yaml`), which the worker reads.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::enums::{Dtype, ImageProcessor, ServingMode, WorkerMode};
use crate::limits::WorkerLimits;
use crate::router::RouterSpec;

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
    /// Router settings (the pool's `spec.router`, copied).
    #[serde(default)]
    pub router: RouterSpec,
    /// Limits (the pool's `spec.dynamic` engine limits, plus the request limits).
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
    /// Which of transformers' image processors a vision model's pixels equal (see the pool's
    /// `baseModel.imageProcessor`); ignored by text models.
    #[serde(default, skip_serializing_if = "ImageProcessor::is_default")]
    pub image_processor: ImageProcessor,
    /// The format of the model's tool calls (None: detected from the chat template, which
    /// names `<tool_call>` for the Hermes format of Qwen2.5, Qwen3 and QwQ). With no format,
    /// a request that sends `tools` is refused with 400 `tools_not_supported`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_parser: Option<ToolCallParser>,
    /// How the model's reasoning is marked (None: detected from the chat template, which
    /// names `</think>` for Qwen3 and QwQ): returned apart from the answer as
    /// `message.reasoning`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_parser: Option<ReasoningParser>,
}

/// A tool-call format the worker parses (vLLM's `--tool-call-parser` names).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallParser {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, QwQ, Hermes).
    Hermes,
}

/// A reasoning format the worker parses (vLLM's `--reasoning-parser` names).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningParser {
    /// `<think>...</think>` that the model opens itself (Qwen3; with `enable_thinking: false`
    /// the template closes it in the prompt).
    Qwen3,
    /// `...</think>` after a prompt that opens `<think>` (DeepSeek-R1, QwQ).
    DeepseekR1,
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
    /// What the router reads of it.
    #[serde(flatten)]
    pub routing: RoutingSignals,
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

/// What the router reads of an adapter. The `Adapter` CRD's spec and the worker's config carry
/// this one struct, so a signal added here reaches the worker without a copy in the operator.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoutingSignals {
    /// Label the router's classifier predicts for this adapter (unique in the pool).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// What the adapter does (embedding strategy and `/v1/models`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Example prompts (embedding strategy).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<String>,
    /// Task domains (routing signal and documentation).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domains: Vec<String>,
    /// Words that route a prompt here (keywords strategy).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keywords: Vec<String>,
    /// File extensions (e.g. `.ics`) that route a prompt here (keywords strategy).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<String>,
}

fn yes() -> bool {
    true
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
