//! Controllers: each a short driver over observe → validate → build → apply → status, one
//! submodule per phase ([`pool`], [`adapter`]). Validation ([`validate`]) and the builds
//! (`crate::resources`, `crate::mergedown`, [`ids`]) are pure; every reconcile runs in one
//! shared wrapper (a tracing span, metrics, backoff, the Warning Event of a failure).

pub mod adapter;
pub mod apply;
mod conditions;
pub mod context;
pub mod events;
pub mod finalizer;
pub mod ids;
pub mod pod_client;
pub mod pod_index;
pub mod pods;
pub mod pool;
mod reconcile;
pub mod validate;

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{watcher, Controller, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use mole_crds::{Adapter, InferencePool};

pub use context::{Context, StoreWriter, StoreWriters, Stores};
pub use pod_client::PodClient;

/// Runs both controllers until `shutdown` resolves, then lets the reconciles under way
/// finish (the caller bounds how long: see `mole-operator run`). `namespace` None watches
/// every namespace.
///
/// The controllers' main watches feed [`Stores`] (reflectors made here, so the stores' synced
/// signal wakes every waiter: see [`context::StoreWriter`]), and `ctx` reads pools and Adapters
/// from them without API calls; reconciles wait until both stores hold a first full list
/// (`Stores::ready`).
pub async fn run(
    client: Client,
    namespace: Option<String>,
    ctx: Context,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
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
    // An Adapter appearing, changing or going reconciles its pool: the pool re-renders its
    // WorkerConfig and, as its id ledger's one writer, gives the new Adapter its id or takes a
    // deleted one's out. The trigger is sent from the Adapter store's own stream, after the
    // store has the event: a second watch of Adapters could wake the pool before the store it
    // reads holds the new Adapter, and that Adapter would wait for the pool's next requeue.
    let pool_of =
        |a: &Adapter| ObjectRef::new(&a.spec.pool).within(&a.namespace().unwrap_or_default());
    let (stores, writers) = Stores::new();
    writers.close_on(shutdown.clone());
    let (to_pools, pool_triggers) = futures::channel::mpsc::unbounded();
    let (to_adapters, adapter_triggers) = futures::channel::mpsc::unbounded();
    // A pool's new spec re-validates its Adapters, and a change of its id ledger wakes the
    // Adapters whose entry changed (see `adapter::PoolTrigger`); sent from the pool store's
    // stream for the same reason.
    let trigger = adapter::PoolTrigger::default();
    let adapter_store = stores.adapters.clone();
    let pool_stream = writers
        .pools
        .reflect(
            watcher(pools.clone(), watcher::Config::default())
                // Nothing reads a cached object's managedFields, which are most of its bytes.
                .modify(|o| o.managed_fields_mut().clear()),
        )
        .inspect_ok(move |e| {
            if let Some(p) = touched(e) {
                for a in trigger.adapters(p, &adapter_store) {
                    let _ = to_adapters.unbounded_send(a);
                }
            }
        })
        .applied_objects();
    let adapter_stream = writers
        .adapters
        .reflect(
            watcher(adapters.clone(), watcher::Config::default())
                // Nothing reads a cached object's managedFields, which are most of its bytes.
                .modify(|o| o.managed_fields_mut().clear()),
        )
        .inspect_ok(move |e| {
            if let Some(a) = touched(e) {
                let _ = to_pools.unbounded_send(pool_of(a));
            }
        })
        .applied_objects();
    let pool_ctl = Controller::for_stream(pool_stream, stores.pools.clone());
    let adapter_ctl = Controller::for_stream(adapter_stream, stores.adapters.clone());
    let ctx = Arc::new(ctx.with_stores(stores));
    let pool_ctl = pool_ctl
        .owns(cms, managed.clone())
        .owns(deploys.clone(), managed.clone())
        .owns(svcs, managed.clone())
        .owns(pdbs, managed.clone())
        .owns(hpas, managed.clone())
        .reconcile_on(pool_triggers)
        .watches(pods, dynamic_pods, |p: Pod| pool::pool_of_pod(&p))
        .graceful_shutdown_on(shutdown.clone())
        .run(pool::reconcile, pool::error_policy, ctx.clone())
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "pool controller event");
            }
        });
    // Merge Jobs and merged Deployments are owned by their Adapter: a Job finishing or a
    // Deployment's pods becoming ready (or either being deleted) reconciles it at once.
    let adapter_ctl = adapter_ctl
        .owns(jobs, managed.clone())
        .owns(deploys, managed)
        .reconcile_on(adapter_triggers)
        .graceful_shutdown_on(shutdown)
        .run(adapter::reconcile, adapter::error_policy, ctx)
        .for_each(|r| async move {
            if let Err(e) = r {
                tracing::debug!(error = %e, "adapter controller event");
            }
        });
    futures::join!(pool_ctl, adapter_ctl);
}

/// The objects a watch event touches (applied or deleted; as `touched_objects` reads them).
fn touched<K>(e: &watcher::Event<K>) -> Option<&K> {
    match e {
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) | watcher::Event::Delete(o) => {
            Some(o)
        }
        watcher::Event::Init | watcher::Event::InitDone => None,
    }
}
