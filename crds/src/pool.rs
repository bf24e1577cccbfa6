//! `InferencePool`: one base model served by a set of GPU pods.

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, ResourceRequirements, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use mole_api::{Dtype, EngineLimits, ImageProcessor, RouterSpec};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A base model served on a set of GPU pods. Dynamic pods hold the base once and switch
/// LoRA adapters per request; hot adapters can be merged into their own Deployments.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "mole.dev",
    version = "v1alpha1",
    kind = "InferencePool",
    plural = "inferencepools",
    // `inferencepools` is also the plural of the Gateway API Inference Extension's kind: these
    // short names (and the category) are unambiguous with both installed.
    shortname = "ipool",
    shortname = "mpool",
    shortname = "molepool",
    category = "mole",
    namespaced,
    status = "InferencePoolStatus",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.baseModel.name"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.readyDisplay"}"#,
    printcolumn = r#"{"name":"Adapters","type":"integer","jsonPath":".status.adapters.total"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Endpoint","type":"string","priority":1,"jsonPath":".status.endpoint"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The base model every adapter of this pool must be trained on.
    pub base_model: BaseModel,
    /// The volume holding the base model, adapters and merged outputs.
    pub storage: Storage,
    /// Container image with the `mole-worker` binary. Unset: the operator's default worker
    /// image, the CUDA one when `gpu.count` > 0 and the CPU one otherwise
    /// (`--worker-image-gpu` / `--worker-image-cpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("self != ''").message("image must not be empty"))]
    pub image: Option<String>,
    /// Image pull policy of worker and merge pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// GPU scheduling of the pool's pods.
    pub gpu: GpuSpec,
    /// CPU/memory (and extra) resources of each worker container. GPU requests are added from `gpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// The shared pods that serve adapters dynamically.
    #[serde(default)]
    pub dynamic: DynamicSpec,
    /// How the pool's Deployments (dynamic and merged) replace their pods in a rollout or
    /// rollback. Unset fields take the default for the pool's hardware: on GPU pools
    /// `maxSurge: 0, maxUnavailable: 1` (a full node pool has no GPU for a surge pod, so a
    /// surge would stall), on CPU pools `maxSurge: 1, maxUnavailable: 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
    /// How requests that do not name an adapter are routed.
    #[serde(default)]
    pub router: RouterSpec,
    /// Merge Jobs and merged versions.
    #[serde(default)]
    pub merge: PoolMergeSpec,
    /// API keys for the pool's HTTP API (optional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthSpec>,
    /// Secrets (in the pool's namespace) to pull the image with, for worker pods and merge
    /// Jobs alike (they run the same image).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
}

