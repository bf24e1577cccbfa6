//! Pure builders of every child object: one file per kind (ConfigMap, Deployment, Service,
//! PodDisruptionBudget, HorizontalPodAutoscaler, Secret; the worker pod template and the WorkerConfig they carry), each
//! starting from the shared metadata of [`ChildMeta`]. No client, no I/O: unit-tested directly.
//! The merge-down Jobs are built in `crate::mergedown::job` from the same pieces: every Job's
//! pod is [`job_template`]'s.

mod configmap;
mod deployment;
mod fetch;
mod hpa;
mod image;
mod meta;
mod pdb;
mod pod;
mod restricted;
mod secret;
mod service;
mod worker_config;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use mole_crds::InferencePool;

pub use configmap::{config_map, config_map_name, merged_config_map, merged_config_name};
pub use deployment::{
    dynamic_deployment, dynamic_name, merged_name, rolling_update, scaled_value, worker_deployment,
    MAX_CHILD_NAME, RESERVED_ADAPTER_NAMES,
};
pub use fetch::{
    adapter_fetch_job, adapter_fetch_job_name, adapter_fetch_key, fetch_container, join,
    with_base_model_source, ANNOTATION_FETCHED_AFTER, BASE_MODEL_SOURCE_VOLUME,
    FETCH_MODEL_CONTAINER,
};
pub use hpa::{hpa, QUEUE_METRIC};
pub use image::{
    WorkerDefaults, DEFAULT_WORKER_IMAGE_CPU, DEFAULT_WORKER_IMAGE_GPU, WORKER_REPOSITORY,
};
pub use meta::{
    canonical_json, labels, owner, selector, short_hash, ChildMeta, ANNOTATION_ADAPTER_VERSION,
    ANNOTATION_MERGED_OUTPUT,
};
pub use pdb::{pdb, worker_pdb};
pub use pod::{
    mount_path_problem, spec_hash, worker_pod, AUTH_MOUNT, RESERVED_MOUNTS, TMP_MOUNT,
    WORKER_PORT_NAME,
};
pub use restricted::{
    image_pull_secrets, job_template, json_logs, models_volume, restricted_container_security,
    restricted_pod_security, tool_container, JobNodes,
};
pub use secret::{
    operator_token_file, operator_token_secret, operator_token_secret_name, OPERATOR_TOKEN_KEY,
    OPERATOR_TOKEN_MOUNT,
};
pub use service::{endpoint, service, worker_service};
pub use worker_config::{merged_worker_config, place_adapters, worker_config, Registered};

/// What the operator sets on every worker pod beyond the pool's spec: the port they listen on
/// (its `--worker-port`, which it polls them on) and the default images (`--worker-image-*`).
#[derive(Clone, Copy, Debug)]
pub struct PodDefaults<'a> {
    /// The worker port.
    pub port: u16,
    /// The images of pools without `spec.image`.
    pub images: &'a WorkerDefaults,
}

/// The merged children of an adapter: ConfigMap, Deployment, Service and PDB, owned by the
/// Adapter (`owner`) so they go with it. The pods run the pool's image as the dynamic ones do.
pub fn merged_children(
    pool: &InferencePool,
    adapter: &str,
    version: &str,
    output: &str,
    replicas: i32,
    owner: OwnerReference,
    pods: PodDefaults<'_>,
) -> (ConfigMap, Deployment, Service, PodDisruptionBudget) {
    let pool_name = pool.metadata.name.clone().unwrap_or_default();
    let name = merged_name(&pool_name, adapter);
    let meta = ChildMeta::of_adapter(
        &pool_name,
        pool.metadata.namespace.clone(),
        adapter,
        "merged",
        owner,
    );
    let wc = merged_worker_config(&pool_name, &pool.spec, adapter, version, output);
    let cm = merged_config_map(&meta, &pool_name, adapter, output, &wc);
    let cm_name = merged_config_name(&pool_name, adapter, output);
    let mut template = worker_pod(pool, &cm_name, &meta, pods.port, pods.images);
    // The output and version are in the template: switching them is a rolling update, and the
    // operator reads back what a Deployment serves from here.
    let ann = template
        .metadata
        .get_or_insert_with(Default::default)
        .annotations
        .get_or_insert_with(BTreeMap::new);
    ann.insert(ANNOTATION_MERGED_OUTPUT.to_string(), output.to_string());
    ann.insert(ANNOTATION_ADAPTER_VERSION.to_string(), version.to_string());
    let deploy = worker_deployment(
        &meta,
        name.clone(),
        Some(replicas),
        template,
        deployment::rolling_update(&pool.spec),
    );
    let svc = worker_service(&meta, name.clone());
    let pdb = worker_pdb(&meta, name);
    (cm, deploy, svc, pdb)
}

#[cfg(test)]
mod tests;
