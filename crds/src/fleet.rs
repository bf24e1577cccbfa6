//! The fleet policy's settings (a pool's `merge.traffic`) and what it records in an Adapter's
//! status (`traffic`, `fleet`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Traffic-driven merge-down of the pool's `serving.mode: auto` adapters: an adapter gets its
/// own merged Deployment when its share of the pool's generated tokens stays at or above
/// `promoteShare` for `windowSeconds`, and goes back to the dynamic pods when it stays below
/// `demoteShare` as long; no adapter changes twice within `minHoldSeconds`; merged Deployments
/// of `auto` adapters take at most `maxMergedGpus` GPUs, given to the adapters with the most
/// tokens per GPU first. `merge.minAccuracy`, when set, still gates every promotion.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrafficMergeSpec {
    /// Share of the pool's tokens (0-1) at or above which an adapter is promoted.
    #[serde(default = "default_promote_share")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub promote_share: f64,
    /// Share below which a merged adapter is demoted; less than `promoteShare`.
    #[serde(default = "default_demote_share")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub demote_share: f64,
    /// Seconds a share must stay beyond its threshold; also the smoothing window of the
    /// measured rates.
    #[serde(default = "default_window")]
    #[schemars(range(min = 0, max = 86400))]
    pub window_seconds: i64,
    /// Shortest time between two changes of one adapter.
    #[serde(default = "default_hold")]
    #[schemars(range(min = 0, max = 604800))]
    pub min_hold_seconds: i64,
    /// GPUs the merged Deployments of `auto` adapters may take together (each takes
    /// `serving.replicas` × `gpu.count`, at least 1).
    #[schemars(range(min = 0, max = 10000))]
    pub max_merged_gpus: u32,
    /// What the pool's pods serve, measured on its hardware (`mole-bench decode
    /// --service-model FILE` gives both figures). With it, merging must earn its GPUs: an
    /// adapter is promoted only while its traffic occupies at least 1.2× the GPUs of its merged
    /// Deployment in dynamic capacity, and demoted once under 0.8× for `windowSeconds`. Unset:
    /// the shares alone decide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<MergeCapacity>,
}

/// A pool's serving capacity for the merge policy's earn check.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MergeCapacity {
    /// Tokens per second one merged pod (per GPU) generates at the pool's `maxBatchSize`.
    #[schemars(range(min = 0.001, max = 1000000.0))]
    pub merged_tokens_per_second: f64,
    /// One dynamic adapter's decode rate ÷ merged at that batch size.
    #[schemars(range(min = 0.01, max = 1.5))]
    pub dynamic_ratio: f64,
}

/// Scale to zero of merged Deployments (a pool's `merge.scaleToZero`): an adapter served by
/// merged pods that had no request for `idleSeconds` is loaded into the dynamic pods again, and
/// once every ready dynamic pod holds it its merged Deployment goes to 0 replicas (kept, with
/// its merged output, so it comes back without a merge). A request for it then runs on the
/// dynamic pods, and the Deployment scales back to `serving.replicas`; the dynamic pods serve
/// until its pods are ready.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScaleToZeroSpec {
    /// Seconds without a request after which merged pods are scaled to zero.
    #[serde(default = "default_idle")]
    #[schemars(range(min = 60, max = 604800))]
    pub idle_seconds: i64,
}

/// Placement of adapters on the dynamic pods (a pool's `dynamic.placement`): each adapter is
/// loaded at once only by a subset of the pods, chosen by rendezvous hashing with bounded load
/// and replicated by its traffic (one replica per pod's fair share of the pool's tokens, at
/// least `minReplicas`); a pod holds at most `loadFactor` times the mean number of adapters,
/// and at most `maxLoras + maxCpuLoras`. The other pods know the adapter and read it from disk
/// on its first request. Unset: every pod loads every adapter.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlacementSpec {
    /// Fewest pods an adapter is loaded on (2: a pod's restart never leaves it cold).
    #[serde(default = "default_min_replicas")]
    #[schemars(range(min = 1, max = 1000))]
    pub min_replicas: u32,
    /// No pod holds more than this times the mean number of adapters per pod (above 1).
    #[serde(default = "default_load_factor")]
    #[schemars(range(min = 1.0, max = 10.0))]
    pub load_factor: f64,
}

fn default_min_replicas() -> u32 {
    2
}
fn default_load_factor() -> f64 {
    1.25
}

fn default_idle() -> i64 {
    1800
}

fn default_promote_share() -> f64 {
    0.10
}
fn default_demote_share() -> f64 {
    0.04
}
fn default_window() -> i64 {
    300
}
fn default_hold() -> i64 {
    900
}

/// Live traffic of an adapter, read from the pods that serve it (dynamic and merged), smoothed
/// over the pool's `merge.traffic.windowSeconds` (300 s without it), written at most once per
/// tenth of that window (1 to 30 s) and only when a rate moved by 20%, the pods holding it
/// changed, or 10 minutes passed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrafficStatus {
    /// Requests completed per minute.
    pub requests_per_minute: f64,
    /// Tokens generated per minute.
    pub tokens_per_minute: f64,
    /// Share of requests that succeeded (absent with too few requests to tell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success_rate: Option<f64>,
    /// Median latency, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p50_ms: Option<f64>,
    /// 95th percentile latency, milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p95_ms: Option<f64>,
    /// Last time a request of it ran (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_used: Option<String>,
    /// Dynamic pods that hold it loaded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    /// Whether merged pods serve it.
    #[serde(default)]
    pub merged: bool,
    /// When these figures were written (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
}

