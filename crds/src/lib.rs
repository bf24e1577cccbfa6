//! The mole.dev API: the `InferencePool` and `Adapter` custom resources, the constants shared by
//! the operator and the worker (conditions, labels, annotations), the runtime configuration the
//! operator hands to worker pods ([`WorkerConfig`]) and the worker's adapter listing
//! ([`LoraAdaptersResponse`]) that the operator reads to decide readiness.
//!
//! This crate does no I/O and holds no Kubernetes client, so both binaries can depend on it.

pub mod adapter;
pub mod constants;
pub mod pool;
pub mod worker;

pub use adapter::*;
pub use pool::*;
pub use worker::*;

use kube::CustomResourceExt;

/// Every CRD of the API, in the order they are written to `charts/mole/crds/`.
pub fn crds(
) -> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    vec![InferencePool::crd(), Adapter::crd()]
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
