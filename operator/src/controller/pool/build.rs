//! Build: the pool's children as they should be. Pure: no client.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use mole_crds::{Adapter, InferencePool};

use std::collections::{BTreeMap, BTreeSet};

use crate::controller::ids::{self, Ledger, Settled};
use crate::controller::validate::validate_adapter;
use crate::resources::{self, Registered, WorkerDefaults};

/// The children of a pool as they should be.
pub(super) struct Desired {
    /// `<pool>-config` with the WorkerConfig.
    pub config_map: ConfigMap,
    /// Content hash of that WorkerConfig (what each pod is asked to reload to).
    pub config_hash: String,
    /// `<pool>-dynamic`.
    pub deployment: Deployment,
    /// The Service `<pool>`.
    pub service: Service,
    /// The PDB of the dynamic pods.
    pub pdb: PodDisruptionBudget,
    /// The dynamic pods' autoscaler (None: the pool has a fixed count, and a live one goes).
    pub hpa: Option<HorizontalPodAutoscaler>,
}

/// The adapters that belong in the pool's WorkerConfig: of this pool, not being deleted, valid,
/// fetched when it has a `source.uri`, and holding an id in `ids` (the pool's ledger as
/// written: see [`ids::Settled::served`]).
pub fn registered<'a>(
    pool: &InferencePool,
    ids: &BTreeMap<String, u32>,
    adapters: &'a [Adapter],
) -> Vec<Registered<'a>> {
    let name = pool.name_any();
    adapters
        .iter()
        .filter(|a| a.spec.pool == name && a.metadata.deletion_timestamp.is_none())
        .filter(|a| validate_adapter(a, Some(pool), adapters).is_ok())
        // An adapter fetched from a `source.uri` is loaded once its fetch Job succeeded.
        .filter(|a| {
            resources::adapter_fetch_key(&a.spec).is_none_or(|key| {
                a.status.as_ref().and_then(|s| s.fetched.as_deref()) == Some(key.as_str())
            })
        })
        .filter_map(|a| {
            let id = ids.get(&a.name_any())?;
            Some(Registered {
                adapter: a,
                lora_id: *id,
            })
        })
        .collect()
}

/// The pool's id ledger after this reconcile: `ledger` (as last written) settled against the
/// pool's Adapters among `adapters` (every Adapter of the namespace). Every Adapter of the pool
/// not being deleted keeps its id; a valid one without an id gets the next, the oldest first
/// (then by name), so ids follow the order Adapters were created in; a deleted one (being
/// deleted, or gone) leaves the ledger, which is what its finalizer waits for.
pub(super) fn ledger(pool: &InferencePool, ledger: &Ledger, adapters: &[Adapter]) -> Settled {
    let name = pool.name_any();
    let mut mine: Vec<&Adapter> = adapters
        .iter()
        .filter(|a| a.spec.pool == name && a.metadata.deletion_timestamp.is_none())
        .collect();
    mine.sort_by_key(|a| (a.metadata.creation_timestamp.clone(), a.name_any()));
    let names: Vec<String> = mine.iter().map(|a| a.name_any()).collect();
    let live: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    // An invalid Adapter gets no id (it may never be served), as before it is fixed.
    let wanting: Vec<&str> = mine
        .iter()
        .zip(&names)
        .filter(|(a, _)| validate_adapter(a, Some(pool), adapters).is_ok())
        .map(|(_, n)| n.as_str())
        .collect();
    ids::settle(ledger, &wanting, &live)
}

/// The pool's children, its WorkerConfig listing the registered ones of `adapters` with their
/// ids in `ids` (placed on `pods`, the dynamic pods, with `dynamic.placement`), its pods
/// running `spec.image` or the default of `images` and listening on `port`.
pub(super) fn desired(
    pool: &InferencePool,
    ids: &BTreeMap<String, u32>,
    adapters: &[Adapter],
    pods: &[String],
    peers: &std::collections::BTreeMap<String, String>,
    port: u16,
    images: &WorkerDefaults,
) -> Desired {
    let reg = registered(pool, ids, adapters);
    let mut config = resources::worker_config(&pool.name_any(), &pool.spec, &reg);
    // Placement by the traffic each adapter's status records (written at a bounded rate, so
    // the config does not churn with every reading).
    let traffic = reg
        .iter()
        .map(|r| {
            let t = r.adapter.status.as_ref().and_then(|s| s.traffic.as_ref());
            (r.adapter.name_any(), t.map_or(0.0, |t| t.tokens_per_minute))
        })
        .collect();
    resources::place_adapters(&mut config, &pool.spec, &traffic, pods, peers);
    let (config_map, config_hash) = resources::config_map(pool, &config);
    Desired {
        config_map,
        config_hash,
        deployment: resources::dynamic_deployment(pool, port, images),
        service: resources::service(pool),
        pdb: resources::pdb(pool),
        hpa: resources::hpa(pool),
    }
}
