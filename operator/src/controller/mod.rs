//! Controllers: each a short driver over observe → validate → build → apply → status, one
//! submodule per phase ([`pool`], [`adapter`]). Validation ([`validate`]) and the builds
//! (`crate::resources`, `crate::mergedown`, [`ids`]) are pure; every reconcile runs in one
//! shared wrapper (a tracing span, metrics, backoff, the Warning Event of a failure).

pub mod adapter;
pub mod apply;
mod conditions;
pub mod context;
pub mod ids;
pub mod pods;
pub mod pool;
mod reconcile;
pub mod validate;

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{watcher, Controller};
use kube::{Api, Client, ResourceExt};
use mole_crds::{Adapter, InferencePool};

pub use context::{Context, PodClient, StoreWriters, Stores};

/// Runs both controllers until shutdown. `namespace` None watches every namespace. `ctx` gets
/// the controllers' own stores of pools and Adapters (each controller's watch of its kind
/// feeds one), so reconciles read them without API calls; each controller waits for its store
/// to be filled before reconciling, and reconciles wait for the other's (`Stores::ready`).
pub async fn run(client: Client, namespace: Option<String>, ctx: Context) {
    let api = |c: &Client| -> (Api<InferencePool>, Api<Adapter>) {
        match &namespace {
            Some(ns) => (
                Api::namespaced(c.clone(), ns),
                Api::namespaced(c.clone(), ns),
            ),
            None => (Api::all(c.clone()), Api::all(c.clone())),
        }
    };
    let (pools, adapters) = api(&client);
    let owned = |c: &Client| match &namespace {
        Some(ns) => (
            Api::<ConfigMap>::namespaced(c.clone(), ns),
            Api::<Deployment>::namespaced(c.clone(), ns),
            Api::<Service>::namespaced(c.clone(), ns),
            Api::<PodDisruptionBudget>::namespaced(c.clone(), ns),
            Api::<HorizontalPodAutoscaler>::namespaced(c.clone(), ns),
        ),
        None => (
            Api::all(c.clone()),
            Api::all(c.clone()),
            Api::all(c.clone()),
            Api::all(c.clone()),
            Api::all(c.clone()),
        ),
    };
    let (cms, deploys, svcs, pdbs, hpas) = owned(&client);
    let jobs: Api<Job> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let pods: Api<Pod> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let managed = watcher::Config::default().labels("app.kubernetes.io/managed-by=mole-operator");
    // A dynamic pod turning ready or going reconciles its pool at once, so the WorkerConfig's
    // `peers` (where the pods forward requests) follow the pods, not the next requeue.
    let dynamic_pods = watcher::Config::default().labels(&pool::dynamic_pods_selector());
    // An Adapter change re-renders its pool's WorkerConfig.
    let pool_of =
        |a: Adapter| Some(ObjectRef::new(&a.spec.pool).within(&a.namespace().unwrap_or_default()));
    let pool_ctl = Controller::new(pools.clone(), watcher::Config::default());
    let adapter_ctl = Controller::new(adapters.clone(), watcher::Config::default());
    let ctx = Arc::new(ctx.with_stores(Stores {
        pools: pool_ctl.store(),
        adapters: adapter_ctl.store(),
    }));
    let pool_ctl = pool_ctl
        .owns(cms, managed.clone())
        .owns(deploys.clone(), managed.clone())
        .owns(svcs, managed.clone())
        .owns(pdbs, managed.clone())
        .owns(hpas, managed.clone())
        .watches(adapters.clone(), watcher::Config::default(), pool_of)
        .watches(pods, dynamic_pods, |p: Pod| pool::pool_of_pod(&p))
        .shutdown_on_signal()
        .run(pool::reconcile, pool::error_policy, ctx.clone())
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "pool controller event");
            }
        });
    // Merge Jobs and merged Deployments are owned by their Adapter: a Job finishing or a
    // Deployment's pods becoming ready (or either being deleted) reconciles it at once.
    // A pool's new spec re-validates its Adapters (see `adapter::PoolTrigger`).
    let trigger = adapter::PoolTrigger::default();
    let adapter_store = ctx.stores.adapters.clone();
    let adapters_of_pool = move |p: InferencePool| trigger.adapters(&p, &adapter_store);
    let adapter_ctl = adapter_ctl
        .owns(jobs, managed.clone())
        .owns(deploys, managed)
        .watches(pools, watcher::Config::default(), adapters_of_pool)
        .shutdown_on_signal()
        .run(adapter::reconcile, adapter::error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "adapter controller event");
            }
        });
    futures::join!(pool_ctl, adapter_ctl);
}
