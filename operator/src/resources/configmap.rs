//! The ConfigMaps holding a WorkerConfig: `<pool>-config` for the dynamic pods, one per
//! merged output for an adapter's merged pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use mole_crds::constants::{ANNOTATION_CONFIG_HASH, WORKER_CONFIG_KEY};
use mole_crds::{InferencePool, WorkerConfig};

use super::meta::{short_hash, ChildMeta, ANNOTATION_MERGED_OUTPUT};

/// Name of the pool's worker ConfigMap.
pub fn config_map_name(pool: &str) -> String {
    format!("{pool}-config")
}

/// Name of the ConfigMap of an adapter's merged pods serving `output`:
/// `<pool>-<adapter>-<short hash of output>`. One per output, so rewriting it for a new
/// version never switches the old pods (whose file watcher re-reads their ConfigMap) to the
/// new weights before the Deployment rolls them.
pub fn merged_config_name(pool: &str, adapter: &str, output: &str) -> String {
    let h = short_hash(&serde_json::Value::String(output.to_string()));
    format!("{pool}-{adapter}-{}", &h[..10])
}

/// The ConfigMap `<pool>-config` holding the WorkerConfig as JSON, annotated with its
/// [`WorkerConfig::content_hash`] (the hash a worker compares on `POST /admin/reload`).
pub fn config_map(pool: &InferencePool, config: &WorkerConfig) -> (ConfigMap, String) {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let meta = ChildMeta::of_pool(pool, "dynamic");
    worker_config_map(&meta, config_map_name(&name), config, BTreeMap::new())
}

/// The ConfigMap of an adapter's merged pods serving `output` (annotated with it, so stale
/// ones can be found and deleted).
pub fn merged_config_map(
    meta: &ChildMeta,
    pool: &str,
    adapter: &str,
    output: &str,
    config: &WorkerConfig,
) -> ConfigMap {
    let extra = BTreeMap::from([(ANNOTATION_MERGED_OUTPUT.to_string(), output.to_string())]);
    let name = merged_config_name(pool, adapter, output);
    worker_config_map(meta, name, config, extra).0
}

/// A ConfigMap with `config` under [`WORKER_CONFIG_KEY`] and its content hash annotated;
/// returns the hash too.
fn worker_config_map(
    meta: &ChildMeta,
    name: String,
    config: &WorkerConfig,
    mut annotations: BTreeMap<String, String>,
) -> (ConfigMap, String) {
    let json = serde_json::to_string_pretty(config).expect("WorkerConfig serializes");
    let hash = config.content_hash();
    annotations.insert(ANNOTATION_CONFIG_HASH.to_string(), hash.clone());
    let cm = ConfigMap {
        metadata: meta.annotated(name, annotations),
        data: Some(BTreeMap::from([(WORKER_CONFIG_KEY.to_string(), json)])),
        ..Default::default()
    };
    (cm, hash)
}
