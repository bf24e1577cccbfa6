//! What every reconcile shares: the client, the reflector stores of pools and Adapters, the
//! Event recorder, metrics, the worker-pod HTTP client, and per-object failure counts for
//! backoff.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::{Stream, TryStreamExt};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::Client;
use mole_crds::{Adapter, InferencePool};
use tokio::sync::watch;

use super::events::Publisher;
use super::pod_client::{PodClient, ReadyPod};
use crate::error::{Error, Result};
use crate::resources;
use crate::telemetry::Metrics;

/// The controllers' caches of every InferencePool and Adapter they watch, kept current by the
/// controllers' own watches. Reconciles read pools and Adapters from them instead of the API
/// server: listing every Adapter of the namespace in each Adapter reconcile made n reconciles
/// cost n LISTs of n objects.
#[derive(Clone)]
pub struct Stores {
    /// The pool controller's store.
    pub pools: Store<InferencePool>,
    /// The Adapter controller's store.
    pub adapters: Store<Adapter>,
    /// Which stores hold a first full list ([`POOLS_SYNCED`], [`ADAPTERS_SYNCED`] bits).
    synced: watch::Receiver<u8>,
}

/// [`Stores::ready`]'s bit of the pool store.
const POOLS_SYNCED: u8 = 1;
/// [`Stores::ready`]'s bit of the Adapter store.
const ADAPTERS_SYNCED: u8 = 2;
/// Set when the operator shuts down ([`StoreWriters::close_on`]): waiters stop waiting.
const SHUTTING_DOWN: u8 = 4;

/// The write end of one of [`Stores`]' caches: applies watch events to the store and marks it
/// synced at its first `InitDone` (the end of a full list).
///
/// Why not `Store::wait_until_ready`: in kube-runtime 5.0 it polls one shared oneshot
/// receiver, which keeps only the last waiter's waker, so of several concurrent waiters (a
/// controller's own start, every reconcile of the other controller) all but one slept
/// forever: against a real API server no pool ever got its Deployment. A `watch` channel
/// wakes every waiter.
pub struct StoreWriter<K: reflector::Lookup + Clone + 'static>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    writer: reflector::store::Writer<K>,
    synced: Arc<watch::Sender<u8>>,
    bit: u8,
}

impl<K: reflector::Lookup + Clone + 'static> StoreWriter<K>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    /// Applies one watch event to the store.
    pub fn apply_watcher_event(&mut self, event: &watcher::Event<K>) {
        self.writer.apply_watcher_event(event);
        if matches!(event, watcher::Event::InitDone) {
            let bit = self.bit;
            self.synced.send_if_modified(|b| {
                let was = *b;
                *b |= bit;
                *b != was
            });
        }
    }

    /// `stream`'s events applied to the store as they pass (kube's `reflector`, with the
    /// synced signal).
    pub fn reflect<S>(mut self, stream: S) -> impl Stream<Item = S::Item> + Send
    where
        S: Stream<Item = watcher::Result<watcher::Event<K>>> + Send,
        K: Send + Sync,
        K::DynamicType: Send + Sync,
    {
        stream.inspect_ok(move |e| self.apply_watcher_event(e))
    }
}

/// The write ends of [`Stores`] made by [`Stores::new`]: `controller::run` feeds them from the
/// controllers' watches; tests feed them by hand from their in-memory API server.
pub struct StoreWriters {
    /// Feeds [`Stores::pools`].
    pub pools: StoreWriter<InferencePool>,
    /// Feeds [`Stores::adapters`].
    pub adapters: StoreWriter<Adapter>,
}

impl StoreWriters {
    /// Ends every wait in [`Stores::ready`] once `shutdown` resolves. A controller shut down
    /// gracefully stops polling its watch and waits for the reconciles under way, so a
    /// reconcile still waiting for a store's first list (SIGTERM right after taking the
    /// Lease) would wait for the whole shutdown grace.
    pub fn close_on(&self, shutdown: impl std::future::Future<Output = ()> + Send + 'static) {
        let tx = self.pools.synced.clone();
        tokio::spawn(async move {
            shutdown.await;
            tx.send_modify(|b| *b |= SHUTTING_DOWN);
        });
    }
}