/// The base model of a pool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct BaseModel {
    /// Identity of the base model (e.g. `Qwen/Qwen3-VL-8B-Instruct`); adapters whose
    /// `base_model_name_or_path` differs are refused.
    #[schemars(length(max = 256))]
    #[x_kube(validation = Rule::new("self != ''").message("baseModel.name must not be empty"))]
    pub name: String,
    /// Directory of the HF checkpoint, relative to the storage mount path. With a `source`,
    /// the directory the weights are fetched into (`hf://`, `s3://`) or where the source
    /// claim is mounted (`pvc://`).
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("!self.startsWith('/') && !self.matches('(^|/)\\\\.\\\\.(/|$)')").message("baseModel.path must be relative and must not contain '..'"))]
    pub path: String,
    /// Where the weights come from: `hf://org/model[@revision]` (a branch or tag is pinned
    /// to its commit), `s3://bucket/prefix`, or `pvc://claim/path` (that claim mounted
    /// read-only at `path`). Fetched sources are pulled by the `fetch-model` init container
    /// of every pod (safetensors only, checksummed, resumed; a pod finding them already
    /// fetched starts at once). Unset: the weights are already at `path` on the pool's volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("self.startsWith('hf://') || self.startsWith('s3://') || self.startsWith('pvc://')").message("baseModel.source must be an hf://, s3:// or pvc:// URI"))]
    pub source: Option<String>,
    /// Secret whose keys become the fetch's environment: `HF_TOKEN` (and `HF_ENDPOINT`) for
    /// `hf://`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
    /// `AWS_ENDPOINT_URL` for `s3://`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
    /// Serving dtype of the weights. A GPU computes in it. A CPU holds `bf16` and `f16`
    /// weights as they are and computes in f32 over them (half the memory and half the bytes
    /// per decode step of f32; each value widens to f32 exactly).
    #[serde(default)]
    pub dtype: Dtype,
    /// For a vision-language base: which of transformers' Qwen2-VL image processors the pixels
    /// the model sees equal. `torchvision` (default) is the processor transformers 5 loads and
    /// vLLM serves these models with; `pil` is Qwen's `qwen-vl-utils` and the older default,
    /// for adapters trained on images resized with Pillow. Both resize with bicubic filters
    /// that round differently, so a model sees slightly different pixels from each.
    #[serde(default, skip_serializing_if = "ImageProcessor::is_default")]
    pub image_processor: ImageProcessor,
    /// The format of the model's tool calls, by vLLM's `--tool-call-parser` name: `hermes`
    /// (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Qwen2.5, Qwen3, QwQ,
    /// Hermes). Unset: detected from the chat template (one that names `<tool_call>` is
    /// Hermes); a pool whose format is neither set nor detected refuses requests that send
    /// `tools` (400 `tools_not_supported`). A name vLLM knows but mole does not parse
    /// (`mistral`, `llama3_json`, ...) is refused by the operator (`Valid=False`), never
    /// ignored. A string, not an enum, so that a pool written for vLLM is told why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub tool_call_parser: Option<String>,
    /// How the model marks its reasoning, by vLLM's `--reasoning-parser` name: `qwen3`
    /// (`<think>...</think>` the model opens; Qwen3) or `deepseek_r1` (the prompt opens
    /// `<think>`; DeepSeek-R1, QwQ). Returned apart from the answer as `message.reasoning`.
    /// Unset: detected from the chat template (one that names `</think>`). A name mole does
    /// not parse is refused by the operator (`Valid=False`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub reasoning_parser: Option<String>,
}

/// A Secret in the object's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// The volume with models, adapters and merged outputs.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Storage {
    /// Name of the PersistentVolumeClaim (ReadWriteMany when merged and dynamic pods share it).
    #[schemars(length(min = 1))]
    pub claim_name: String,
    /// Where the volume is mounted in every pod.
    #[serde(default = "default_mount_path")]
    pub mount_path: String,
}

fn default_mount_path() -> String {
    "/models".into()
}

/// GPU scheduling.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// Extended resource name of the GPU.
    #[serde(default = "default_gpu_resource")]
    pub resource_name: String,
    /// GPUs per pod (0 runs on CPU, for tests and small models).
    #[schemars(range(min = 0, max = 16))]
    pub count: u32,
    /// Node selector of the pool's pods (e.g. `nvidia.com/gpu.product`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of the pool's pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Affinity of the pool's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// PriorityClass of the serving pods (dynamic and merged), so they can preempt batch work
    /// on a full GPU node pool. Merge Jobs take `merge.priorityClassName` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// RuntimeClass of the serving pods (e.g. `nvidia` where the GPU Operator does not make the
    /// NVIDIA runtime the node's default). Merge Jobs need no GPU and run without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_class_name: Option<String>,
}

fn default_gpu_resource() -> String {
    "nvidia.com/gpu".into()
}

/// The shared dynamic pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct DynamicSpec {
    /// Number of dynamic pods; unset: 1. Leave it unset with `autoscaling`, which then owns the
    /// count (the operator stops applying `replicas` to the Deployment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: Option<i32>,
    /// Scale the dynamic pods on their queue: the operator creates a HorizontalPodAutoscaler
    /// (`autoscaling/v2`) for the `<pool>-dynamic` Deployment on the workers'
    /// `mole_requests_waiting` gauge, served by the custom metrics API (prometheus-adapter; the
    /// chart ships its rule, `autoscaling.prometheusAdapter.enabled`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,
    /// Load each adapter at once on a subset of the pods only (by its traffic), the others
    /// reading it from disk on its first request. Unset: every pod loads every adapter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<crate::fleet::PlacementSpec>,
    /// The engine limits of each dynamic pod (`maxLoras`, `maxSeqLen`, ...), copied as they are
    /// into the pods' WorkerConfig; defaults and bounds are the worker's own.
    #[serde(flatten)]
    pub limits: EngineLimits,
}

