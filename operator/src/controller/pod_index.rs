//! One reading of a pool's dynamic pods per round, shared by every Adapter reconcile of that
//! pool.
//!
//! Each Adapter reconcile used to list the pool's pods, read its token Secret and ask every
//! ready pod `GET /v1/lora_adapters` in turn: a resync of 500 Adapters on 8 pods cost 4,000
//! pod calls and 1,500 API calls for that part alone. Here a pool's reading (its ready pods
//! and what each reported) is taken at most once per freshness interval, by one reconcile at a
//! time (the others wait for it and share it), the pods asked concurrently; the pool's
//! operator token, constant for its lifetime, is read once. The pool controller invalidates a
//! pool's reading when it has asked its pods to reload, so an Adapter never judges its
//! readiness from a listing older than the config it waits for.
//!
//! The pool's merged Deployments and Jobs are read the same way ([`Children`]): one LIST of
//! each per interval for all its Adapters, instead of a GET and a LIST per Adapter; an Adapter
//! that writes one of them invalidates them ([`PodIndex::children_changed`]), so its next
//! reconcile reads what it wrote.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};
use mole_crds::constants::{LABEL_APP_COMPONENT, LABEL_APP_INSTANCE};
use mole_crds::{InferencePool, LoraAdaptersResponse};

use super::pod_client::{operator_token, ready_pods, PodClient, ReadyPod};
use crate::error::Result;

/// How long a pool's reading serves (`--pod-poll-interval`, `MOLE_POD_POLL_MS`).
pub const DEFAULT_FRESHNESS: Duration = Duration::from_secs(2);

/// Pods asked at once in one reading.
const CONCURRENCY: usize = 16;

/// What a pool's ready dynamic pods reported, at one moment.
#[derive(Debug, Clone)]
pub struct PoolReading {
    /// The ready dynamic pods.
    pub pods: Vec<ReadyPod>,
    /// Each ready pod's listing, or why it could not be read, in the order of `pods`.
    pub reports: Vec<std::result::Result<LoraAdaptersResponse, String>>,
    /// When it was taken.
    pub taken: Instant,
}

/// A pool's merged Deployments and Jobs, at one moment.
#[derive(Debug, Clone)]
pub struct Children {
    /// Its merged Deployments (`app.kubernetes.io/component=merged`).
    pub deployments: Vec<Deployment>,
    /// Its Jobs (merge, fetch, cleanup).
    pub jobs: Vec<Job>,
    /// When they were read.
    pub taken: Instant,
}

impl Children {
    /// The Deployment `name`, when the pool has it.
    pub fn deployment(&self, name: &str) -> Option<&Deployment> {
        self.deployments
            .iter()
            .find(|d| d.metadata.name.as_deref() == Some(name))
    }

    /// The Job `name`, when the pool has it.
    pub fn job(&self, name: &str) -> Option<&Job> {
        self.jobs
            .iter()
            .find(|j| j.metadata.name.as_deref() == Some(name))
    }

    /// The Jobs whose labels include every `key=value` of `selector` (equality terms only,
    /// comma-separated, as the operator writes its selectors).
    pub fn jobs_matching(&self, selector: &str) -> Vec<Job> {
        let terms: Vec<(&str, &str)> = selector
            .split(',')
            .filter_map(|t| t.split_once('='))
            .map(|(k, v)| (k.trim(), v.trim()))
            .collect();
        self.jobs
            .iter()
            .filter(|j| {
                let labels = j.metadata.labels.as_ref();
                terms
                    .iter()
                    .all(|(k, v)| labels.and_then(|l| l.get(*k)).map(String::as_str) == Some(*v))
            })
            .cloned()
            .collect()
    }
}

/// Per pool: its latest value, behind a lock one reading at a time holds.
type Slot<T> = Arc<tokio::sync::Mutex<Option<Arc<T>>>>;

/// One kind of per-pool reading: the latest per pool and when each was last made stale.
struct Cache<T> {
    slots: Mutex<HashMap<String, Slot<T>>>,
    invalidated: Mutex<HashMap<String, Instant>>,
}

impl<T> Default for Cache<T> {
    fn default() -> Self {
        Self {
            slots: Mutex::default(),
            invalidated: Mutex::default(),
        }
    }
}

impl<T> Cache<T> {
    fn slot(&self, k: &str) -> Slot<T> {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(k.to_string())
            .or_default()
            .clone()
    }

    fn invalidate(&self, k: &str) {
        self.invalidated
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(k.to_string(), Instant::now());
    }

    /// Whether a reading taken at `taken` still serves.
    fn usable(&self, k: &str, taken: Instant, freshness: Duration) -> bool {
        let invalidated = self
            .invalidated
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(k)
            .copied();
        taken.elapsed() < freshness && invalidated.is_none_or(|at| taken > at)
    }

