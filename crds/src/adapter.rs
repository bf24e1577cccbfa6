//! `Adapter`: one versioned LoRA adapter of a pool.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use mole_api::{Dtype, RoutingSignals, ServingMode};

/// A versioned LoRA adapter served by an `InferencePool`, dynamically or merged into its own pods.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "mole.dev",
    version = "v1alpha1",
    kind = "Adapter",
    plural = "adapters",
    shortname = "lora",
    category = "mole",
    namespaced,
    status = "AdapterStatus",
    derive = "PartialEq",
    printcolumn = r#"{"name":"Pool","type":"string","jsonPath":".spec.pool"}"#,
    printcolumn = r#"{"name":"Version","type":"string","jsonPath":".spec.version"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".status.servingMode"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Lora-ID","type":"integer","jsonPath":".status.loraId"}"#,
    printcolumn = r#"{"name":"Active","type":"string","priority":1,"jsonPath":".status.activeVersion"}"#,
    printcolumn = r#"{"name":"Endpoint","type":"string","priority":1,"jsonPath":".status.endpoint"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AdapterSpec {
    /// Name of the InferencePool (same namespace) that serves this adapter. Immutable: the
    /// adapter's merged pods, Jobs and outputs belong to that pool, so moving it is a delete
    /// and a create (the finalizer then cleans up after the old pool).
    #[schemars(length(max = 253))]
    #[x_kube(validation = Rule::new("self != ''").message("pool must not be empty"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("pool is immutable: to move the adapter to another pool, delete it and create it again naming that pool"))]
    pub pool: String,
    /// Version of the adapter. Changing it rolls forward; setting it back to a version kept in
    /// `status.history` rolls back without a new merge.
    #[schemars(length(max = 128))]
    #[x_kube(validation = Rule::new("self != ''").message("version must not be empty"))]
    pub version: String,
    /// Where the adapter files are.
    pub source: AdapterSource,
    /// Routing signals: classifier label (unique in the pool), description, examples,
    /// domains, keywords and file extensions.
    #[serde(flatten)]
    pub routing: RoutingSignals,
    /// How the adapter is served.
    #[serde(default)]
    pub serving: ServingSpec,
    /// Merge settings (merged mode).
    #[serde(default)]
    pub merge: AdapterMergeSpec,
    /// Offline evaluation results (gate for merging).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<Evaluation>,
    /// A canary version served beside `version` to a share of the requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<crate::fleet::CanarySpec>,
}

/// Location of the adapter files.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterSource {
    /// Directory with `adapter_config.json` and `adapter_model.safetensors`, relative to the
    /// pool's storage mount path (with a `uri`, the directory the fetch writes into).
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("self != '' && !self.startsWith('/') && !self.matches('(^|/)\\\\.\\\\.(/|$)')").message("source.path must be relative and must not contain '..'"))]
    pub path: String,
    /// Where the files come from: `hf://org/adapter[@revision]` or `s3://bucket/prefix`. A
    /// fetch Job per version writes them into `path` on the pool's volume before the adapter
    /// is loaded. Unset: they are already at `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    #[x_kube(validation = Rule::new("self.startsWith('hf://') || self.startsWith('s3://')").message("source.uri must be an hf:// or s3:// URI"))]
    pub uri: Option<String>,
    /// Secret whose keys become the fetch Job's environment (`HF_TOKEN`, `AWS_*`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<crate::pool::SecretRef>,
}

/// How an adapter is served.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServingSpec {
    /// Serving mode.
    #[serde(default)]
    pub mode: ServingMode,
    /// Replicas of the merged Deployment.
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
}

impl Default for ServingSpec {
    fn default() -> Self {
        Self {
            mode: ServingMode::Dynamic,
            replicas: 1,
        }
    }
}

fn one() -> i32 {
    1
}

/// Merge settings of an adapter.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterMergeSpec {
    /// Check every merged tensor for NaN/Inf and fail naming the module.
    #[serde(default = "yes")]
    pub safe_merge: bool,
    /// Dtype of the merged weights (default: the base's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// Quantize the merged model after the merge: the merge Job runs `mole-worker merge
    /// --quantize`, writes only the quantized model (GGUF blocks), and the merged Deployment
    /// serves it. Its drift against the dense merge (mean next-token KL divergence on a fixed
    /// prompt set) is written in the output's `quantize_metadata.json`; above `maxDrift` the
    /// Job fails and the adapter keeps its previous version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize: Option<MergeQuantize>,
}

impl Default for AdapterMergeSpec {
    fn default() -> Self {
        Self {
            safe_merge: true,
            dtype: None,
            quantize: None,
        }
    }
}

/// Quantization after the merge.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MergeQuantize {
    /// Block type (llama.cpp's): `q8_0`, `q4_0`, `q4_1`, `q4_k`, `q5_k` or `q6_k`. Norms and
    /// biases stay f32 and the output head is q6_k (q8_0 with `q8_0`), as llama.cpp does.
    #[serde(rename = "type")]
    pub quant_type: QuantizeType,
    /// Highest mean next-token KL divergence (nats) against the dense merge that is served;
    /// above it the merge Job fails with `drift_over_bound`. Unset: measured and recorded,
    /// never refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_drift: Option<f64>,
}