impl Stores {
    /// Empty stores and their writers.
    pub fn new() -> (Self, StoreWriters) {
        let (pools, pw) = reflector::store();
        let (adapters, aw) = reflector::store();
        let (tx, synced) = watch::channel(0);
        let tx = Arc::new(tx);
        (
            Self {
                pools,
                adapters,
                synced,
            },
            StoreWriters {
                pools: StoreWriter {
                    writer: pw,
                    synced: tx.clone(),
                    bit: POOLS_SYNCED,
                },
                adapters: StoreWriter {
                    writer: aw,
                    synced: tx,
                    bit: ADAPTERS_SYNCED,
                },
            },
        )
    }

    /// Waits until both stores hold a first full list: before that an empty store would read as
    /// "no sibling, no pool" and refuse adapters that are fine. Any number of reconciles may
    /// wait at once. Fails with `store_closed` when the writers are gone unsynced, and with
    /// `shutting_down` when the operator stops first.
    pub async fn ready(&self) -> Result<()> {
        const SYNCED: u8 = POOLS_SYNCED | ADAPTERS_SYNCED;
        let mut rx = self.synced.clone();
        let b = rx
            .wait_for(|b| *b & SYNCED == SYNCED || *b & SHUTTING_DOWN != 0)
            .await
            .map_err(|_| Error::StoreClosed)?;
        match *b & SYNCED == SYNCED {
            true => Ok(()),
            false => Err(Error::ShuttingDown),
        }
    }

    /// The pool `name` of namespace `ns` (None: not in the cache).
    pub fn pool(&self, ns: &str, name: &str) -> Option<InferencePool> {
        self.pools
            .get(&ObjectRef::new(name).within(ns))
            .map(|p| p.as_ref().clone())
    }

    /// Every Adapter of namespace `ns`, shared with the store: each Adapter reconcile reads
    /// its siblings, so copies would cost adapters² (500 Adapters reconciled at once held
    /// 1.7 GiB of copies, the chart's limit is 256 MiB).
    pub fn adapters_shared(&self, ns: &str) -> Vec<Arc<Adapter>> {
        self.adapters
            .state()
            .into_iter()
            .filter(|a| a.metadata.namespace.as_deref() == Some(ns))
            .collect()
    }

    /// Every Adapter of namespace `ns`.
    pub fn adapters_in(&self, ns: &str) -> Vec<Adapter> {
        self.adapters
            .state()
            .iter()
            .filter(|a| a.metadata.namespace.as_deref() == Some(ns))
            .map(|a| a.as_ref().clone())
            .collect()
    }

    /// The Adapters of namespace `ns` that name pool `pool`.
    pub fn adapters_of(&self, ns: &str, pool: &str) -> Vec<Adapter> {
        self.adapters
            .state()
            .iter()
            .filter(|a| a.metadata.namespace.as_deref() == Some(ns) && a.spec.pool == pool)
            .map(|a| a.as_ref().clone())
            .collect()
    }
}