    fn forget(&self, k: &str) {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(k);
        self.invalidated
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(k);
    }
}

/// The readings of every pool, and their tokens.
pub struct PodIndex {
    freshness: Duration,
    reports: Cache<PoolReading>,
    children: Cache<Children>,
    /// Each pool's operator token, by the pool's uid (a recreated pool gets its own).
    tokens: Mutex<HashMap<String, String>>,
}

impl Default for PodIndex {
    fn default() -> Self {
        Self::new(DEFAULT_FRESHNESS)
    }
}

fn key(pool: &InferencePool) -> String {
    format!(
        "{}/{}",
        pool.namespace().unwrap_or_default(),
        pool.name_any()
    )
}

impl PodIndex {
    /// An index whose readings serve for `freshness` (zero: every call reads afresh).
    pub fn new(freshness: Duration) -> Self {
        Self {
            freshness,
            reports: Cache::default(),
            children: Cache::default(),
            tokens: Mutex::default(),
        }
    }

    /// The pool's operator token (its Secret read, or created, once).
    pub async fn token(&self, client: &Client, pool: &InferencePool) -> Result<String> {
        let uid = pool.metadata.uid.clone().unwrap_or_else(|| key(pool));
        if let Some(t) = self
            .tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&uid)
        {
            return Ok(t.clone());
        }
        let t = operator_token(client, pool).await?;
        self.tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(uid, t.clone());
        Ok(t)
    }

    /// Marks the pool's pod readings stale: its pods were just told to reload.
    pub fn invalidate(&self, pool: &InferencePool) {
        self.reports.invalidate(&key(pool));
    }

    /// Marks the pool's children stale: an Adapter just wrote one of them.
    pub fn children_changed(&self, pool: &InferencePool) {
        self.children.invalidate(&key(pool));
    }

    /// Forgets a pool (deleted).
    pub fn forget(&self, pool: &InferencePool) {
        let k = key(pool);
        self.reports.forget(&k);
        self.children.forget(&k);
        if let Some(uid) = &pool.metadata.uid {
            self.tokens
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(uid);
        }
    }

    /// The pool's merged Deployments and Jobs: the last reading while it is fresh and was
    /// taken after the last change an Adapter made, else a new one (two LISTs).
    pub async fn children(&self, client: &Client, pool: &InferencePool) -> Result<Arc<Children>> {
        let k = key(pool);
        let slot = self.children.slot(&k);
        let mut held = slot.lock().await;
        if let Some(c) = held
            .as_ref()
            .filter(|c| self.children.usable(&k, c.taken, self.freshness))
        {
            return Ok(c.clone());
        }
        let taken = Instant::now();
        let ns = pool.namespace().unwrap_or_default();
        let name = pool.name_any();
        let deployments = Api::<Deployment>::namespaced(client.clone(), &ns)
            .list(&ListParams::default().labels(&format!(
                "{LABEL_APP_INSTANCE}={name},{LABEL_APP_COMPONENT}=merged"
            )))
            .await?
            .items;
        let jobs = Api::<Job>::namespaced(client.clone(), &ns)
            .list(&ListParams::default().labels(&format!("{LABEL_APP_INSTANCE}={name}")))
            .await?
            .items;
        let c = Arc::new(Children {
            deployments,
            jobs,
            taken,
        });
        *held = Some(c.clone());
        Ok(c)
    }

    /// The pool's reading: the last one while it is fresh and was taken after the last
    /// invalidation, else a new one (one at a time per pool; concurrent callers share it).
    pub async fn reading(
        &self,
        client: &Client,
        pods_client: &PodClient,
        pool: &InferencePool,
    ) -> Result<Arc<PoolReading>> {
        let k = key(pool);
        let slot = self.reports.slot(&k);
        let mut held = slot.lock().await;
        if let Some(r) = held
            .as_ref()
            .filter(|r| self.reports.usable(&k, r.taken, self.freshness))
        {
            return Ok(r.clone());
        }
        let taken = Instant::now();
        let token = self.token(client, pool).await?;
        let ns = pool.namespace().unwrap_or_default();
        let pods = ready_pods(client, &ns, &pool.name_any()).await?;
        // Owned futures: a stream of futures borrowing the client is not `Send` for every
        // lifetime, which the controller's reconcile future must be.
        let asks: Vec<_> = pods
            .iter()
            .cloned()
            .map(|p| {
                let (client, token) = (pods_client.clone(), token.clone());
                async move { client.adapters(&p, &token).await.map_err(|e| e.to_string()) }
            })
            .collect();
        let reports = futures::stream::iter(asks)
            .buffered(CONCURRENCY)
            .collect::<Vec<_>>()
            .await;
        let r = Arc::new(PoolReading {
            pods,
            reports,
            taken,
        });
        *held = Some(r.clone());
        Ok(r)
    }
}