impl DynamicSpec {
    /// The replica count the operator applies to the dynamic Deployment: None when
    /// `autoscaling` owns it.
    pub fn applied_replicas(&self) -> Option<i32> {
        match self.autoscaling {
            Some(_) => None,
            None => Some(self.replicas.unwrap_or(1)),
        }
    }

    /// The fewest and the most dynamic pods the pool runs: `replicas` twice, or the
    /// autoscaler's bounds.
    pub fn replica_range(&self) -> (i32, i32) {
        match &self.autoscaling {
            Some(a) => (a.min_replicas, a.max_replicas),
            None => {
                let r = self.replicas.unwrap_or(1);
                (r, r)
            }
        }
    }
}

/// The HorizontalPodAutoscaler of the dynamic pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingSpec {
    /// The fewest dynamic pods (at least 1: the HPA cannot bring a pool back from 0).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 1000))]
    pub min_replicas: i32,
    /// The most dynamic pods (each takes `gpu.count` GPUs); at least `minReplicas`.
    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,
    /// Requests waiting per pod, on average (the workers' `mole_requests_waiting` gauge), above
    /// which the HPA adds pods.
    #[serde(default = "default_target_queue_depth")]
    #[schemars(range(min = 1, max = 10000))]
    pub target_queue_depth: i32,
    /// Seconds of lower recommendations the HPA waits for before it removes pods (a GPU pod
    /// is slow to come back: it loads the base model again).
    #[serde(default = "default_scale_down_window")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_down_stabilization_seconds: i32,
}

fn default_target_queue_depth() -> i32 {
    4
}

fn default_scale_down_window() -> i32 {
    600
}

fn one() -> i32 {
    1
}

/// The rolling-update strategy of the pool's Deployments, as in a Deployment's
/// `strategy.rollingUpdate`: each an integer or a percentage of the replicas (`"25%"`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct RolloutSpec {
    /// Pods created above the desired count during a rollout (rounded up). Needs a spare GPU
    /// in the node pool for each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<IntOrString>,
    /// Pods that may be unavailable during a rollout (rounded down). Must leave at least one
    /// pod serving when there are several replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<IntOrString>,
}

/// Merge Jobs of the pool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolMergeSpec {
    /// Resources of merge Job containers (merging streams shard by shard: the largest shard
    /// plus the adapter plus ~256 MiB of memory is enough).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Node selector of merge Jobs (merging needs no GPU).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of merge Jobs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// PriorityClass of merge Jobs. Not `gpu.priorityClassName`: a merge is batch work that
    /// should not preempt serving pods (the previous version keeps serving while it waits), so
    /// unset it gets the cluster's default priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Previous merged versions kept besides the active one (for instant rollback).
    #[serde(default = "default_keep_versions")]
    #[schemars(range(min = 0, max = 20))]
    pub keep_versions: u32,
    /// Adapters whose `spec.evaluation.accuracy` is below this are served dynamically only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub min_accuracy: Option<f64>,
    /// Retries of a failed merge Job pod.
    #[serde(default = "default_backoff_limit")]
    #[schemars(range(min = 0, max = 10))]
    pub backoff_limit: i32,
    /// Longest a merge Job may run.
    #[serde(default = "default_active_deadline")]
    #[schemars(range(min = 60))]
    pub active_deadline_seconds: i64,
    /// Unload a merged adapter from the dynamic pods once its merged pods are ready.
    #[serde(default)]
    pub unload_from_dynamic: bool,
    /// Traffic-driven merge-down of `serving.mode: auto` adapters. Unset: `auto` merges an
    /// adapter when `minAccuracy` is set and its accuracy passes, whatever its traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic: Option<crate::fleet::TrafficMergeSpec>,
    /// Scale the merged Deployments of idle adapters to zero: their requests fall back to the
    /// dynamic pods, and they scale back up when requests return. Unset: merged pods run
    /// whatever their traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_to_zero: Option<crate::fleet::ScaleToZeroSpec>,
}