/// The traffic-driven merge-down's state of an `auto` adapter (pool with `merge.traffic`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetStatus {
    /// Whether the policy wants it merged.
    pub merged: bool,
    /// When it last changed between merged and dynamic (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Since when its share has stayed at or above `promoteShare` (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub above_since: Option<String>,
    /// Since when its share has stayed below `demoteShare` (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub below_since: Option<String>,
    /// Its share of the pool's tokens at the last decision.
    pub share: f64,
    /// The last decision's reason (`TrafficPromoted`, `Rising`, `BudgetExhausted`...).
    pub reason: String,
    /// The numbers behind it.
    pub message: String,
}

/// A canary version of an adapter (`spec.canary`): served beside `spec.version` to `weight`
/// percent of the adapter's requests, sticky per session (a request's `x-session-id` header,
/// else its OpenAI `user` field). Promote it by an apply that makes it `spec.version` (and its
/// source `spec.source`) and drops `canary`; roll it back by an apply that drops `canary` (or
/// sets `weight: 0`). With `analysis`, the operator rolls it back by itself when it is worse
/// than the stable version beyond the bounds, as Flagger and Argo Rollouts analyse a canary.
///
/// In merged mode the stable version's share goes to its merged pods and the canary's share is
/// served by the pool's dynamic pods, which load the canary version (it has no merged pods of
/// its own until it is promoted). The split is made where requests enter the pool (its
/// Service): clients that call the merged Service directly bypass it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CanarySpec {
    /// The canary's version (not `spec.version`).
    #[schemars(length(max = 128))]
    pub version: String,
    /// Where the canary's files are, relative to the pool's storage mount path (already on the
    /// volume: a canary is not fetched).
    pub source: CanarySource,
    /// Percent of the adapter's requests the canary serves.
    #[schemars(range(min = 0, max = 100))]
    pub weight: u32,
    /// Automatic rollback: the bounds the canary is held to against the stable version
    /// (none: only an apply promotes or rolls it back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analysis: Option<CanaryAnalysis>,
}

/// Where a canary version's files are.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CanarySource {
    /// Directory with `adapter_config.json` and `adapter_model.safetensors`, relative to the
    /// pool's storage mount path; not the stable version's.
    #[schemars(length(max = 1024))]
    pub path: String,
}

/// The bounds of a canary's automatic rollback: once the canary has served `minRequests`, it
/// is rolled back when its error rate is above the stable version's by more than
/// `maxErrorRateIncrease`, or its p95 latency is above `maxLatencyRatio` times the stable
/// version's. Counts are the pods' since each version was loaded.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CanaryAnalysis {
    /// Canary requests before any verdict.
    #[serde(default = "default_min_requests")]
    #[schemars(range(min = 1, max = 100000000))]
    pub min_requests: u64,
    /// Largest allowed excess of the canary's error rate over the stable version's, as a
    /// fraction (0.01: one point).
    #[serde(default = "default_max_error_rate_increase")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_error_rate_increase: f64,
    /// Largest allowed ratio of the canary's p95 latency to the stable version's (at least 1).
    #[serde(default = "default_max_latency_ratio")]
    #[schemars(range(min = 1.0, max = 1000.0))]
    pub max_latency_ratio: f64,
}

fn default_min_requests() -> u64 {
    100
}
fn default_max_error_rate_increase() -> f64 {
    0.01
}
fn default_max_latency_ratio() -> f64 {
    1.5
}

/// Where a canary stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum CanaryPhase {
    /// Serving its share; too few requests for a verdict, or no analysis.
    #[default]
    Progressing,
    /// Within the bounds over at least `minRequests`: ready to be promoted by an apply (still
    /// analysed, and still rolled back if it gets worse).
    Passed,
    /// Rolled back by the analysis: it takes no traffic until `spec.canary` names another
    /// version (or is dropped and set again).
    RolledBack,
}

/// One version's requests as the canary analysis counted them.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VersionTraffic {
    /// The version.
    pub version: String,
    /// Requests completed, over the pods that serve it.
    pub requests: u64,
    /// Requests that ended in an error.
    pub errors: u64,
    /// p95 latency, milliseconds (absent until measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p95_ms: Option<f64>,
}

/// The canary's state (`status.canary`), per version.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CanaryStatus {
    /// The canary version this describes.
    pub version: String,
    /// Percent of requests the pods give it now (0 once rolled back).
    pub weight: u32,
    /// Where it stands.
    pub phase: CanaryPhase,
    /// The last verdict's reason (`CanaryProgressing`, `CanaryPassed`, `CanaryRolledBack`).
    pub reason: String,
    /// The numbers behind it.
    pub message: String,
    /// The stable version's counts.
    pub stable: VersionTraffic,
    /// The canary version's counts.
    pub canary: VersionTraffic,
    /// When this canary version started (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// When this status was last written (RFC 3339): counts alone are rewritten at the rate
    /// `status.traffic` is, a change of phase or weight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
}
