//! `InferencePool`: one base model served by a set of GPU pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A base model served on a set of GPU pods. Dynamic pods hold the base once and switch
/// LoRA adapters per request; hot adapters can be merged into their own Deployments.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "mole.dev",
    version = "v1alpha1",
    kind = "InferencePool",
    plural = "inferencepools",
    shortname = "ipool",
    shortname = "pools",
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
    /// Container image with the `mole-worker` binary.
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("self != ''").message("image must not be empty"))]
    pub image: String,
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
    /// How requests that do not name an adapter are routed.
    #[serde(default)]
    pub router: RouterSpec,
    /// Merge Jobs and merged versions.
    #[serde(default)]
    pub merge: PoolMergeSpec,
    /// API keys for the pool's HTTP API (optional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthSpec>,
}

/// Numeric type of model weights.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bfloat16 (the default for GPU serving).
    #[default]
    Bf16,
    /// IEEE half precision.
    F16,
    /// single precision.
    F32,
}

impl Dtype {
    /// The lowercase name used on the command line and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
        }
    }
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
    /// Directory of the HF checkpoint, relative to the storage mount path.
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("!self.startsWith('/') && !self.matches('(^|/)\\\\.\\\\.(/|$)')").message("baseModel.path must be relative and must not contain '..'"))]
    pub path: String,
    /// Serving dtype of the weights. A GPU computes in it. A CPU holds `bf16` and `f16`
    /// weights as they are and computes in f32 over them (half the memory and half the bytes
    /// per decode step of f32; each value widens to f32 exactly).
    #[serde(default)]
    pub dtype: Dtype,
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
}

fn default_gpu_resource() -> String {
    "nvidia.com/gpu".into()
}

/// The shared dynamic pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DynamicSpec {
    /// Number of dynamic pods.
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
    /// Adapters resident on the device at once.
    #[serde(default = "default_max_loras")]
    #[schemars(range(min = 1, max = 1024))]
    pub max_loras: u32,
    /// Adapters kept in host memory (LRU) besides the device-resident ones.
    #[serde(default = "default_max_cpu_loras")]
    #[schemars(range(min = 0, max = 4096))]
    pub max_cpu_loras: u32,
    /// Highest LoRA rank accepted.
    #[serde(default = "default_max_lora_rank")]
    #[schemars(range(min = 1, max = 512))]
    pub max_lora_rank: u32,
    /// Precision the dynamic pods hold adapter weights in, as vLLM's `--lora-dtype`. Unset:
    /// `baseModel.dtype`, except f16 weights on the CPU (adapters in f32 there; a GGUF base:
    /// f32). `bf16` (the default over bf16 weights) halves adapters' memory (device slots and
    /// the `maxCpuLoras` host tier) and the bytes a decode step reads per distinct adapter in
    /// its batch, at the price of rounding each weight to bf16 (8 significant bits), as the
    /// base weights already are; `f32` keeps them exactly as PEFT trained them. On the CPU
    /// `f32` and `bf16` run the fused kernels; `f16` runs tensor ops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "lora_dtype_schema")]
    pub lora_dtype: Option<Dtype>,
    /// Sequences decoded together.
    #[serde(default = "default_max_batch")]
    #[schemars(range(min = 1, max = 1024))]
    pub max_batch_size: u32,
    /// Longest sequence (prompt + generation) in tokens.
    #[serde(default = "default_max_seq_len")]
    #[schemars(range(min = 16, max = 1048576))]
    pub max_seq_len: u32,
    /// Requests waiting for a batch slot before new ones get 429.
    #[serde(default = "default_max_queue")]
    #[schemars(range(min = 0, max = 100000))]
    pub max_queue: u32,
}

impl Default for DynamicSpec {
    fn default() -> Self {
        Self {
            replicas: 1,
            max_loras: default_max_loras(),
            max_cpu_loras: default_max_cpu_loras(),
            max_lora_rank: default_max_lora_rank(),
            lora_dtype: None,
            max_batch_size: default_max_batch(),
            max_seq_len: default_max_seq_len(),
            max_queue: default_max_queue(),
        }
    }
}

/// The schema of `loraDtype` without a reference to [`Dtype`]: kube's hoisting of an optional
/// enum would keep the enum's description ("Numeric type of model weights.") over the field's
/// doc.
fn lora_dtype_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["bf16", "f16", "f32"],
        "nullable": true,
    })
}

fn one() -> i32 {
    1
}
fn default_max_loras() -> u32 {
    8
}
fn default_max_cpu_loras() -> u32 {
    32
}
fn default_max_lora_rank() -> u32 {
    64
}
fn default_max_batch() -> u32 {
    16
}
fn default_max_seq_len() -> u32 {
    4096
}
fn default_max_queue() -> u32 {
    256
}

/// A routing strategy, tried in the order given.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RouterStrategy {
    /// The request names the adapter (`model`, `adapter` or `expert`).
    Explicit,
    /// The classifier adapter scores each adapter label in one forward pass.
    Classifier,
    /// Adapter keywords and file extensions found in the prompt.
    Keywords,
    /// Embedding similarity against each adapter's description and examples.
    Embedding,
}

/// What happens to a request no strategy could route.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
#[serde(rename_all = "lowercase")]
pub enum RouterFallback {
    /// Serve it with the base model, no adapter.
    #[default]
    Base,
    /// Refuse it with 422.
    Reject,
}

/// The router of the pool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!('classifier' in self.strategies) || has(self.classifierAdapter)").message("router.classifierAdapter is required when router.strategies contains classifier"))]
#[x_kube(validation = Rule::new("!('embedding' in self.strategies) || has(self.embeddingModel)").message("router.embeddingModel is required when router.strategies contains embedding"))]
pub struct RouterSpec {
    /// Strategies in the order they are tried.
    #[serde(default = "default_strategies")]
    #[schemars(length(max = 4))]
    #[x_kube(validation = Rule::new("self.all(s, self.exists_one(t, t == s))").message("router.strategies must not repeat a strategy"))]
    pub strategies: Vec<RouterStrategy>,
    /// Name of the Adapter used as classifier (required with the classifier strategy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub classifier_adapter: Option<String>,
    /// Lowest classifier probability accepted; below it the next strategy is tried.
    #[serde(default = "default_min_confidence")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub min_confidence: f64,
    /// Directory of the sentence-embedding model on the volume (required with the embedding strategy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub embedding_model: Option<String>,
    /// Lowest cosine similarity accepted by the embedding strategy.
    #[serde(default = "default_embedding_threshold")]
    #[schemars(range(min = -1.0, max = 1.0))]
    pub embedding_threshold: f64,
    /// What to do when no strategy routes a request.
    #[serde(default)]
    pub fallback: RouterFallback,
    /// Forward requests for merged adapters to their merged pods.
    #[serde(default = "yes")]
    pub prefer_merged: bool,
    /// Serve a merged adapter dynamically while its merged pods are unavailable.
    #[serde(default = "yes")]
    pub fallback_to_dynamic: bool,
}

impl Default for RouterSpec {
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
fn yes() -> bool {
    true
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
}

impl Default for PoolMergeSpec {
    fn default() -> Self {
        Self {
            resources: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            keep_versions: default_keep_versions(),
            min_accuracy: None,
            backoff_limit: default_backoff_limit(),
            active_deadline_seconds: default_active_deadline(),
            unload_from_dynamic: false,
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
