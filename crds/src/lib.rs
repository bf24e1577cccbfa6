//! The mole.dev API: the `InferencePool` and `Adapter` custom resources and the constants of
//! their children (conditions, labels, annotations). The pool embeds the router and engine
//! limits of the operator→worker contract (`mole-api`), whose types are re-exported here, so
//! the operator renders a [`WorkerConfig`] by copying them.
//!
//! This crate does no I/O and holds no Kubernetes client.

#![forbid(unsafe_code)]

pub mod adapter;
pub mod constants;
pub mod fleet;
pub mod pool;

pub use adapter::*;
pub use fleet::*;
pub use pool::*;

pub use mole_api::{
    bounds, AdapterCounters, BoundsError, Dtype, EngineLimits, ImageProcessor, LoraAdapterInfo,
    LoraAdaptersResponse, MergedModel, ModelSource, ReasoningParser, Residency, RouterFallback,
    RouterSpec, RouterStrategy, RoutingSignals, ServingMode, ToolCallParser, WorkerAdapter,
    WorkerAuth, WorkerBaseModel, WorkerCanary, WorkerConfig, WorkerLimits, WorkerMode,
    LATENCY_BUCKETS_MS,
};

use kube::CustomResourceExt;

/// Every CRD of the API, in the order they are written to `charts/mole/crds/`.
pub fn crds(
) -> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    vec![InferencePool::crd(), Adapter::crd()]
}

/// The OpenAPI v3 schema of a kind's CRD as JSON (what the API server validates objects and
/// evaluates CEL rules against); `None` for a kind that is not ours.
pub fn openapi_schema(kind: &str) -> Option<serde_json::Value> {
    let crd = crds().into_iter().find(|c| c.spec.names.kind == kind)?;
    let schema = crd.spec.versions.first()?.schema.as_ref()?;
    serde_json::to_value(schema.open_api_v3_schema.as_ref()?).ok()
}

/// The CRDs as one multi-document YAML stream (what `crdgen` writes and `mole-operator crd` prints).
pub fn crds_yaml() -> Result<Vec<(String, String)>, serde_yaml::Error> {
    crds()
        .into_iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            serde_yaml::to_string(&crd).map(|y| (name, y))
        })
        .collect()
}
