//! Deployments of worker pods: `<pool>-dynamic` and an adapter's merged `<pool>-<adapter>`.

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use mole_crds::{InferencePool, InferencePoolSpec};

use super::configmap::config_map_name;
use super::image::WorkerDefaults;
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
/// and listening on `port`. With `spec.dynamic.autoscaling` it carries no `replicas`: the
/// operator's forced apply would otherwise take the count back from the HPA on every write.
pub fn dynamic_deployment(pool: &InferencePool, port: u16, images: &WorkerDefaults) -> Deployment {
    let name = pool.metadata.name.clone().unwrap_or_default();
    let meta = ChildMeta::of_pool(pool, "dynamic");
    let template = worker_pod(pool, &config_map_name(&name), &meta, port, images);
    worker_deployment(
        &meta,
        dynamic_name(&name),
        pool.spec.dynamic.applied_replicas(),
        template,
        rolling_update(&pool.spec),
    )
}

/// The rolling update of the pool's Deployments: `spec.rollout`, each unset field taking the
/// default for the pool's hardware. GPU pools replace a pod before starting its successor
/// (`maxSurge: 0, maxUnavailable: 1`): on a node pool without a spare GPU a surge pod stays
/// Pending and the rollout (and any rollback) never completes. CPU pools surge instead, so
/// they never lose a pod. With several replicas, `maxUnavailable: 1` keeps the others serving
/// and the PDB then allows no eviction until the new pod is ready; with one replica the
/// GPU default has a gap between the old pod stopping and the new one becoming ready.
pub fn rolling_update(spec: &InferencePoolSpec) -> RollingUpdateDeployment {
    let r = spec.rollout.clone().unwrap_or_default();
    let (surge, unavailable) = if spec.gpu.count > 0 { (0, 1) } else { (1, 0) };
    RollingUpdateDeployment {
        max_surge: Some(r.max_surge.unwrap_or(IntOrString::Int(surge))),
        max_unavailable: Some(r.max_unavailable.unwrap_or(IntOrString::Int(unavailable))),
    }
}

/// The pod count an int-or-percent rollout value means for `replicas`, as the Deployment
/// controller computes it (percentages rounded up for `maxSurge`, down for
/// `maxUnavailable`). `Err` says what is wrong with a malformed value.
pub fn scaled_value(v: &IntOrString, replicas: i32, round_up: bool) -> Result<i32, String> {
    match v {
        IntOrString::Int(n) if *n >= 0 => Ok(*n),
        IntOrString::Int(n) => Err(format!("{n} must be 0 or more")),
        IntOrString::String(s) => {
            let pct = s
                .strip_suffix('%')
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|p| *p <= 100)
                .ok_or_else(|| {
                    format!("{s:?} must be an integer or a percentage from \"0%\" to \"100%\"")
                })?;
            let scaled = i64::from(replicas.max(0)) * i64::from(pct);
            let n = if round_up {
                (scaled + 99) / 100
            } else {
                scaled / 100
            };
            Ok(i32::try_from(n).expect("at most replicas"))
        }
    }
}

/// A Deployment `name` of `replicas` worker pods from `template`, selected by `meta`, rolled
/// by `rolling_update` (`replicas` None: left to whoever scales it).
pub fn worker_deployment(
    meta: &ChildMeta,
    name: String,
    replicas: Option<i32>,
    template: PodTemplateSpec,
    rolling_update: RollingUpdateDeployment,
) -> Deployment {
    Deployment {
        metadata: meta.named(name),
        spec: Some(DeploymentSpec {
            replicas,
            selector: LabelSelector {
                match_labels: Some(meta.selector.clone()),
                ..Default::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(rolling_update),
            }),
            template,
            ..Default::default()
        }),
        status: None,
    }
}
