//! The runtime configuration the operator writes to a pool's ConfigMap (also the format of
//! `config/local.yaml`), which the worker reads.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::enums::{
    Dtype, ImageProcessor, ReasoningParser, ServingMode, ToolCallParser, WorkerMode,
};
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
    /// The pool's ready dynamic pods by name, with their base URL (`http://<pod IP>:<port>`):
    /// a pod forwards a request for an adapter placed elsewhere (`adapters[].pods`) to one that
    /// holds it. Written with the pool's `dynamic.placement` only.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub peers: std::collections::BTreeMap<String, String>,
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
    /// A canary version served beside this one to a share of the adapter's requests (the
    /// Adapter's `spec.canary`, while it is neither rolled back nor at weight 0). A worker
    /// that loads the adapter loads both versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<WorkerCanary>,
    /// The dynamic pods this adapter is placed on (the pool's `dynamic.placement`): they load
    /// it at once; every other pod registers it and reads it from disk on its first request,
    /// so no request fails for landing elsewhere. Empty: every pod loads it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
}

impl WorkerAdapter {
    /// Whether pod `pod` (None: unknown, as in local mode) loads this adapter at once.
    pub fn placed_on(&self, pod: Option<&str>) -> bool {
        self.pods.is_empty() || pod.is_some_and(|p| self.pods.iter().any(|x| x == p))
    }
}

/// A canary version of an adapter: loaded beside the stable version, it takes `weight`
/// percent of the adapter's requests. A request that names a session (the `x-session-id`
/// header, else the OpenAI `user` field) always gets the same version for the same weight; the
/// others are split by a counter, so the share is exact over any run of requests.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkerCanary {
    /// Its version (not the stable one's).
    pub version: String,
    /// Its PEFT adapter directory, relative to `modelRoot`.
    pub path: String,
    /// Percent of the adapter's requests it serves, 0 to 100.
    pub weight: u32,
}

/// The header that names a session for the canary split (ahead of the body's `user`).
pub const SESSION_HEADER: &str = "x-session-id";

/// Whether a request with session `key` (None: none named) goes to a canary at `weight`
/// percent of adapter `name`: a session's bucket is a stable hash of (adapter, key) in 0..100,
/// so a session stays on one version while the weight stays and a raised weight only moves
/// sessions from stable to canary; a request without a session takes the canary when the
/// running `count` of such requests crosses a multiple of `100 / weight`, which gives exactly
/// `weight` percent of every 100.
pub fn canary_pick(name: &str, weight: u32, key: Option<&str>, count: u64) -> bool {
    let weight = u64::from(weight.min(100));
    match key {
        Some(k) => session_bucket(name, k) < weight,
        None => (count + 1) * weight / 100 > count * weight / 100,
    }
}

/// The bucket (0..100) of session `key` for adapter `name`: FNV-1a, fixed so that every pod
/// and release puts a session in the same bucket.
pub fn session_bucket(name: &str, key: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes().chain([0xff]).chain(key.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // The low bits of FNV-1a are weak on short keys: fold the high half in.
    (h ^ (h >> 32)) % 100
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_canary_split_is_exact_without_sessions_and_sticky_with_them() {
        for weight in [0u32, 1, 10, 33, 50, 100] {
            let canary = (0..1000)
                .filter(|n| canary_pick("cal", weight, None, *n))
                .count();
            assert_eq!(canary as u32, weight * 10, "weight {weight}");
        }
        // Every 10 in a row carry exactly one canary at weight 10.
        for start in 0..50u64 {
            let c = (start..start + 10)
                .filter(|n| canary_pick("cal", 10, None, *n))
                .count();
            assert_eq!(c, 1, "from {start}");
        }
        // Sessions: the same answer every time, about `weight` percent of them, none at 0,
        // all at 100, and raising the weight only moves sessions to the canary.
        let keys: Vec<String> = (0..10_000).map(|i| format!("user-{i}")).collect();
        let share = |w: u32| {
            keys.iter()
                .filter(|k| canary_pick("cal", w, Some(k), 0))
                .count()
        };
        let s10 = share(10);
        assert!((900..=1100).contains(&s10), "{s10} of 10000 at weight 10");
        assert_eq!(share(0), 0);
        assert_eq!(share(100), keys.len());
        for k in &keys {
            let at10 = canary_pick("cal", 10, Some(k), 0);
            assert_eq!(at10, canary_pick("cal", 10, Some(k), 77), "{k}");
            assert!(!at10 || canary_pick("cal", 20, Some(k), 0), "{k}");
        }
    }
}
