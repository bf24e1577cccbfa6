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