impl Default for PoolMergeSpec {
    fn default() -> Self {
        Self {
            resources: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            priority_class_name: None,
            keep_versions: default_keep_versions(),
            min_accuracy: None,
            backoff_limit: default_backoff_limit(),
            active_deadline_seconds: default_active_deadline(),
            unload_from_dynamic: false,
            traffic: None,
            scale_to_zero: None,
        }
    }
}

fn default_keep_versions() -> u32 {
    2
}
fn default_backoff_limit() -> i32 {
    2
}
fn default_active_deadline() -> i64 {
    3600
}

/// API keys of the pool's HTTP API.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuthSpec {
    /// Secret in the pool's namespace holding the keys, one per line.
    #[schemars(length(min = 1))]
    pub secret_name: String,
    /// Key of the Secret with the API keys.
    #[serde(default = "default_auth_key")]
    pub key: String,
    /// Key of the Secret with the admin token that enables `/v1/load_lora_adapter` and friends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_token_key: Option<String>,
    /// Who shares the pods' prefix cache. `apiKey` (the default): each API key caches its own
    /// prompts, so a key holder cannot learn another's prompt from the tokens its own requests
    /// find cached (`usage.prompt_tokens_details.cached_tokens`). `pool`: every key shares one
    /// cache, for callers that trust each other (more hits on a system prompt they all send).
    #[serde(
        default,
        skip_serializing_if = "mole_api::PrefixCacheScope::is_default"
    )]
    pub prefix_cache_scope: mole_api::PrefixCacheScope,
}

fn default_auth_key() -> String {
    "api-keys".into()
}

/// Lifecycle phase of a pool.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum PoolPhase {
    /// Children are being created.
    #[default]
    Pending,
    /// Pods are rolling or not all ready.
    Progressing,
    /// Every desired pod is ready.
    Ready,
    /// The spec is invalid or children cannot be created.
    Failed,
}

/// Observed state of a pool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: PoolPhase,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Dynamic pods.
    #[serde(default)]
    pub dynamic: ReplicaStatus,
    /// `ready/desired` of the dynamic pods, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_display: Option<String>,
    /// Merged Deployments of this pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged: Vec<MergedDeploymentStatus>,
    /// Adapter counts.
    #[serde(default)]
    pub adapters: AdapterCounts,
    /// Next LoRA id to hand out. Ids start at 1 and are never reused; allocation updates this
    /// field with the object's resourceVersion so concurrent writers conflict instead of sharing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_lora_id: Option<u32>,
    /// Ids handed out, by adapter name (so a crash between allocation and the Adapter's status
    /// write never hands the same adapter a second id).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lora_ids: BTreeMap<String, u32>,
    /// In-cluster URL of the pool's Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Conditions (`Ready`, `Valid`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Replica counts of a Deployment.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// Desired replicas.
    #[serde(default)]
    pub replicas: i32,
    /// Ready replicas.
    #[serde(default)]
    pub ready_replicas: i32,
}

/// One merged Deployment of the pool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MergedDeploymentStatus {
    /// Adapter name.
    pub adapter: String,
    /// Version served.
    pub version: String,
    /// Desired replicas.
    #[serde(default)]
    pub replicas: i32,
    /// Ready replicas.
    #[serde(default)]
    pub ready_replicas: i32,
    /// In-cluster URL of the merged Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
}

/// Adapter counts of a pool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterCounts {
    /// Adapters registered in the pool.
    #[serde(default)]
    pub total: u32,
    /// Adapters Ready.
    #[serde(default)]
    pub ready: u32,
}
