//! Build: the merge-down plan of the adapter. Pure: no client.

use kube::ResourceExt;
use mole_crds::{Adapter, AdapterStatus, InferencePool};

use super::observe::Observed;
use crate::mergedown;

/// The pure merge-down plan (dynamic mode included: it removes merged pods only once the
/// dynamic pods serve the adapter), from the adapter's `status` as validation and
/// registration left it.
pub(super) fn plan(
    adapter: &Adapter,
    pool: &InferencePool,
    status: &AdapterStatus,
    obs: &Observed,
) -> mergedown::Plan {
    let name = adapter.name_any();
    let ns = adapter.namespace().unwrap_or_default();
    mergedown::plan(
        &adapter.spec.pool,
        &pool.spec,
        mergedown::Subject {
            name: &name,
            namespace: &ns,
            uid: adapter.metadata.uid.as_deref(),
            generation: adapter.metadata.generation,
            spec: &adapter.spec,
            status,
        },
        &obs.planner,
    )
}