/// Shared state of the controllers.
pub struct Context {
    /// Kubernetes client.
    pub client: Client,
    /// The pools and Adapters the controllers watch ([`Context::with_stores`]).
    pub stores: Stores,
    /// Event publisher.
    pub recorder: Publisher,
    /// Operator metrics.
    pub metrics: Metrics,
    /// Talks to worker pods.
    pub pods: PodClient,
    /// The worker images of pools that leave `spec.image` unset.
    pub images: resources::WorkerDefaults,
    failures: Mutex<HashMap<String, u32>>,
    /// Per pool (`ns/pool`): the config hash each ready pod (`name@ip`) accepted on
    /// `POST /admin/reload`. In memory only: after a restart every pod is asked once more
    /// (a reload of an unchanged file is a no-op for the worker, and no API write).
    reloaded: Mutex<HashMap<String, HashMap<String, String>>>,
    /// Per pool (`ns/pool`): ready pods (`name@ip`) whose last reload failed, with when to ask
    /// again. In memory only, like `reloaded`.
    reload_failures: Mutex<HashMap<String, HashMap<String, Failing>>>,
    /// First retry delay of a failed reload and its cap (doubling in between).
    reload_backoff: (Duration, Duration),
    /// Each adapter's traffic smoothing (`ns/name`): the rates between readings of the pods'
    /// counters. Lost on restart, when the smoothing starts again from the rates the status
    /// recorded.
    pub traffic: Mutex<HashMap<String, crate::fleet::traffic::Smoother>>,
    /// Reconciles under way (see [`Context::in_flight`]).
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
    /// Each pool's pods' reports, read once per round for every Adapter of the pool.
    pub pod_index: super::pod_index::PodIndex,
    /// Per pool (`ns/pool`): the fleet policy's latest decision of each of its `auto` Adapters.
    /// The leader is the only decider, so this record is newer than any status a cache holds:
    /// every decision reads the pool's others from it (one decision at a time), and the merge
    /// budget holds however far a watch lags.
    pub fleet_decisions:
        Mutex<HashMap<String, std::collections::BTreeMap<String, crate::fleet::merge::Decided>>>,
    /// Per pool (`ns/pool`): the id ledger this operator last wrote to the pool's status, with
    /// the pool's uid. The pool controller is the ledger's one writer and only the leader runs
    /// it, so this record is newer than any status a cache holds: a reconcile started from a
    /// pool object its watch has not refreshed since the last write would otherwise give the
    /// same ids again. Lost on restart, when the first write starts from the cache under a
    /// resourceVersion precondition (see `pool::status`).
    ledgers: Mutex<HashMap<String, (String, super::ids::Ledger)>>,
}

/// Counts a reconcile as under way while it lives (`Context::reconciling`).
pub struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// First retry delay of a failed reload: a refusal does not go away by asking every 5 s.
pub const RELOAD_BACKOFF_FIRST: Duration = Duration::from_secs(10);
/// Longest delay between two reloads of a pod that keeps refusing.
pub const RELOAD_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// A pod whose reload failed: how often in a row, when to ask again, and the last failure.
#[derive(Debug, Clone)]
struct Failing {
    /// The config hash the pod failed to take: a new config is asked for at once.
    hash: String,
    attempts: u32,
    retry_at: Instant,
    failure: ReloadFailure,
}

/// Why a ready pod does not run the pool's current config: it refused `POST /admin/reload`
/// (anything but 409 `config_stale`) or did not answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadFailure {
    /// Pod name.
    pub pod: String,
    /// The worker's JSON error `code` (`config_invalid`, `unauthorized`, ...); `http_<status>`
    /// when its answer carried none; `pod_unreachable` when it did not answer.
    pub code: String,
    /// What the worker said, or why it could not be reached.
    pub message: String,
}

impl std::fmt::Display for ReloadFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.pod, self.code, self.message)
    }
}

impl Context {
    /// A context for `client`, reporting Events as `instance`. Its stores are unfed until
    /// [`Context::with_stores`] gives it the controllers' (`controller::run` does): a reconcile
    /// against unfed stores fails with `store_closed` rather than reading them as empty.
    pub fn new(client: Client, instance: String, metrics: Metrics, pods: PodClient) -> Self {
        let recorder = Publisher::new(client.clone(), "mole-operator", &instance);
        // The writers go at once: `Stores::ready` then fails instead of waiting forever.
        let (stores, _) = Stores::new();
        Self {
            client,
            stores,
            recorder,
            metrics,
            pods,
            images: resources::WorkerDefaults::default(),
            failures: Mutex::default(),
            in_flight: Arc::default(),
            pod_index: super::pod_index::PodIndex::default(),
            fleet_decisions: Mutex::default(),
            ledgers: Mutex::default(),
            reloaded: Mutex::default(),
            reload_failures: Mutex::default(),
            reload_backoff: (RELOAD_BACKOFF_FIRST, RELOAD_BACKOFF_MAX),
            traffic: Mutex::default(),
        }
    }