/// The block types `mole-worker quantize` writes.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum QuantizeType {
    /// 8-bit blocks of 32 (8.5 bits per weight).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 4-bit blocks of 32 with a scale (4.5 bits per weight).
    #[serde(rename = "q4_0")]
    Q4_0,
    /// 4-bit blocks of 32 with a scale and a minimum (5 bits per weight).
    #[serde(rename = "q4_1")]
    Q4_1,
    /// 4-bit k-quant (4.5 bits per weight).
    #[serde(rename = "q4_k")]
    Q4K,
    /// 5-bit k-quant (5.5 bits per weight).
    #[serde(rename = "q5_k")]
    Q5K,
    /// 6-bit k-quant (6.56 bits per weight).
    #[serde(rename = "q6_k")]
    Q6K,
}

impl QuantizeType {
    /// The name `mole-worker quantize --type` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            QuantizeType::Q8_0 => "q8_0",
            QuantizeType::Q4_0 => "q4_0",
            QuantizeType::Q4_1 => "q4_1",
            QuantizeType::Q4K => "q4_k",
            QuantizeType::Q5K => "q5_k",
            QuantizeType::Q6K => "q6_k",
        }
    }
}

fn yes() -> bool {
    true
}

/// Offline evaluation of an adapter.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Evaluation {
    /// Task accuracy in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub accuracy: Option<f64>,
}

/// Lifecycle phase of an adapter.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum AdapterPhase {
    /// Accepted, not serving yet.
    #[default]
    Pending,
    /// A merge Job runs.
    Merging,
    /// Serving as asked: every ready pod reports the active version loaded.
    Ready,
    /// Serving, but not as asked (e.g. a failed merge while the previous version serves).
    Degraded,
    /// Not serving: the spec is invalid or nothing could be loaded.
    Failed,
}

/// One version in an adapter's history.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VersionRecord {
    /// Adapter version.
    pub version: String,
    /// Source path of that version.
    pub source: String,
    /// LoRA id it was served with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_id: Option<u32>,
    /// Merged output directory (relative to the mount path), when it was merged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_output: Option<String>,
    /// When it became active (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
}

/// The merge of the desired version.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MergeStatus {
    /// Name of the merge Job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// Output directory, relative to the mount path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// When the Job succeeded (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<String>,
    /// Failed attempts for the current hash (drives the capped backoff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failures: Option<u32>,
    /// When the last attempt failed (RFC 3339); the next one waits for the backoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_at: Option<String>,
    /// The merge tool's reason for the last failure (from the pod's termination message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure_reason: Option<String>,
    /// The uid of the failed Job last counted in `failures`: a failed Job is counted once,
    /// and kept until its backoff ran out, so a reconcile reading an older copy of this
    /// status counts the same Job to the same number instead of starting a new one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_job_uid: Option<String>,
}

/// Observed state of an adapter.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: AdapterPhase,
    /// Id of the adapter in its pool: allocated once, never reused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_id: Option<u32>,
    /// How it is served now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_mode: Option<ServingMode>,
    /// The version serving now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_version: Option<String>,
    /// Active version first, then previous versions kept for rollback.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<VersionRecord>,
    /// Merge of the desired version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merge: Option<MergeStatus>,
    /// Merged outputs that fell out of the history and were handed to a cleanup Job (the
    /// most recent last, at most 32). A merge whose output is listed here is never taken as
    /// done: a rollback to that version merges again into a new directory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pruned_outputs: Vec<String>,
    /// URL that serves this adapter (the merged Service, or the pool's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Whether the pool's dynamic pods hold this adapter, as the operator's merge-down plan
    /// decided (false only once merged pods serve it and the pool's
    /// `merge.unloadFromDynamic` is set). The pool's WorkerConfig follows it; absent means yes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_dynamic: Option<bool>,
    /// The merged Service the dynamic pods forward this adapter's requests to, while merged
    /// pods serve it (the pool's WorkerConfig follows it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged_endpoint: Option<String>,
    /// The fetch (hash of `source.uri`, `source.path` and version) whose Job succeeded. The
    /// pool's pods load an adapter with a `source.uri` only once this matches its spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetched: Option<String>,
    /// The uid of the fetch Job whose success `fetched` records. A fetch Job counts only when
    /// it was started after that one (its `mole.dev/fetched-after` annotation names it): a Job
    /// of an earlier fetch into the same path, kept for a day, is never taken for the files
    /// there now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetched_job_uid: Option<String>,
    /// Live traffic, read from the pods that serve it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic: Option<crate::fleet::TrafficStatus>,
    /// The traffic-driven merge-down's state (an `auto` adapter of a pool with
    /// `merge.traffic`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<crate::fleet::FleetStatus>,
    /// The canary version's state, while `spec.canary` names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<crate::fleet::CanaryStatus>,
    /// Conditions (`Ready`, `Valid`, `Fetched`, `Loaded`, `Merged`, `MergeGated`, `Degraded`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}
