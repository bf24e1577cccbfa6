//! The adapter registry: which version of each adapter new requests get, where its weights
//! live, and the least-recently-used eviction that keeps at most `capacity` adapters resident.
//!
//! Versions are immutable: a request pins an `Arc` of the version current when it was
//! submitted; loading a new version swaps only later requests over, and the old weights are
//! freed when the last request holding them ends. Beyond `maxLoras` device-resident
//! adapters, the least recently used idle one moves to a host-memory tier of `maxCpuLoras`
//! (a copy back to the device is a memcpy, not a file read); beyond that it goes back to disk,
//! keeping its spec, and is read again on its next request.
//!
//! A request for an adapter on disk waits for one read however many requests ask for it
//! (single flight: the first starts the read, the others queue behind it), and whatever it
//! is answered with is pinned before anything is evicted, so a request for a known adapter is
//! never refused for lack of a slot: with every slot held by requests, the registry stays over
//! capacity until one of them finishes (as vLLM and S-LoRA keep a running batch's adapters).
//! A read carries the generation of the version it was started for, and is dropped when the
//! adapter was replaced or unloaded meanwhile.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use mole_api::{LoraAdapterInfo, Residency};

use crate::model::LoraAdapter;

/// An adapter to load (from the worker config or `/v1/load_lora_adapter`).
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterSpec {
    /// Name requests use.
    pub name: String,
    /// Version (a new version loads beside the old one).
    pub version: String,
    /// Pool-wide id.
    pub lora_id: u32,
    /// Directory with adapter_config.json + adapter_model.safetensors (already confined to the
    /// model root by the caller).
    pub path: std::path::PathBuf,
}

/// Request counters of one adapter version (shared with the sequences that pinned it).
#[derive(Debug, Default)]
pub struct VersionStats {
    /// Completed requests.
    pub requests: AtomicU64,
    /// Requests running or waiting now.
    pub running: AtomicU64,
}

/// What a request holds for the life of the request.
#[derive(Debug, Clone)]
pub struct Pinned {
    /// Adapter name.
    pub name: String,
    /// Version pinned at submit.
    pub version: String,
    /// The weights (kept alive by this handle even after an unload or a new version).
    pub adapter: Arc<LoraAdapter>,
    /// Counters of this version.
    pub stats: Arc<VersionStats>,
}

impl Pinned {
    /// Counts the request as running; [`Pinned::finish`] undoes it.
    pub fn start(&self) {
        self.stats.running.fetch_add(1, Ordering::Relaxed);
    }
    /// Counts the request as done.
    pub fn finish(&self) {
        self.stats.running.fetch_sub(1, Ordering::Relaxed);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
    }
}

struct Entry<W> {
    spec: AdapterSpec,
    /// Set anew by every insert: a read from disk started for another is stale.
    generation: u64,
    /// Requests waiting for the read from disk under way (None: no read under way).
    loading: Option<Vec<W>>,
    /// On the compute device.
    weights: Option<Arc<LoraAdapter>>,
    /// In host memory (evicted from the device, not yet to disk).
    host: Option<Arc<LoraAdapter>>,
    rank: usize,
    bytes: u64,
    warning: Option<String>,
    stats: Arc<VersionStats>,
    last_used: Instant,
}

/// A replaced or unloaded version still held by running requests.
#[derive(Debug)]
struct Draining {
    spec: AdapterSpec,
    weights: Weak<LoraAdapter>,
    rank: usize,
    bytes: u64,
    stats: Arc<VersionStats>,
}

/// Result of looking an adapter up for a new request that waits as `W`.
pub enum Lookup<W> {
    /// Resident (or back from host memory): pinned, and the waiter handed back.
    Ready(Pinned, W),
    /// On disk: the waiter waits for the read this caller must start: read `ticket.spec`
    /// (off the caller's thread), then hand the result to [`Registry::loaded`].
    Load(LoadTicket),
    /// On disk with a read under way: the waiter waits for it.
    Queued,
    /// Not known: the waiter handed back.
    Unknown(W),
}

/// A read from disk to start: the version to read and the generation it is for.
#[derive(Debug)]
pub struct LoadTicket {
    /// The version to read.
    pub spec: AdapterSpec,
    generation: u64,
}