    /// The number of reconciles under way, readable after the context is handed to the
    /// controllers: a shutdown waits for it to reach zero (bounded by its grace), whatever
    /// state the controllers' own graceful shutdown is in (kube-runtime's waits for a first
    /// list that a shutdown right after the start never delivers).
    pub fn in_flight(&self) -> Arc<std::sync::atomic::AtomicUsize> {
        self.in_flight.clone()
    }

    /// Marks a reconcile under way until the guard drops.
    pub fn reconciling(&self) -> InFlight {
        self.in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(self.in_flight.clone())
    }

    /// The ledger last written to pool `key` (`ns/pool`) of uid `uid`, if this process wrote
    /// it (see `ledgers`).
    pub fn written_ledger(&self, key: &str, uid: &str) -> Option<super::ids::Ledger> {
        self.ledgers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .filter(|(u, _)| u == uid)
            .map(|(_, l)| l.clone())
    }

    /// Records the ledger the API server accepted for pool `key` of uid `uid`; None forgets
    /// it (a write whose outcome is unknown: the next one starts from the cache, guarded).
    pub fn record_ledger(&self, key: &str, uid: &str, ledger: Option<super::ids::Ledger>) {
        let mut all = self.ledgers.lock().unwrap_or_else(PoisonError::into_inner);
        match ledger {
            Some(l) => {
                all.insert(key.to_string(), (uid.to_string(), l));
            }
            None => {
                all.remove(key);
            }
        }
    }

    /// The same context with pool readings that serve for `freshness` (zero: every Adapter
    /// reconcile asks the pods itself, as the scenario tests do to see each change at once).
    pub fn with_pod_freshness(mut self, freshness: Duration) -> Self {
        self.pod_index = super::pod_index::PodIndex::new(freshness);
        self
    }

