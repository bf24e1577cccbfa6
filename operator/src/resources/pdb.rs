//! PodDisruptionBudgets of worker pods (dynamic and merged).

use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use mole_crds::InferencePool;

use super::deployment::dynamic_name;
use super::meta::ChildMeta;

/// The PodDisruptionBudget of the dynamic pods: at most one voluntarily evicted at a time.
pub fn pdb(pool: &InferencePool) -> PodDisruptionBudget {
    let name = pool.metadata.name.clone().unwrap_or_default();
    worker_pdb(&ChildMeta::of_pool(pool, "dynamic"), dynamic_name(&name))
}

/// A PodDisruptionBudget `name` letting at most one of the pods `meta` selects be evicted at
/// a time.
pub fn worker_pdb(meta: &ChildMeta, name: String) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta.named(name),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(meta.selector.clone()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}