/// Why a waiting request gets no adapter.
#[derive(Debug, Clone, PartialEq)]
pub enum Missed {
    /// The adapter was unloaded while the request waited.
    Unloaded(String),
    /// The read from disk failed (the next request reads it again).
    Failed {
        /// Adapter name.
        name: String,
        /// Why.
        reason: String,
    },
}

/// Waiters whose wait ended, with what they got: the caller hands each its result (outside
/// the registry's lock).
pub type Settled<W> = Vec<(W, Result<Pinned, Missed>)>;

/// The registry (interior mutability; shared by the server threads and the engine). `W` is
/// what a request waiting for a read from disk is held as.
pub struct Registry<W> {
    inner: Mutex<Inner<W>>,
    capacity: usize,
    host_capacity: usize,
    device: candle_core::Device,
    residency: Residency,
    /// Evictions since start.
    pub evictions: AtomicU64,
}

struct Inner<W> {
    current: HashMap<String, Entry<W>>,
    draining: Vec<Draining>,
    /// The last refused load of each adapter (cleared when a version of it loads).
    failed: HashMap<String, (AdapterSpec, String)>,
    /// The last generation given out.
    generation: u64,
}

impl<W> Default for Inner<W> {
    fn default() -> Self {
        Self {
            current: HashMap::new(),
            draining: Vec::new(),
            failed: HashMap::new(),
            generation: 0,
        }
    }
}

impl<W> Entry<W> {
    /// Pins the resident weights for a request.
    fn pin(&mut self) -> Option<Pinned> {
        let w = self.weights.clone()?;
        Some(self.pin_weights(w))
    }

    /// Pins `w`, this entry's resident weights.
    fn pin_weights(&mut self, w: Arc<LoraAdapter>) -> Pinned {
        self.last_used = Instant::now();
        Pinned {
            name: self.spec.name.clone(),
            version: self.spec.version.clone(),
            adapter: w,
            stats: self.stats.clone(),
        }
    }
}

impl<W> std::fmt::Debug for Registry<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("capacity", &self.capacity)
            .field("host_capacity", &self.host_capacity)
            .finish_non_exhaustive()
    }
}