    /// The same context retrying failed reloads after `first`, doubling up to `max` (instead
    /// of [`RELOAD_BACKOFF_FIRST`] and [`RELOAD_BACKOFF_MAX`]).
    pub fn with_reload_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.reload_backoff = (first, max);
        self
    }

    /// The same context reading pools and Adapters from `stores`.
    pub fn with_stores(mut self, stores: Stores) -> Self {
        self.stores = stores;
        self
    }

    /// The same context with `images` as the default worker images (instead of the released
    /// ones at this operator's version).
    pub fn with_worker_defaults(mut self, images: resources::WorkerDefaults) -> Self {
        self.images = images;
        self
    }

    /// The pods of `pool` that have not accepted `hash` yet (and forgets pods that are gone).
    pub fn pods_to_reload(&self, pool: &str, pods: &[ReadyPod], hash: &str) -> Vec<ReadyPod> {
        let mut all = self.reloaded.lock().unwrap_or_else(PoisonError::into_inner);
        let seen = all.entry(pool.to_string()).or_default();
        seen.retain(|k, _| pods.iter().any(|p| &p.key() == k));
        self.reload_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(pool.to_string())
            .or_default()
            .retain(|k, _| pods.iter().any(|p| &p.key() == k));
        pods.iter()
            .filter(|p| seen.get(&p.key()).map(String::as_str) != Some(hash))
            .cloned()
            .collect()
    }

    /// Whether `pod` of `pool` may be asked to reload `hash` now: it has not failed, or failed
    /// on another config, or its backoff has run out.
    pub fn reload_due(&self, pool: &str, pod: &ReadyPod, hash: &str) -> bool {
        self.reload_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(pool)
            .and_then(|m| m.get(&pod.key()))
            .is_none_or(|f| f.hash != hash || f.retry_at <= Instant::now())
    }

    /// Records a failed reload of `hash` by `pod`; returns how long until it is asked again
    /// (the first delay doubling with each failure in a row, capped).
    pub fn reload_failed(
        &self,
        pool: &str,
        pod: &ReadyPod,
        hash: &str,
        failure: ReloadFailure,
    ) -> Duration {
        let (first, max) = self.reload_backoff;
        let mut all = self
            .reload_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let f = all
            .entry(pool.to_string())
            .or_default()
            .entry(pod.key())
            .or_insert(Failing {
                hash: hash.to_string(),
                attempts: 0,
                retry_at: Instant::now(),
                failure: failure.clone(),
            });
        f.attempts = (f.attempts + 1).min(16);
        let delay = first.saturating_mul(1 << (f.attempts - 1)).min(max);
        f.retry_at = Instant::now() + delay;
        f.failure = failure;
        f.hash = hash.to_string();
        delay
    }

    /// Forgets the failures of `pod` of `pool`: it answered (a stale file is no failure).
    pub fn reload_answered(&self, pool: &str, pod: &ReadyPod) {
        if let Some(m) = self
            .reload_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(pool)
        {
            m.remove(&pod.key());
        }
    }

    /// The pods of `pool` whose last reload failed (sorted by pod), and how long until the
    /// first of them is asked again.
    pub fn reload_failures(&self, pool: &str) -> (Vec<ReloadFailure>, Option<Duration>) {
        let all = self
            .reload_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(m) = all.get(pool) else {
            return (Vec::new(), None);
        };
        let mut failures: Vec<ReloadFailure> = m.values().map(|f| f.failure.clone()).collect();
        failures.sort_by(|a, b| a.pod.cmp(&b.pod));
        let now = Instant::now();
        let next = m
            .values()
            .map(|f| f.retry_at.saturating_duration_since(now))
            .min();
        (failures, next)
    }

    /// Records that `pod` of `pool` runs the config `hash` (and forgets its failures).
    pub fn reload_accepted(&self, pool: &str, pod: &ReadyPod, hash: &str) {
        self.reload_answered(pool, pod);
        self.reloaded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(pool.to_string())
            .or_default()
            .insert(pod.key(), hash.to_string());
    }

    /// Publishes an Event; a failure to publish is logged, never fatal.
    pub async fn event(
        &self,
        on: &ObjectReference,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        if let Err(e) = self
            .recorder
            .publish(on, warning, reason, action, &note)
            .await
        {
            tracing::warn!(error = %e, reason, "could not publish event");
        }
    }

    /// Backoff for the next retry of `key` after a transient failure: 5 s doubling, capped at
    /// 5 min.
    pub fn backoff(&self, key: &str) -> Duration {
        let mut f = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let n = f.entry(key.to_string()).or_insert(0);
        *n = (*n + 1).min(16);
        Duration::from_secs((5u64 << (*n - 1)).min(300))
    }

    /// Forgets the failures of `key` after a successful reconcile.
    pub fn succeeded(&self, key: &str) {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }
}

