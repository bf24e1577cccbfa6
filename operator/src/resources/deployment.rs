//! Deployments of worker pods: `<pool>-dynamic` and an adapter's merged `<pool>-<adapter>`.

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use mole_crds::InferencePool;

use super::configmap::config_map_name;
use super::image::WorkerImages;
use super::meta::ChildMeta;
use super::pod::worker_pod;

/// Name of the pool's dynamic Deployment (and its PDB).
pub fn dynamic_name(pool: &str) -> String {
    format!("{pool}-dynamic")
}

/// Name of an adapter's merged Deployment, Service and PDB: `<pool>-<adapter>`.
///
/// Kept as it was rather than given a marker (`<pool>-m-<adapter>`): renaming would orphan
/// every existing merged Deployment on upgrade, and no hyphen-joined scheme is unique across
/// pools anyway (`a` + `b-dynamic` = `a-b` + `dynamic`). Uniqueness is enforced by validation
/// instead: [`RESERVED_ADAPTER_NAMES`] and the 63-character limit
/// (`crate::controller::validate`).
pub fn merged_name(pool: &str, adapter: &str) -> String {
    format!("{pool}-{adapter}")
}

/// Adapter names whose merged name `<pool>-<adapter>` would be a name of the pool's own
/// children of the same kinds (the Deployment and PDB `<pool>-dynamic`), refused by validation.
pub const RESERVED_ADAPTER_NAMES: &[&str] = &["dynamic"];

/// The longest merged name: the merged Service `<pool>-<adapter>` must be a DNS-1035 label,
/// and the pool and adapter names are label values (`mole.dev/pool`, `mole.dev/adapter`).
pub const MAX_CHILD_NAME: usize = 63;

/// The Deployment `<pool>-dynamic`, its pods running `spec.image` or the default of `images`
/// and listening on `port`.
pub fn dynamic_deployment(pool: &InferencePool, port: u16, images: &WorkerImages) -> Deployment {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let meta = ChildMeta::of_pool(pool, "dynamic");
    let template = worker_pod(pool, &config_map_name(&name), &meta, port, images);
    worker_deployment(
        &meta,
        dynamic_name(&name),
        pool.spec.dynamic.replicas,
        template,
    )
}

/// A Deployment `name` of `replicas` worker pods from `template`, selected by `meta`.
pub fn worker_deployment(
    meta: &ChildMeta,
    name: String,
    replicas: i32,
    template: PodTemplateSpec,
) -> Deployment {
    Deployment {
        metadata: meta.named(name),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(meta.selector.clone()),
                ..Default::default()
            },
            // A GPU pod never starts before an old one is gone when the node pool is full;
            // maxSurge 1 lets a rollout proceed when there is room.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template,
            ..Default::default()
        }),
        status: None,
    }
}