impl<W> Registry<W> {
    /// A registry keeping at most `capacity` adapters on `device` and `host_capacity` more in
    /// host memory. Device slots are reported `gpu` on a GPU and `cpu` on a CPU worker.
    pub fn new(capacity: usize, host_capacity: usize, device: candle_core::Device) -> Self {
        let residency = if device.is_cpu() {
            Residency::Cpu
        } else {
            Residency::Gpu
        };
        Self {
            inner: Mutex::new(Inner::default()),
            capacity: capacity.max(1),
            host_capacity,
            device,
            residency,
            evictions: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<W>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `spec` (its version, from its directory, under its id) is current and resident:
    /// a reload of it is a no-op, while the same version from another directory loads anew.
    pub fn is_current(&self, spec: &AdapterSpec) -> bool {
        let g = self.lock();
        g.current
            .get(&spec.name)
            .is_some_and(|e| e.spec == *spec && e.weights.is_some())
    }

    /// Makes `weights` the current version of `spec.name`; the version it replaces drains.
    /// Requests waiting for a read of the adapter from disk get this version (and the read,
    /// when it ends, is dropped). Evicts least-recently-used idle adapters beyond capacity.
    pub fn insert(&self, spec: AdapterSpec, weights: Arc<LoraAdapter>) -> Settled<W> {
        let mut g = self.lock();
        g.failed.remove(&spec.name);
        g.generation += 1;
        let generation = g.generation;
        let (rank, bytes, warning) = (weights.rank, weights.bytes, weights.warning.clone());
        let mut waiters = Vec::new();
        let stats = match g.current.remove(&spec.name) {
            Some(old) => {
                waiters = old.loading.unwrap_or_default();
                match old.weights {
                    // Same version read back after an eviction: keep its counters. (The same
                    // version from another directory is a new load: the old one drains.)
                    _ if old.spec == spec => old.stats,
                    Some(w) => {
                        g.draining.push(Draining {
                            spec: old.spec,
                            weights: Arc::downgrade(&w),
                            rank: old.rank,
                            bytes: old.bytes,
                            stats: old.stats,
                        });
                        Arc::default()
                    }
                    None => Arc::default(),
                }
            }
            None => Arc::default(),
        };
        let mut e = Entry {
            spec,
            generation,
            loading: None,
            weights: Some(weights.clone()),
            host: None,
            rank,
            bytes,
            warning,
            stats,
            last_used: Instant::now(),
        };
        // Pinned before anything is evicted: the waiters' version stays.
        let settled = waiters
            .into_iter()
            .map(|w| (w, Ok(e.pin_weights(weights.clone()))))
            .collect();
        // Only the pins hold it now: unpinned, it may be evicted like any idle adapter.
        drop(weights);
        g.current.insert(e.spec.name.clone(), e);
        self.evict(&mut g);
        settled
    }

    /// Ends the read from disk `ticket` was given for: its waiters get the weights, pinned
    /// before anything is evicted (or the failure's reason). A read whose adapter was
    /// replaced or unloaded since it started is dropped: it never makes its version current
    /// again.
    pub fn loaded(
        &self,
        ticket: LoadTicket,
        weights: Result<Arc<LoraAdapter>, String>,
    ) -> Settled<W> {
        let mut g = self.lock();
        let Some(e) = g
            .current
            .get_mut(&ticket.spec.name)
            .filter(|e| e.generation == ticket.generation)
        else {
            tracing::info!(adapter = %ticket.spec.name, version = %ticket.spec.version,
                "read from disk dropped: the adapter changed meanwhile");
            return Vec::new();
        };
        let waiters = e.loading.take().unwrap_or_default();
        let settled = match weights {
            Ok(weights) => {
                e.weights = Some(weights.clone());
                e.host = None;
                waiters
                    .into_iter()
                    .map(|w| (w, Ok(e.pin_weights(weights.clone()))))
                    .collect()
            }
            Err(reason) => waiters
                .into_iter()
                .map(|w| {
                    let missed = Missed::Failed {
                        name: e.spec.name.clone(),
                        reason: reason.clone(),
                    };
                    (w, Err(missed))
                })
                .collect(),
        };
        self.evict(&mut g);
        settled
    }

    fn evict(&self, g: &mut Inner<W>) {
        // Device tier: only adapters no request holds can go; if all are busy the registry
        // stays over capacity until one finishes (never drops weights a request is using).
        loop {
            let resident = g.current.values().filter(|e| e.weights.is_some()).count();
            if resident <= self.capacity {
                break;
            }
            let victim = g
                .current
                .values_mut()
                .filter(|e| {
                    e.weights
                        .as_ref()
                        .is_some_and(|w| Arc::strong_count(w) == 1)
                })
                .min_by_key(|e| e.last_used);
            let Some(e) = victim else { break };
            let w = e.weights.take().expect("filtered");
            self.evictions.fetch_add(1, Ordering::Relaxed);
            if self.host_capacity > 0 {
                let host = if self.device.is_cpu() {
                    Ok(w)
                } else {
                    w.to_device(&candle_core::Device::Cpu).map(Arc::new)
                };
                e.host = host.ok();
            }
            tracing::info!(adapter = %e.spec.name, version = %e.spec.version,
                to = if e.host.is_some() { "host" } else { "disk" }, "evicted (LRU)");
        }
        // Host tier: the least recently used go back to disk.
        loop {
            let held = g.current.values().filter(|e| e.host.is_some()).count();
            if held <= self.host_capacity {
                break;
            }
            let Some(e) = g
                .current
                .values_mut()
                .filter(|e| e.host.is_some())
                .min_by_key(|e| e.last_used)
            else {
                break;
            };
            e.host = None;
        }
    }

    /// Pins the current version of `name` for a new request that waits as `waiter`: at once
    /// when it is on the device or in host memory (copied back; pinned before anything is
    /// evicted), else after the one read from disk (see [`Lookup`]).
    pub fn lookup(&self, name: &str, waiter: W) -> Lookup<W> {
        let mut g = self.lock();
        let Some(e) = g.current.get_mut(name) else {
            return Lookup::Unknown(waiter);
        };
        if e.weights.is_none() {
            // In host memory: back onto the device (a copy on a GPU, nothing on a CPU).
            if let Some(h) = e.host.take() {
                let back = if self.device.is_cpu() {
                    Ok(h)
                } else {
                    h.to_device(&self.device).map(Arc::new)
                };
                e.weights = back.ok();
            }
        }
        if let Some(p) = e.pin() {
            self.evict(&mut g);
            return Lookup::Ready(p, waiter);
        }
        match &mut e.loading {
            Some(waiters) => {
                waiters.push(waiter);
                Lookup::Queued
            }
            None => {
                e.loading = Some(vec![waiter]);
                Lookup::Load(LoadTicket {
                    spec: e.spec.clone(),
                    generation: e.generation,
                })
            }
        }
    }

    /// Records why a version of an adapter was refused; whatever version serves keeps serving.
    pub fn record_failure(&self, spec: AdapterSpec, reason: String) {
        let mut g = self.lock();
        g.failed.insert(spec.name.clone(), (spec, reason));
    }

    /// Removes `name`; requests holding it finish on it, requests waiting for its read from
    /// disk are refused. False when it was not known.
    pub fn remove(&self, name: &str) -> (bool, Settled<W>) {
        let mut g = self.lock();
        let had_failure = g.failed.remove(name).is_some();
        match g.current.remove(name) {
            Some(e) => {
                let settled = e
                    .loading
                    .unwrap_or_default()
                    .into_iter()
                    .map(|w| (w, Err(Missed::Unloaded(name.to_string()))))
                    .collect();
                if let Some(w) = e.weights {
                    g.draining.push(Draining {
                        spec: e.spec,
                        weights: Arc::downgrade(&w),
                        rank: e.rank,
                        bytes: e.bytes,
                        stats: e.stats,
                    });
                }
                (true, settled)
            }
            None => (had_failure, Vec::new()),
        }
    }

    /// Enforces capacity again (after requests released adapters).
    pub fn trim(&self) {
        let mut g = self.lock();
        self.evict(&mut g);
    }

    /// Current versions, versions still draining (`loaded: false`: they take no new requests),
    /// and refused versions (`loaded: false` with the reason in `error`).
    pub fn infos(&self) -> Vec<LoraAdapterInfo> {
        let mut g = self.lock();
        g.draining.retain(|d| d.weights.strong_count() > 0);
        let mut out: Vec<LoraAdapterInfo> = g
            .current
            .values()
            .map(|e| LoraAdapterInfo {
                name: e.spec.name.clone(),
                version: e.spec.version.clone(),
                lora_id: e.spec.lora_id,
                path: Some(e.spec.path.display().to_string()),
                residency: match (&e.weights, &e.host) {
                    (Some(_), _) => self.residency,
                    (None, Some(_)) => Residency::Cpu,
                    (None, None) => Residency::Disk,
                },
                loaded: true,
                rank: e.rank as u32,
                bytes: if e.weights.is_some() || e.host.is_some() {
                    e.bytes
                } else {
                    0
                },
                requests: e.stats.requests.load(Ordering::Relaxed),
                running: e.stats.running.load(Ordering::Relaxed),
                error: None,
                warning: e.warning.clone(),
            })
            .chain(g.draining.iter().map(|d| LoraAdapterInfo {
                name: d.spec.name.clone(),
                version: d.spec.version.clone(),
                lora_id: d.spec.lora_id,
                path: Some(d.spec.path.display().to_string()),
                residency: self.residency,
                loaded: false,
                rank: d.rank as u32,
                bytes: d.bytes,
                requests: d.stats.requests.load(Ordering::Relaxed),
                running: d.stats.running.load(Ordering::Relaxed),
                error: None,
                warning: None,
            }))
            .chain(g.failed.values().map(|(spec, reason)| LoraAdapterInfo {
                name: spec.name.clone(),
                version: spec.version.clone(),
                lora_id: spec.lora_id,
                path: Some(spec.path.display().to_string()),
                residency: Residency::Disk,
                loaded: false,
                rank: 0,
                bytes: 0,
                requests: 0,
                running: 0,
                error: Some(reason.clone()),
                warning: None,
            }))
            .collect();
        out.sort_by(|a, b| (&a.name, &a.version).cmp(&(&b.name, &b.version)));
        out
    }
}
