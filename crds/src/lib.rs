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
    LoraAdaptersResponse, MergedModel, ModelSource, PrefixCacheScope, ReasoningParser, Residency,
    RouterFallback, RouterSpec, RouterStrategy, RoutingSignals, ServiceModel, ServiceModelError,
    ServingMode, ToolCallParser, WorkerAdapter, WorkerAuth, WorkerBaseModel, WorkerCanary,
    WorkerConfig, WorkerLimits, WorkerMode, LATENCY_BUCKETS_MS,
};

use kube::CustomResourceExt;

type Crd =
    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

/// Every CRD of the API, in the order they are written to `charts/mole/crds/`.
pub fn crds() -> Vec<Crd> {
    vec![InferencePool::crd(), Adapter::crd()]
        .into_iter()
        .map(with_known_formats)
        .collect()
}

/// The integer and number formats the API server knows (OpenAPI's own); schemars writes Rust's
/// unsigned types as `uint32`/`uint64`, which kube-apiserver accepts with a warning on every
/// `helm install` and `kubectl apply` ("unrecognized format").
pub const KNOWN_NUMERIC_FORMATS: &[&str] = &["int32", "int64", "float", "double"];

/// `crd` with every unsigned integer format written as the signed one that holds it, bounded:
/// `uint8`/`uint16`/`uint32` as `int64` with their maximum (unless a tighter one is set),
/// `uint64` as `int64` (what the server stores integers as). Each keeps its `minimum` (0 or
/// more, which schemars writes beside the format).
fn with_known_formats(mut crd: Crd) -> Crd {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(o) => {
                let max = match o.get("format").and_then(|f| f.as_str()) {
                    Some("uint8") => Some(f64::from(u8::MAX)),
                    Some("uint16") => Some(f64::from(u16::MAX)),
                    Some("uint32") | Some("uint") => Some(f64::from(u32::MAX)),
                    Some("uint64") => None,
                    _ => {
                        o.values_mut().for_each(walk);
                        return;
                    }
                };
                o.insert("format".into(), "int64".into());
                if !o.contains_key("minimum") {
                    o.insert("minimum".into(), 0.0.into());
                }
                if let Some(max) = max {
                    let tighter = o
                        .get("maximum")
                        .and_then(serde_json::Value::as_f64)
                        .is_some_and(|m| m <= max);
                    if !tighter {
                        o.insert("maximum".into(), max.into());
                    }
                }
                o.values_mut().for_each(walk);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    for version in &mut crd.spec.versions {
        if let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            let mut v = serde_json::to_value(&*schema).expect("a schema serializes");
            walk(&mut v);
            *schema = serde_json::from_value(v).expect("a walked schema is still a schema");
        }
    }
    crd
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
