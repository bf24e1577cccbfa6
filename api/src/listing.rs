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
    /// Cumulative traffic per adapter version since the worker started, which the operator
    /// turns into rates (`status.traffic`). Absent from workers that do not count it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub traffic: Vec<AdapterCounters>,
}

/// Upper bounds (milliseconds) of the request latency histogram in [`AdapterCounters`]; one
/// more, open-ended bucket follows the last. Roughly logarithmic from 25 ms to 2 min: the
/// operator reads p50 and p95 from it, interpolating within a bucket.
pub const LATENCY_BUCKETS_MS: [f64; 14] = [
    25.0, 50.0, 100.0, 250.0, 500.0, 1_000.0, 2_500.0, 5_000.0, 10_000.0, 20_000.0, 30_000.0,
    60_000.0, 90_000.0, 120_000.0,
];

/// Cumulative counters of one adapter version in one worker, since the worker started.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdapterCounters {
    /// Adapter name.
    pub name: String,
    /// Version.
    pub version: String,
    /// Requests completed, successfully or not.
    pub requests: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// Requests that ended in an error (the engine's, not the client's: a refused request
    /// never reached the adapter).
    pub errors: u64,
    /// Completed requests per latency bucket ([`LATENCY_BUCKETS_MS`] and one open bucket):
    /// `LATENCY_BUCKETS_MS.len() + 1` entries, or none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub latency_ms: Vec<u64>,
}

impl LoraAdaptersResponse {
    /// Whether `name` at `version` is loaded and can serve.
    pub fn is_loaded(&self, name: &str, version: &str) -> bool {
        self.data
            .iter()
            .any(|a| a.name == name && a.version == version && a.loaded)
    }
}

/// Response of `GET /v1/residency`: what one worker holds in memory and how busy it is, the
/// small report its peers poll every second or so to pick where a request for an adapter
/// goes (see the worker's `server::peers`). Only adapter versions in memory are listed (an
/// adapter a worker does not list is on its disk at best), so the report stays a few hundred
/// bytes at 500 registered adapters, where `/v1/lora_adapters` with its counters is hundreds
/// of KB.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ResidencyReport {
    /// Whether the worker takes requests (its `/readyz`): a draining or starting peer is
    /// skipped.
    pub ready: bool,
    /// Requests waiting for a batch slot or an adapter load (`vllm:num_requests_waiting`).
    pub waiting: u64,
    /// Requests decoding now (`vllm:num_requests_running`).
    pub running: u64,
    /// The adapter versions in memory and where.
    pub adapters: Vec<ResidentAdapter>,
}

/// One adapter version in a worker's memory ([`ResidencyReport`]).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ResidentAdapter {
    /// Adapter name.
    pub name: String,
    /// Version.
    pub version: String,
    /// `gpu` (a device slot) or `cpu` (host memory), never `disk`.
    pub residency: Residency,
}

impl ResidencyReport {
    /// Where `name` at `version` is in this worker's memory (None: not in memory).
    pub fn residency_of(&self, name: &str, version: &str) -> Option<Residency> {
        self.adapters
            .iter()
            .find(|a| a.name == name && a.version == version)
            .map(|a| a.residency)
    }
}