#[cfg(test)]
mod tests {
    /// Every reconcile waiting at once for the stores wakes when they fill: kube-runtime 5.0's
    /// `Store::wait_until_ready` woke only the last of several waiters, and against a real API
    /// server the pools' reconciles waited forever.
    #[tokio::test]
    async fn every_waiter_wakes_when_both_stores_are_synced() {
        use kube::runtime::watcher::Event as Watch;
        let (stores, mut w) = Stores::new();
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let s = stores.clone();
                tokio::spawn(async move { s.ready().await })
            })
            .collect();
        // Let every waiter register before the stores fill.
        tokio::time::sleep(Duration::from_millis(50)).await;
        w.pools.apply_watcher_event(&Watch::Init);
        w.pools.apply_watcher_event(&Watch::InitDone);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            waiters.iter().all(|h| !h.is_finished()),
            "ready before the Adapter store was synced"
        );
        w.adapters.apply_watcher_event(&Watch::Init);
        w.adapters.apply_watcher_event(&Watch::InitDone);
        for h in waiters {
            tokio::time::timeout(Duration::from_secs(5), h)
                .await
                .expect("a waiter was never woken")
                .unwrap()
                .unwrap();
        }
        // And a reconcile that comes later passes at once.
        stores.ready().await.unwrap();
    }

    /// SIGTERM while reconciles wait for a store's first list ends their wait: a controller
    /// shut down gracefully stops polling its watch and waits for the reconciles under way,
    /// so on 59739d5 a leader told to stop 18 ms after it took the Lease waited out its whole
    /// shutdown grace (control_plane.rs `sigterm_stops_the_leader_and_hands_the_lease_over`,
    /// on CI: "the new leader did not exit within 10 s of SIGTERM").
    #[tokio::test]
    async fn a_shutdown_ends_every_wait_for_a_first_list() {
        use kube::runtime::watcher::Event as Watch;
        let (stores, mut w) = Stores::new();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        w.close_on(async move {
            let _ = stopped.await;
        });
        w.pools.apply_watcher_event(&Watch::Init);
        w.pools.apply_watcher_event(&Watch::InitDone);
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let s = stores.clone();
                tokio::spawn(async move { s.ready().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(waiters.iter().all(|h| !h.is_finished()));
        stop.send(()).unwrap();
        for h in waiters {
            let r = tokio::time::timeout(Duration::from_secs(5), h)
                .await
                .expect("a waiter still waited after the shutdown")
                .unwrap();
            assert!(matches!(r, Err(Error::ShuttingDown)), "{r:?}");
        }
        // No Warning Event for it: not the object's problem.
        assert_eq!(Error::ShuttingDown.code(), "shutting_down");
    }

    use super::*;

    /// A context whose API server answers nothing (the reload bookkeeping needs none).
    fn context() -> Context {
        let svc = tower::service_fn(|_req: http::Request<kube::client::Body>| async {
            Err::<http::Response<kube::client::Body>, std::io::Error>(std::io::Error::other(
                "no API server in this test",
            ))
        });
        Context::new(
            Client::new(svc, "ml"),
            "test".into(),
            Metrics::new(),
            PodClient::new(8000),
        )
    }

    #[tokio::test]
    async fn a_failing_pod_is_asked_again_after_a_doubling_capped_delay() {
        let ctx = context();
        let pod = ReadyPod {
            name: "p".into(),
            ip: "10.0.0.1".into(),
        };
        let failure = ReloadFailure {
            pod: "p".into(),
            code: "config_invalid".into(),
            message: "bad".into(),
        };
        assert!(ctx.reload_due("ml/vl", &pod, "h1"));
        let delays: Vec<u64> = (0..7)
            .map(|_| {
                ctx.reload_failed("ml/vl", &pod, "h1", failure.clone())
                    .as_secs()
            })
            .collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 300, 300]);
        assert!(!ctx.reload_due("ml/vl", &pod, "h1"), "within its backoff");
        assert!(
            ctx.reload_due("ml/vl", &pod, "h2"),
            "a new config is asked at once"
        );
        let (failed, next) = ctx.reload_failures("ml/vl");
        assert_eq!(failed, vec![failure]);
        assert!(next.unwrap() <= Duration::from_secs(300));
        // An answer (stale file or accepted) forgets the failures; a pod gone is forgotten.
        ctx.reload_answered("ml/vl", &pod);
        assert!(ctx.reload_failures("ml/vl").0.is_empty());
        ctx.reload_failed("ml/vl", &pod, "h1", failure_of("p"));
        assert!(ctx.pods_to_reload("ml/vl", &[], "h1").is_empty());
        assert!(ctx.reload_failures("ml/vl").0.is_empty());
    }

    fn failure_of(pod: &str) -> ReloadFailure {
        ReloadFailure {
            pod: pod.into(),
            code: "pod_unreachable".into(),
            message: "connection refused".into(),
        }
    }
}
